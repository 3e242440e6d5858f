// attention_tiles.h's AVX-512 tiles. Everything included before the target pragma keeps the build's AVX2
// target (as in blocks_avx512.cpp), so no inline function shared with other files is emitted with AVX-512
// instructions; these functions run only where isa.h says the CPU has AVX-512.
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

#include "attention_tiles.h"
#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace kiln::attention {

namespace {

// One vector of 16 or 8 channels, float32 pages as they are and float16 ones widened (exactly): the 8-lane
// one is the last block of a head dimension that is an odd multiple of 8.
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t n = 16;
  static V load(const float* at) { return _mm512_loadu_ps(at); }
  static V load(const at::Half* at) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))); }
  static void store(float* at, V x) { _mm512_storeu_ps(at, x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

struct Lanes8 {
  using V = __m256;
  static constexpr int64_t n = 8;
  static V load(const float* at) { return _mm256_loadu_ps(at); }
  static V load(const at::Half* at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))); }
  static void store(float* at, V x) { _mm256_storeu_ps(at, x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

// Keys i .. i + K - 1 against the G heads: K x G sums of 16 lanes, each query vector loaded once for the K
// keys. A head dimension that is an odd multiple of 8 ends with the low (even) half only, as in AVX2.
template <int G, int K, class T>
[[gnu::always_inline]] inline void score_keys(const float* query, const T* k, const T* v, const T* next_k, const T* next_v,
                                              const int64_t* offsets, int64_t i, int64_t D, float scale,
                                              float (*score)[kMaxPage]) {
  __m512 acc[K][G];
  for (int b = 0; b < K; ++b)
    for (int j = 0; j < G; ++j) acc[b][j] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 key[K];
    for (int b = 0; b < K; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(v + offsets[i + b] + d), _MM_HINT_T0);
      if (next_k) {
        _mm_prefetch(reinterpret_cast<const char*>(next_k + offsets[i + b] + d), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next_v + offsets[i + b] + d), _MM_HINT_T1);
      }
      key[b] = Lanes16::load(k + offsets[i + b] + d);
    }
    for (int j = 0; j < G; ++j) {
      const __m512 q = _mm512_loadu_ps(query + j * D + d);
      for (int b = 0; b < K; ++b) acc[b][j] = _mm512_fmadd_ps(q, key[b], acc[b][j]);
    }
  }
  if (d < D) {
    for (int b = 0; b < K; ++b) {
      const __m512 key = _mm512_castps256_ps512(Lanes8::load(k + offsets[i + b] + d));
      for (int j = 0; j < G; ++j)
        acc[b][j] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_loadu_ps(query + j * D + d)), key, acc[b][j], 0x00ff);
    }
  }
  for (int b = 0; b < K; ++b)
    for (int j = 0; j < G; ++j) {
      const __m256 even = _mm512_castps512_ps256(acc[b][j]);
      const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[b][j]), 1));
      score[j][i + b] = horizontal_sum(_mm256_add_ps(even, odd)) * scale;
    }
}

// Channels d .. d + C * L::n of the G heads' weighted values: even and odd keys in separate sums, added at
// the end, as the AVX2 tile does for each 8-lane block.
template <int G, int C, class L, class T>
[[gnu::always_inline]] inline void value_channels(float* out, const T* v, const int64_t* offsets, int64_t count, int64_t D,
                                                  int64_t d, const float* rescale, const float (*weight)[kMaxPage]) {
  typename L::V even[C][G], odd[C][G];
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < G; ++j) {
      even[c][j] = L::mul(L::set1(rescale[j]), L::load(out + j * D + d + c * L::n));
      odd[c][j] = L::zero();
    }
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const T *first = v + offsets[i] + d, *second = v + offsets[i + 1] + d;
    for (int c = 0; c < C; ++c) {
      const typename L::V a = L::load(first + c * L::n), b = L::load(second + c * L::n);
      for (int j = 0; j < G; ++j) {
        even[c][j] = L::fmadd(L::set1(weight[j][i]), a, even[c][j]);
        odd[c][j] = L::fmadd(L::set1(weight[j][i + 1]), b, odd[c][j]);
      }
    }
  }
  if (i < count) {
    for (int c = 0; c < C; ++c) {
      const typename L::V last = L::load(v + offsets[i] + d + c * L::n);
      for (int j = 0; j < G; ++j) even[c][j] = L::fmadd(L::set1(weight[j][i]), last, even[c][j]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < G; ++j) L::store(out + j * D + d + c * L::n, L::add(even[c][j], odd[c][j]));
}

}  // namespace

template <int G, class T>
void scores_avx512(const float* query, const T* k, const T* v, const T* next_k, const T* next_v, const int64_t* offsets,
                   int64_t count, int64_t D, float scale, float (*score)[kMaxPage]) {
  constexpr int K = G == 1 ? 8 : 4;  // 8 to 16 independent sums in flight, and registers to spare
  int64_t i = 0;
  for (; i + K <= count; i += K) score_keys<G, K>(query, k, v, next_k, next_v, offsets, i, D, scale, score);
  for (; i < count; ++i) score_keys<G, 1>(query, k, v, next_k, next_v, offsets, i, D, scale, score);
}

template <int G, class T>
void values_avx512(float* out, const T* v, const int64_t* offsets, int64_t count, int64_t D, const float* rescale,
                   const float (*weight)[kMaxPage]) {
  constexpr int C = G == 1 ? 4 : G == 2 ? 2 : 1;  // channel blocks a pass: 6 to 8 independent sums
  int64_t d = 0;
  for (; d + C * 16 <= D; d += C * 16) value_channels<G, C, Lanes16>(out, v, offsets, count, D, d, rescale, weight);
  for (; d + 16 <= D; d += 16) value_channels<G, 1, Lanes16>(out, v, offsets, count, D, d, rescale, weight);
  if (d < D) value_channels<G, 1, Lanes8>(out, v, offsets, count, D, d, rescale, weight);
}

#define KILN_ATTENTION_TILES(G, T)                                                                                         \
  template void scores_avx512<G, T>(const float*, const T*, const T*, const T*, const T*, const int64_t*, int64_t, int64_t, \
                                    float, float (*)[kMaxPage]);                                                                  \
  template void values_avx512<G, T>(float*, const T*, const int64_t*, int64_t, int64_t, const float*, const float (*)[kMaxPage]);
KILN_ATTENTION_TILES(1, float)
KILN_ATTENTION_TILES(2, float)
KILN_ATTENTION_TILES(3, float)
KILN_ATTENTION_TILES(4, float)
KILN_ATTENTION_TILES(1, at::Half)
KILN_ATTENTION_TILES(2, at::Half)
KILN_ATTENTION_TILES(3, at::Half)
KILN_ATTENTION_TILES(4, at::Half)
#undef KILN_ATTENTION_TILES

}  // namespace kiln::attention

#pragma GCC pop_options
