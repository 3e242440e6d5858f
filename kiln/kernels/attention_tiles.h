// Attention's two inner tiles on the AVX-512 path (attention_avx512.cpp), called from attention.cpp where
// isa.h says the CPU has AVX-512.
//
// Why a second path: a decode step's attention over a long history is arithmetic, not memory (a key is
// used by every query head of its group and every row of the step): the AVX2 tiles load a query vector for
// each multiply-add and spend about as long loading as multiplying. With 32 registers of 16 lanes a tile
// holds several keys' sums at once and loads each query vector once for all of them, and the weighted
// values take a weight's broadcast once for 16 lanes.
//
// Same bits as the AVX2 tiles (attention.cpp): every lane does the same operations in the same order. A
// 16-lane sum of scores holds the AVX2 tile's two 8-lane sums (channels d .. d + 7 of each 16, "even", in
// the low half; d + 8 .. d + 15, "odd", in the high half), added half to half and then summed with the same
// horizontal_sum; a 16-lane block of weighted values is two of the AVX2 tile's 8-lane blocks side by side.
// How many keys or channel blocks a pass holds changes only which independent sums share an instruction,
// never the order of any sum.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "page_format.h"

namespace kiln::attention {

constexpr int64_t kMaxPage = page_format::kMaxPageTokens;

// score[j][i] = (query head j . key i) * scale for the G query heads at query (G x D floats), key i at
// k + offsets[i]; the values' lines (v + offsets[i]) are prefetched meanwhile, and the next page's keys and
// values at the same offsets (next_k, next_v; null: none) into L2, as attention.cpp's tile_scores does.
template <int G, class T>
void scores_avx512(const float* query, const T* k, const T* v, const T* next_k, const T* next_v, const int64_t* offsets,
                   int64_t count, int64_t D, float scale, float (*score)[kMaxPage]);

// out_j = out_j * rescale_j + sum_i weight[j][i] * value_i for the G query heads (out: G x D floats).
template <int G, class T>
void values_avx512(float* out, const T* v, const int64_t* offsets, int64_t count, int64_t D, const float* rescale,
                   const float (*weight)[kMaxPage]);

}  // namespace kiln::attention
