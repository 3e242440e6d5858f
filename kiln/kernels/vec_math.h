// Vector helpers the kernels share: exp over 8 floats (activations, attention weights), fixed-order
// horizontal sums and max, masks for partial vectors.
//
// exp256: the usual Cody-Waite reduction to r in [-ln2 / 2, ln2 / 2] (ln 2 in two parts, the first exact) and a
// degree-6 polynomial, scaled by 2^n through the exponent bits: about 1 ulp. Below -87.33 (where exp
// leaves float32's normal range) the result is 0; above 88 it is clamped to exp(88).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kiln {

inline __m256 exp256(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(e, _mm256_castsi256_ps(power)));
}

// The sum of 8 floats in a fixed order (halves, then pairs, then the last two): the kernels' results must not
// depend on which of them reduced a vector.
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
  return _mm_cvtss_f32(sum);
}

inline float horizontal_max(__m256 v) {
  __m128 top = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  top = _mm_max_ps(top, _mm_movehl_ps(top, top));
  return _mm_cvtss_f32(_mm_max_ss(top, _mm_shuffle_ps(top, top, 1)));
}

inline int32_t horizontal_sum_i32(__m256i v) {
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
  return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 1)));
}

// Lanes [0, n) set, n in [0, 8]: the mask of a partial last vector for maskload / maskstore (which cost more
// than plain loads and stores, so full vectors take those).
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// values[i] = exp(values[i] - shift) for i < count, in place; a partial last vector masked.
inline void exp_shifted(float* values, int64_t count, float shift) {
  const __m256 by = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(values + i, exp256(_mm256_sub_ps(_mm256_loadu_ps(values + i), by)));
  if (i < count) {
    const __m256i lanes = first_lanes(count - i);
    _mm256_maskstore_ps(values + i, lanes, exp256(_mm256_sub_ps(_mm256_maskload_ps(values + i, lanes), by)));
  }
}

}  // namespace kiln
