// GGUF's quantised block formats computed as stored (blocks.cpp has the why): the types, the layout of one
// call's operands, and the per-ISA entry points (block_dot.h, compiled once per path).
#pragma once

#include <cstdint>

namespace kiln::blocks {

// GGML's own type numbers, as a GGUF file stores them.
enum Type : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23
};

// Kiln's repacked layouts (kiln/models/gguf_blocks.py writes them at load): type kRepacked + a GGML type is
// that type's blocks of eight consecutive rows as one group, so that one vector lane holds one row. A
// group's rows are the segment's rows 8g .. 8g + 7 and its blocks follow one another; row_bytes stays per
// row. Within a group's block, scales are by row (float16 [8]), and codes come as 32-byte vectors of four
// bytes per row, each vector meeting four input codes (a nibble vector: its low nibbles four, its high
// nibbles the next four):
// - Q4_0/Q4_1/IQ4_NL x8: d[8] (Q4_1: then m[8]); 4 nibble vectors, vector q holding values 8q..8q+7.
// - Q5_0/Q5_1 x8: d[8] (Q5_1: m[8]); fifth bits (a vector: row byte k, bit 2q + h = the fifth bit of value
//   8q + 4h + k); then the 4 nibble vectors.
// - Q8_0 x8: d[8]; 8 vectors of signed codes, vector v holding values 4v..4v+3.
// - Q4_K / Q5_K x8: d[8], dmin[8]; scales[8 sub-blocks][8 rows] and minimums[4 sub-block pairs][8 rows][2]
//   (uint8); then per sub-block (Q5_K: its fifth bits' vector, as Q5_0's, then) its 4 nibble vectors
//   (148 / 180 bytes a row-block: the scales unpacked from 12 bytes to 16, Q5_K's fifth bits 4 bytes more).
// - IQ4_XS x8: d[8]; scales[8 sub-blocks][8 rows] (int8, less 32 already); per sub-block its 4 nibble vectors
//   (138 bytes a row-block: the scales unpacked).
// - Q6_K x8: d[8]; scales[16 sub-blocks][8 rows] (int8); then per sub-block of 16 values: 2 nibble vectors
//   of the low four bits and one vector of the top two (row byte k: bits 0-1 value k, 4-5 value 4 + k, 2-3
//   value 8 + k, 6-7 value 12 + k).
constexpr int64_t kRepacked = 1000;
constexpr int64_t kGroupRows = 8;

constexpr bool repacked(int64_t type) {
  switch (type - kRepacked) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kIQ4_NL: case kQ4_K: case kQ5_K: case kQ6_K:
    case kIQ4_XS:
      return true;
    default: return false;
  }
}

// Values and bytes (of one row) of one block of `type`; 0 for a type not computed here.
constexpr int64_t block_values(int64_t type) {
  switch (repacked(type) ? type - kRepacked : type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kIQ4_NL: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: return 256;
    default: return 0;
  }
}

constexpr int64_t block_bytes(int64_t type) {
  if (type == kRepacked + kQ4_K) return 148;  // the scales and minimums unpacked
  if (type == kRepacked + kQ5_K) return 180;  // and the fifth bits laid out per sub-block
  if (type == kRepacked + kIQ4_XS) return 138;
  switch (repacked(type) ? type - kRepacked : type) {
    case kQ4_0: case kIQ4_NL: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_XS: return 136;
    default: return 0;
  }
}

// Inputs quantised to int8 codes (|q| <= 127) in the two forms llama.cpp's dot products take, each made
// only when a weight format of the call needs it:
// - per 32 values (its Q8_0 / Q8_1, for the 32-value formats): codes q [M, K], each block's scale d and
//   d * (sum of its codes) ds [M, K / 32], which a format's offset (a minimum, Q4_0's -8) multiplies;
// - per 256 values (its Q8_K, for the K-quants and IQ4_XS): codes q256 [M, K], scales d256 [M, K / 256] and
//   the sums of each 16 codes, bsums [M, K / 16], which Q6_K's -32 multiplies, and of each 32, sums32
//   [M, K / 32], which the minimums of Q4_K and Q5_K multiply.
constexpr int64_t kActBlock = 32;
struct Acts {
  const int8_t* q;
  const float* d;
  const float* ds;
  const int8_t* q256;
  const float* d256;
  const int16_t* bsums;
  const int16_t* sums32;
  int64_t K;
};

// Output rows of one weight tensor in its file: `rows` rows of `row_bytes` each, the first being the
// layer's output `first_row` (a fused layer's rows come from several tensors).
struct Segment {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  int64_t type;
  int64_t first_row;
};

// Where output row r of input m goes: column c = columns ? columns[r] : r of y[m * ldy + c], plus bias[c] when given.
struct Out {
  float* y;
  int64_t ldy;
  const int64_t* columns;
  const float* bias;
};

}  // namespace kiln::blocks

// Rows [r0, r1) of `segment` against inputs [m0, m1): block_dot.h, built for each path.
namespace kiln::blocks_avx2 {
void dot_rows(const blocks::Segment& segment, int64_t r0, int64_t r1, const blocks::Acts& x, int64_t m0, int64_t m1,
              const blocks::Out& out);
}
namespace kiln::blocks_avx512 {
void dot_rows(const blocks::Segment& segment, int64_t r0, int64_t r1, const blocks::Acts& x, int64_t m0, int64_t m1,
              const blocks::Out& out);
}
