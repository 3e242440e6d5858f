// The dot products of GGUF block formats against block-quantised inputs, written once and compiled per
// instruction-set path: blocks_avx2.cpp includes this file with KILN_BLOCKS_VNNI 0, blocks_avx512.cpp
// with 1 under an AVX-512 target, each inside its own namespace (KILN_BLOCKS_NS), so the two copies of
// every inline function here never meet at link time. The including file includes what this one uses
// (<immintrin.h>, <cstdint>, <cstring>, <type_traits>, blocks.h, vec_math.h) before its target pragma.
//
// The 32-value formats (Q4_0 ... Q8_0, IQ4_NL) decode a block into 32 bytes w, unsigned (0..31) or signed
// (then multiplied through the sign trick: |w| against x * sign(w)), a scale and an offset (what w's
// minimum or zero point adds per input unit). For input block x (codes q, scale d, ds = d * sum q) a block
// adds  sum_lanes(int_dot(w, q) * scale * d)  to the row's vector accumulator and  offset * ds  to its
// scalar one, as llama.cpp's Q8_0/Q8_1 dot products do. The 256-value formats sum whole blocks in
// integers first (see scale_sum).
// Integer dots are exact and the float steps run in one fixed order for every input row, so a row's
// result never depends on its batch (INV-3) or on the path: AVX2's three-instruction multiply-add of byte
// pairs and VNNI's one give the same integers.

namespace kiln::KILN_BLOCKS_NS {

using blocks::Acts;
using blocks::kActBlock;
using blocks::Out;
using blocks::Segment;
using Unsigned = std::false_type;
using Signed = std::true_type;

// 8 int32 lanes, each the sum of 4 adjacent products of unsigned bytes u and signed bytes s.
inline __m256i dot4(__m256i u, __m256i s) {
#if KILN_BLOCKS_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  // No int16 saturation: |u| <= 128 and |s| <= 127 keep a pair's sum within 32,512.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc plus, in each of 8 int32 lanes, the sum of 4 adjacent products of unsigned bytes u and signed bytes s.
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#if KILN_BLOCKS_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot4(u, s));
#endif
}

inline float half(const uint8_t* at) {
  uint16_t bits;
  std::memcpy(&bits, at, sizeof bits);
  return _cvtsh_ss(bits);
}

inline __m256i load32(const uint8_t* at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)); }

inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }

inline __m256i shift_right(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// 16 bytes of nibbles as 32 values: the low nibbles are values 0..15, the high ones 16..31 (Q4_0's order).
inline __m256i nibbles16(const uint8_t* at) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  return low4(_mm256_set_m128i(_mm_srli_epi16(q, 4), q));
}

// Byte v = 16 where bit v of the little-endian 32-bit word at `at` is set, else 0 (Q5_0's fifth bits).
inline __m256i fifth_bits(const uint8_t* at) {
  uint32_t bits;
  std::memcpy(&bits, at, sizeof bits);
#if KILN_BLOCKS_VNNI
  return _mm256_maskz_set1_epi8(bits, 16);
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
#endif
}

// The 4-bit non-linear grid of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl), for a byte shuffle.
inline __m256i iq4_grid() {
  const __m128i grid = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  return _mm256_set_m128i(grid, grid);
}

// Each format: kValues and kBytes per block; a 32-value one visit(block, sub) calling sub(w, scale, offset,
// sign). Layouts and values as ggml's dequantize_row_* define them.
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    const float d = half(b);
    sub(nibbles16(b + 2), _mm256_set1_ps(d), -8.0f * d, Unsigned{});
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    sub(nibbles16(b + 4), _mm256_set1_ps(half(b)), half(b + 2), Unsigned{});
  }
};

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    const float d = half(b);
    sub(_mm256_or_si256(nibbles16(b + 6), fifth_bits(b + 2)), _mm256_set1_ps(d), -16.0f * d, Unsigned{});
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    sub(_mm256_or_si256(nibbles16(b + 8), fifth_bits(b + 4)), _mm256_set1_ps(half(b)), half(b + 2), Unsigned{});
  }
};

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    sub(load32(b + 2), _mm256_set1_ps(half(b)), 0.0f, Signed{});
  }
};

struct IQ4_NL {
  static constexpr int64_t kValues = 32, kBytes = 18;
  template <class Sub> static inline void visit(const uint8_t* b, Sub&& sub) {
    sub(_mm256_shuffle_epi8(iq4_grid(), nibbles16(b + 2)), _mm256_set1_ps(half(b)), 0.0f, Signed{});
  }
};

// The 256-value formats meet inputs quantised per 256 values (Acts' second form, llama.cpp's Q8_K): one
// input scale per block, so a block's sub-block sums, each times its integer weight scale, add up exactly
// in int32 (one multiply-add of int16 pairs folds the scale in), and the block costs one float step.
// A format's `block<inputs>` adds block n of one weight row, times each input's, to acc[i].
//
// _mm256_maddubs_epi16 multiplies the unsigned weight codes by the input codes into int16 pairs (at most
// 2 x 63 x 127 = 16,002, or 2 x 127 x 127 for signed grids through the sign trick: no saturation), then
// scale_sum adds those pairs times an int16 scale into int32 lanes.
inline __m256i scale_sum(__m256i acc, __m256i pairs, __m256i scale) {
#if KILN_BLOCKS_VNNI
  return _mm256_dpwssd_epi32(acc, pairs, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
#endif
}

inline const uint8_t* input_codes(const Acts& x, int64_t m, int64_t block) {
  return reinterpret_cast<const uint8_t*>(x.q256 + m * x.K + block * 256);
}

inline float input_scale(const Acts& x, int64_t m, int64_t block) { return x.d256[m * (x.K / 256) + block]; }

// The input's 16 sums of 16 codes of block `block`, and its 8 sums of 32.
inline __m256i input_sums(const Acts& x, int64_t m, int64_t block) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + m * (x.K / 16) + block * 16));
}

inline __m128i input_sums32(const Acts& x, int64_t m, int64_t block) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sums32 + m * (x.K / 32) + block * 8));
}

// int16 lane j of v in every lane (v holding the same 8 lanes in both halves).
inline __m256i broadcast_lane(__m256i v, int j) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<short>((2 * j + 1) << 8 | 2 * j)));
}

// Q4_K and Q5_K: d * scale_j * q - dmin * min_j over 8 sub-blocks of 32, 6-bit scales and minimums packed
// in 12 bytes.
template <bool fifth_bit, int inputs>
inline void kquant_block(const uint8_t* b, const Acts& x, int64_t m0, int64_t n, __m256* acc, __m128* minimum_acc) {
  const __m256 d8 = _mm256_set1_ps(half(b));
  const __m128 minus_dmin4 = _mm_set1_ps(-half(b + 2));
  // The 8 scales, then the 8 minimums, as int16 (ggml's get_scale_min_k4 for all 16 at once): from bytes
  // q[0..11], scale j < 4 is q[j] & 63 and minimum j < 4 is q[j + 4] & 63; for j >= 4 the low 4 bits come
  // from q[j + 4] (its low nibble for the scale, its high one for the minimum) and the top 2 from the
  // top bits of q[j - 4] (scale) or q[j] (minimum). 16 bytes are read: the block goes on past the 12.
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i low_parts = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low_shifted = _mm_blend_epi16(low_parts, _mm_srli_epi16(low_parts, 4), 0xC0);  // minimums 4..7: high nibbles
  const __m128i low_bits = _mm_and_si128(low_shifted, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m128i top_parts = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i top_bits = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(top_parts, 6), _mm_set1_epi8(3)), 4);
  const __m256i scales_and_minimums = _mm256_cvtepu8_epi16(_mm_or_si128(low_bits, top_bits));
  const __m128i scales128 = _mm256_castsi256_si128(scales_and_minimums);
  const __m256i scales = _mm256_set_m128i(scales128, scales128);
  const __m128i minimums = _mm256_extracti128_si256(scales_and_minimums, 1);
  const uint8_t* codes = b + (fifth_bit ? 48 : 16);
  const __m256i high = fifth_bit ? load32(b + 16) : _mm256_setzero_si256();
  __m256i sums[inputs];
  for (int i = 0; i < inputs; ++i) sums[i] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i q = load32(codes + 32 * c);
    __m256i low = low4(q), upper = low4(shift_right(q, 4));
    if (fifth_bit) {
      const __m256i one = _mm256_set1_epi8(1);
      low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(shift_right(high, 2 * c), one), 4));
      upper = _mm256_or_si256(upper, _mm256_slli_epi16(_mm256_and_si256(shift_right(high, 2 * c + 1), one), 4));
    }
    const __m256i scale_low = broadcast_lane(scales, 2 * c), scale_upper = broadcast_lane(scales, 2 * c + 1);
    for (int i = 0; i < inputs; ++i) {
      const uint8_t* in = input_codes(x, m0 + i, n) + 64 * c;
      sums[i] = scale_sum(sums[i], _mm256_maddubs_epi16(low, load32(in)), scale_low);
      sums[i] = scale_sum(sums[i], _mm256_maddubs_epi16(upper, load32(in + 32)), scale_upper);
    }
  }
  for (int i = 0; i < inputs; ++i) {
    const __m128i minimum_terms = _mm_madd_epi16(minimums, input_sums32(x, m0 + i, n));  // 4 lanes of 2 sub-blocks each
    const __m256 dx = _mm256_broadcast_ss(x.d256 + (m0 + i) * (x.K / 256) + n);
    acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d8, dx), _mm256_cvtepi32_ps(sums[i]), acc[i]);
    minimum_acc[i] = _mm_fmadd_ps(_mm_mul_ps(minus_dmin4, _mm256_castps256_ps128(dx)), _mm_cvtepi32_ps(minimum_terms), minimum_acc[i]);
  }
}

struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  template <int inputs> static inline void block(const uint8_t* b, const Acts& x, int64_t m0, int64_t n, __m256* acc, __m128* minimum_acc) {
    kquant_block<false, inputs>(b, x, m0, n, acc, minimum_acc);
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  template <int inputs> static inline void block(const uint8_t* b, const Acts& x, int64_t m0, int64_t n, __m256* acc, __m128* minimum_acc) {
    kquant_block<true, inputs>(b, x, m0, n, acc, minimum_acc);
  }
};

// Q6_K: d * scale_g * (q - 32), q 6 bits (4 in ql, 2 in qh), a signed 8-bit scale per 16 values. The -32 is
// taken off after, through the input's sums per 16.
struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  template <int inputs> static inline void block(const uint8_t* b, const Acts& x, int64_t m0, int64_t n, __m256* acc, __m128* minimum_acc) {
    const float d = half(b + 208);
    const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256i three = _mm256_set1_epi8(3);
    __m256i sums[inputs];
    for (int i = 0; i < inputs; ++i) sums[i] = _mm256_setzero_si256();
    for (int part = 0; part < 2; ++part) {  // 128 values each
      const __m256i a = load32(b + 64 * part), c = load32(b + 64 * part + 32), h = load32(b + 128 + 32 * part);
      const __m256i q[4] = {
          _mm256_or_si256(low4(a), _mm256_slli_epi16(_mm256_and_si256(h, three), 4)),
          _mm256_or_si256(low4(c), _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 2), three), 4)),
          _mm256_or_si256(low4(shift_right(a, 4)), _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 4), three), 4)),
          _mm256_or_si256(low4(shift_right(c, 4)), _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 6), three), 4)),
      };
      for (int j = 0; j < 4; ++j) {
        const int64_t g = 2 * (4 * part + j);  // the sub-block's two scales: values 0..15, then 16..31
        const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));
        for (int i = 0; i < inputs; ++i) {
          const uint8_t* in = input_codes(x, m0 + i, n) + 128 * part + 32 * j;
          sums[i] = scale_sum(sums[i], _mm256_maddubs_epi16(q[j], load32(in)), scale);
        }
      }
    }
    const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
    for (int i = 0; i < inputs; ++i) {
      const __m256i offsets = _mm256_slli_epi32(_mm256_madd_epi16(scales16, input_sums(x, m0 + i, n)), 5);  // 32 x scale x sum
      const float dx = input_scale(x, m0 + i, n);
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(_mm256_sub_epi32(sums[i], offsets)), acc[i]);
    }
  }
};

// IQ4_XS: d * (scale_j - 32) * grid[q] over 8 sub-blocks of 32, 6-bit scales, the grid's signed values taken
// through the sign trick.
struct IQ4_XS {
  static constexpr int64_t kValues = 256, kBytes = 136;
  template <int inputs> static inline void block(const uint8_t* b, const Acts& x, int64_t m0, int64_t n, __m256* acc, __m128* minimum_acc) {
    const float d = half(b);
    uint16_t high;
    std::memcpy(&high, b + 2, sizeof high);
    const uint8_t* low = b + 4;
    const __m256i grid = iq4_grid();
    __m256i sums[inputs];
    for (int i = 0; i < inputs; ++i) sums[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const int scale = (((low[j / 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)) - 32;
      const __m256i w = _mm256_shuffle_epi8(grid, nibbles16(b + 8 + 16 * j));
      const __m256i magnitude = _mm256_abs_epi8(w), scale16 = _mm256_set1_epi16(static_cast<short>(scale));
      for (int i = 0; i < inputs; ++i) {
        const __m256i in = _mm256_sign_epi8(load32(input_codes(x, m0 + i, n) + 32 * j), w);
        sums[i] = scale_sum(sums[i], _mm256_maddubs_epi16(magnitude, in), scale16);
      }
    }
    for (int i = 0; i < inputs; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * input_scale(x, m0 + i, n)), _mm256_cvtepi32_ps(sums[i]), acc[i]);
  }
};

// The repacked formats (blocks.h, kRepacked): a vector lane per row, so a group's scales, minimums and
// float steps are one vector operation for all eight rows, its input codes are four bytes broadcast to
// every lane, and no row ends in a horizontal sum. Per row the integers are those of the row-wise kernels
// above; the float steps run in one fixed order per row as there, so a row's result never depends on its
// batch. Each format: kValues per block, kGroupBytes per group block, and group<inputs>, which adds one
// group block times each input's to acc[i] (lane r: row r of the group).

inline __m256i broadcast4(const uint8_t* at) {
  int32_t bytes;
  std::memcpy(&bytes, at, 4);
  return _mm256_set1_epi32(bytes);
}

inline __m256 halves8(const uint8_t* at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))); }

inline __m256i bytes_to_int32(const uint8_t* at, bool is_signed) {
  int64_t bytes;
  std::memcpy(&bytes, at, 8);
  const __m128i v = _mm_cvtsi64_si128(bytes);
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

// Bit `bit` of each byte of v moved to bit 4 (the fifth bit of a code), the others cleared.
inline __m256i fifth_bit(__m256i v, int bit) {
  return _mm256_and_si256(bit <= 4 ? _mm256_slli_epi16(v, 4 - bit) : shift_right(v, bit - 4), _mm256_set1_epi8(16));
}

// The 32-value formats: a block's integer dot per row, then d * dx * dot + offset * ds, the offset being
// what the format's zero point or minimum adds per input unit (Q4_0's -8 d, Q4_1's m), as row_tile does.
template <int64_t kType>
struct Blocks32x8 {
  static constexpr bool kFifth = kType == blocks::kQ5_0 || kType == blocks::kQ5_1;
  static constexpr bool kMinimum = kType == blocks::kQ4_1 || kType == blocks::kQ5_1;
  static constexpr int64_t kValues = 32;
  static constexpr int64_t kGroupBytes = blocks::kGroupRows * blocks::block_bytes(kType);
  static constexpr int64_t kCodes = 16 * (1 + kMinimum) + 32 * kFifth;

  template <int inputs>
  static inline void group(const uint8_t* g, const Acts& x, int64_t m0, int64_t n, __m256* acc) {
    const int64_t blocks_per_row = x.K / 32;
    const uint8_t* codes = g + kCodes;
    __m256i sums[inputs];
    for (int i = 0; i < inputs; ++i) sums[i] = _mm256_setzero_si256();
    const auto meet = [&](__m256i w, int64_t at, bool is_signed) {  // w against input codes at..at+3
      const __m256i magnitude = is_signed ? _mm256_abs_epi8(w) : w;
      for (int i = 0; i < inputs; ++i) {
        __m256i in = broadcast4(reinterpret_cast<const uint8_t*>(x.q + ((m0 + i) * blocks_per_row + n) * kActBlock) + at);
        if (is_signed) in = _mm256_sign_epi8(in, w);
        sums[i] = dot4_add(sums[i], magnitude, in);
      }
    };
    if constexpr (kType == blocks::kQ8_0) {
      for (int v = 0; v < 8; ++v) meet(load32(codes + 32 * v), 4 * v, true);
    } else {
      const __m256i fifth = kFifth ? load32(g + 16 * (1 + kMinimum)) : _mm256_setzero_si256();
      for (int q = 0; q < 4; ++q) {
        const __m256i w = load32(codes + 32 * q);
        __m256i low = low4(w), high = low4(shift_right(w, 4));
        if constexpr (kFifth) {
          low = _mm256_or_si256(low, fifth_bit(fifth, 2 * q));
          high = _mm256_or_si256(high, fifth_bit(fifth, 2 * q + 1));
        }
        if constexpr (kType == blocks::kIQ4_NL) {
          meet(_mm256_shuffle_epi8(iq4_grid(), low), 8 * q, true);
          meet(_mm256_shuffle_epi8(iq4_grid(), high), 8 * q + 4, true);
        } else {
          meet(low, 8 * q, false);
          meet(high, 8 * q + 4, false);
        }
      }
    }
    const __m256 d = halves8(g);
    __m256 offset = _mm256_setzero_ps();
    if constexpr (kType == blocks::kQ4_0) offset = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    if constexpr (kType == blocks::kQ5_0) offset = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    if constexpr (kMinimum) offset = halves8(g + 16);
    for (int i = 0; i < inputs; ++i) {
      const int64_t at = (m0 + i) * blocks_per_row + n;
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[at])), _mm256_cvtepi32_ps(sums[i]), acc[i]);
      if constexpr (kType != blocks::kQ8_0 && kType != blocks::kIQ4_NL)
        acc[i] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.ds[at]), acc[i]);
    }
  }
};

// Q4_K and Q5_K: d * scale_j * q - dmin * min_j per sub-block; the block's integers are exact in int32.
template <bool kFifth>
struct KQuantx8 {
  static constexpr int64_t kValues = 256;
  static constexpr int64_t kSubBlockBytes = 128 + 32 * kFifth;  // the fifth bits' vector, then 4 nibble vectors
  static constexpr int64_t kGroupBytes = 160 + 8 * kSubBlockBytes;

  template <int inputs>
  static inline void group(const uint8_t* g, const Acts& x, int64_t m0, int64_t n, __m256* acc) {
    const uint8_t* scales = g + 32;
    const uint8_t* minimums = g + 96;
    __m256i total[inputs];
    for (int i = 0; i < inputs; ++i) total[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* codes = g + 160 + kSubBlockBytes * j;
      const __m256i fifth = kFifth ? load32(codes) : _mm256_setzero_si256();
      __m256i low_sum[inputs], high_sum[inputs];  // two chains, not one: no long dependency to wait on
      for (int i = 0; i < inputs; ++i) low_sum[i] = high_sum[i] = _mm256_setzero_si256();
      for (int quarter = 0; quarter < 4; ++quarter) {
        const __m256i w = load32(codes + 32 * kFifth + 32 * quarter);
        __m256i low = low4(w), high = low4(shift_right(w, 4));
        if constexpr (kFifth) {
          low = _mm256_or_si256(low, fifth_bit(fifth, 2 * quarter));
          high = _mm256_or_si256(high, fifth_bit(fifth, 2 * quarter + 1));
        }
        for (int i = 0; i < inputs; ++i) {
          const uint8_t* in = input_codes(x, m0 + i, n) + 32 * j + 8 * quarter;
          low_sum[i] = dot4_add(low_sum[i], low, broadcast4(in));
          high_sum[i] = dot4_add(high_sum[i], high, broadcast4(in + 4));
        }
      }
      const __m256i scale = bytes_to_int32(scales + 8 * j, false);
      for (int i = 0; i < inputs; ++i)
        total[i] = _mm256_add_epi32(total[i], _mm256_mullo_epi32(_mm256_add_epi32(low_sum[i], high_sum[i]), scale));
    }
    const __m256 d = halves8(g), dmin = halves8(g + 16);
    for (int i = 0; i < inputs; ++i) {
      const int16_t* sums = x.sums32 + (m0 + i) * (x.K / 32) + n * 8;
      __m256i minimum = _mm256_setzero_si256();
      for (int pair = 0; pair < 4; ++pair) {  // each lane: min_2p * sum_2p + min_2p+1 * sum_2p+1
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums + 16 * pair)));
        minimum = _mm256_add_epi32(minimum, _mm256_madd_epi16(mins, broadcast4(reinterpret_cast<const uint8_t*>(sums + 2 * pair))));
      }
      const __m256 dx = _mm256_set1_ps(input_scale(x, m0 + i, n));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(total[i]), acc[i]);
      acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(minimum), acc[i]);
    }
  }
};

// IQ4_XS: d * (scale_j - 32) * grid[q] per sub-block of 32, the grid's signed values through the sign trick.
struct IQ4_XSx8 {
  static constexpr int64_t kValues = 256;
  static constexpr int64_t kGroupBytes = 80 + 8 * 128;

  template <int inputs>
  static inline void group(const uint8_t* g, const Acts& x, int64_t m0, int64_t n, __m256* acc) {
    const __m256i grid = iq4_grid();
    __m256i total[inputs];
    for (int i = 0; i < inputs; ++i) total[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i sums[inputs];
      for (int i = 0; i < inputs; ++i) sums[i] = _mm256_setzero_si256();
      for (int quarter = 0; quarter < 4; ++quarter) {
        const __m256i w = load32(g + 80 + 128 * j + 32 * quarter);
        const __m256i low = _mm256_shuffle_epi8(grid, low4(w)), high = _mm256_shuffle_epi8(grid, low4(shift_right(w, 4)));
        for (int i = 0; i < inputs; ++i) {
          const uint8_t* in = input_codes(x, m0 + i, n) + 32 * j + 8 * quarter;
          sums[i] = dot4_add(sums[i], _mm256_abs_epi8(low), _mm256_sign_epi8(broadcast4(in), low));
          sums[i] = dot4_add(sums[i], _mm256_abs_epi8(high), _mm256_sign_epi8(broadcast4(in + 4), high));
        }
      }
      const __m256i scale = bytes_to_int32(g + 16 + 8 * j, true);
      for (int i = 0; i < inputs; ++i) total[i] = _mm256_add_epi32(total[i], _mm256_mullo_epi32(sums[i], scale));
    }
    const __m256 d = halves8(g);
    for (int i = 0; i < inputs; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(input_scale(x, m0 + i, n))), _mm256_cvtepi32_ps(total[i]), acc[i]);
  }
};

// Q6_K: d * scale_g * (q - 32) per sub-block of 16; the -32 taken off each sub-block's sum exactly through
// the input's sums per 16.
struct Q6_Kx8 {
  static constexpr int64_t kValues = 256;
  static constexpr int64_t kGroupBytes = blocks::kGroupRows * 210;

  template <int inputs>
  static inline void group(const uint8_t* g, const Acts& x, int64_t m0, int64_t n, __m256* acc) {
    const uint8_t* scales = g + 16;
    const uint8_t* codes = g + 144;
    const __m256i low_mask = _mm256_set1_epi8(0x0F), top_mask = _mm256_set1_epi8(0x30);
    __m256i total[inputs];
    for (int i = 0; i < inputs; ++i) total[i] = _mm256_setzero_si256();
    for (int j = 0; j < 16; ++j) {
      const uint8_t* c = codes + 96 * j;
      const __m256i w0 = load32(c), w1 = load32(c + 32), top = load32(c + 64);
      const __m256i q[4] = {  // values 0..3, 4..7, 8..11, 12..15 of the sub-block (+ k)
          _mm256_or_si256(_mm256_and_si256(w0, low_mask), _mm256_and_si256(_mm256_slli_epi16(top, 4), top_mask)),
          _mm256_or_si256(_mm256_and_si256(shift_right(w0, 4), low_mask), _mm256_and_si256(top, top_mask)),
          _mm256_or_si256(_mm256_and_si256(w1, low_mask), _mm256_and_si256(_mm256_slli_epi16(top, 2), top_mask)),
          _mm256_or_si256(_mm256_and_si256(shift_right(w1, 4), low_mask), _mm256_and_si256(shift_right(top, 2), top_mask)),
      };
      const __m256i scale = bytes_to_int32(scales + 8 * j, true);
      for (int i = 0; i < inputs; ++i) {
        const uint8_t* in = input_codes(x, m0 + i, n) + 16 * j;
        const __m256i even = dot4_add(dot4_add(_mm256_setzero_si256(), q[0], broadcast4(in)), q[2], broadcast4(in + 8));
        const __m256i odd = dot4_add(dot4_add(_mm256_setzero_si256(), q[1], broadcast4(in + 4)), q[3], broadcast4(in + 12));
        const __m256i offset = _mm256_set1_epi32(32 * x.bsums[(m0 + i) * (x.K / 16) + n * 16 + j]);
        const __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(even, odd), offset);
        total[i] = _mm256_add_epi32(total[i], _mm256_mullo_epi32(sum, scale));
      }
    }
    const __m256 d = halves8(g);
    for (int i = 0; i < inputs; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(input_scale(x, m0 + i, n))), _mm256_cvtepi32_ps(total[i]), acc[i]);
  }
};

// How far ahead of the block being computed its weights are asked for: decode streams each weight once from
// memory, and perf put the kernel's time on the loads of weight bytes and what waits on them. linear.cpp's
// distance; on the 1.7B file 1 KiB and 4 KiB were no better (decode within this VM's noise of +-10 %).
constexpr int64_t kPrefetchBytes = 2048;

// One output row against `inputs` input rows from m0: every sub-block decoded once for all of them.
template <int inputs, class Format>
inline void row_tile(const uint8_t* row, const Acts& x, int64_t m0, const Out& out, int64_t r) {
  __m256 acc[inputs];
  __m128 minimum_acc[inputs];  // the K-quants' minimums
  float offset_acc[inputs];
  for (int i = 0; i < inputs; ++i) {
    acc[i] = _mm256_setzero_ps();
    minimum_acc[i] = _mm_setzero_ps();
    offset_acc[i] = 0.0f;
  }
  const int64_t blocks = x.K / Format::kValues;
  for (int64_t block = 0; block < blocks; ++block) {
    // Rows lie one after another: ask for the bytes kPrefetchBytes on, this row's or the next ones'.
    for (int64_t line = 0; line < Format::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + block * Format::kBytes + kPrefetchBytes + line), _MM_HINT_T0);
    if constexpr (Format::kValues == 256) {
      Format::template block<inputs>(row + block * Format::kBytes, x, m0, block, acc, minimum_acc);
    } else {
      Format::visit(row + block * Format::kBytes, [&](__m256i w, __m256 scale, float offset, auto is_signed) {
        const __m256i magnitude = is_signed ? _mm256_abs_epi8(w) : w;
        for (int i = 0; i < inputs; ++i) {
          const int64_t at = (m0 + i) * blocks + block;
          __m256i q = load32(reinterpret_cast<const uint8_t*>(x.q + at * kActBlock));
          if constexpr (decltype(is_signed)::value) q = _mm256_sign_epi8(q, w);
          const __m256 products = _mm256_cvtepi32_ps(dot4(magnitude, q));
          acc[i] = _mm256_fmadd_ps(products, _mm256_mul_ps(scale, _mm256_set1_ps(x.d[at])), acc[i]);
          if (offset != 0.0f) offset_acc[i] += offset * x.ds[at];
        }
      });
    }
  }
  const int64_t column = out.columns ? out.columns[r] : r;
  const float bias = out.bias ? out.bias[column] : 0.0f;
  for (int i = 0; i < inputs; ++i) {
    const __m256 all = _mm256_add_ps(acc[i], _mm256_insertf128_ps(_mm256_setzero_ps(), minimum_acc[i], 0));
    out.y[(m0 + i) * out.ldy + column] = horizontal_sum(all) + offset_acc[i] + bias;
  }
}

// Input rows per pass over a row range: their codes (64 x K bytes) stay in L2 while each weight row,
// read once from memory, meets them all from L1.
constexpr int64_t kInputChunk = 64;

template <class Format>
void rows_of(const Segment& s, int64_t r0, int64_t r1, const Acts& x, int64_t m0, int64_t m1, const Out& out) {
  for (int64_t chunk = m0; chunk < m1; chunk += kInputChunk) {
    const int64_t end = std::min(m1, chunk + kInputChunk);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = s.data + r * s.row_bytes;
      const int64_t output = s.first_row + r;
      int64_t m = chunk;
      for (; end - m >= 4; m += 4) row_tile<4, Format>(row, x, m, out, output);
      if (end - m == 3) row_tile<3, Format>(row, x, m, out, output);
      if (end - m == 2) row_tile<2, Format>(row, x, m, out, output);
      if (end - m == 1) row_tile<1, Format>(row, x, m, out, output);
    }
  }
}

// One group of eight output rows against `inputs` input rows from m0.
template <int inputs, class Format>
inline void group_tile(const Segment& s, int64_t group, const Acts& x, int64_t m0, const Out& out) {
  __m256 acc[inputs];
  for (int i = 0; i < inputs; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t blocks = x.K / Format::kValues;
  const uint8_t* base = s.data + group * Format::kGroupBytes * blocks;
  for (int64_t n = 0; n < blocks; ++n) {
    const uint8_t* g = base + n * Format::kGroupBytes;
    for (int64_t line = 0; line < Format::kGroupBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(g + kPrefetchBytes + line), _MM_HINT_T0);
    Format::template group<inputs>(g, x, m0, n, acc);
  }
  for (int i = 0; i < inputs; ++i) {
    alignas(32) float lanes[blocks::kGroupRows];
    _mm256_store_ps(lanes, acc[i]);
    for (int64_t r = 0; r < blocks::kGroupRows; ++r) {
      const int64_t row = s.first_row + group * blocks::kGroupRows + r;
      const int64_t column = out.columns ? out.columns[row] : row;
      out.y[(m0 + i) * out.ldy + column] = lanes[r] + (out.bias ? out.bias[column] : 0.0f);
    }
  }
}

// Rows [r0, r1) of a repacked segment, both multiples of eight (blocks.cpp splits the work so).
template <class Format>
void groups_of(const Segment& s, int64_t r0, int64_t r1, const Acts& x, int64_t m0, int64_t m1, const Out& out) {
  for (int64_t chunk = m0; chunk < m1; chunk += kInputChunk) {
    const int64_t end = std::min(m1, chunk + kInputChunk);
    for (int64_t group = r0 / blocks::kGroupRows; group < r1 / blocks::kGroupRows; ++group) {
      int64_t m = chunk;
      for (; end - m >= 4; m += 4) group_tile<4, Format>(s, group, x, m, out);
      if (end - m == 3) group_tile<3, Format>(s, group, x, m, out);
      if (end - m == 2) group_tile<2, Format>(s, group, x, m, out);
      if (end - m == 1) group_tile<1, Format>(s, group, x, m, out);
    }
  }
}

void dot_rows(const Segment& s, int64_t r0, int64_t r1, const Acts& x, int64_t m0, int64_t m1, const Out& out) {
  switch (s.type) {
    case blocks::kRepacked + blocks::kQ4_0: return groups_of<Blocks32x8<blocks::kQ4_0>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ4_1: return groups_of<Blocks32x8<blocks::kQ4_1>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ5_0: return groups_of<Blocks32x8<blocks::kQ5_0>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ5_1: return groups_of<Blocks32x8<blocks::kQ5_1>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ8_0: return groups_of<Blocks32x8<blocks::kQ8_0>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kIQ4_NL: return groups_of<Blocks32x8<blocks::kIQ4_NL>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ4_K: return groups_of<KQuantx8<false>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ5_K: return groups_of<KQuantx8<true>>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kIQ4_XS: return groups_of<IQ4_XSx8>(s, r0, r1, x, m0, m1, out);
    case blocks::kRepacked + blocks::kQ6_K: return groups_of<Q6_Kx8>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ4_0: return rows_of<Q4_0>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ4_1: return rows_of<Q4_1>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ5_0: return rows_of<Q5_0>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ5_1: return rows_of<Q5_1>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ8_0: return rows_of<Q8_0>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ4_K: return rows_of<Q4_K>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ5_K: return rows_of<Q5_K>(s, r0, r1, x, m0, m1, out);
    case blocks::kQ6_K: return rows_of<Q6_K>(s, r0, r1, x, m0, m1, out);
    case blocks::kIQ4_NL: return rows_of<IQ4_NL>(s, r0, r1, x, m0, m1, out);
    case blocks::kIQ4_XS: return rows_of<IQ4_XS>(s, r0, r1, x, m0, m1, out);
    default: return;  // blocks.cpp refuses other types before any call
  }
}

}  // namespace kiln::KILN_BLOCKS_NS
