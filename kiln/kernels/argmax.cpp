// Greedy decoding's argmax over a vocabulary of logits, for float32 on AVX2 CPUs.
//
// Why: torch's argmax over a large vocabulary (the embedded model's 262,144 logits) runs on an OpenMP team
// that wakes from sleep on the engine thread (see pool.h), a visible share of a small model's decode step.
// This splits the vocabulary between the pool's threads and keeps, per lane, the first index of the largest
// value.
//
// The answer is torch.argmax's: the first index of the maximum, and a NaN counts as larger than anything
// (the first NaN's index when there is one).
#include <torch/extension.h>
#include <immintrin.h>

#include "kernels.h"
#include "pool.h"
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: nothing seen yet
  bool nan = false;
};

// Whether (value, index) wins over `best` given that indices are visited in ascending order per lane.
inline bool better(float value, int64_t index, const Best& best) {
  if (best.index < 0) return true;
  if (best.nan) return false;
  if (std::isnan(value)) return true;
  return value > best.value || (value == best.value && index < best.index);
}

Best scan(const float* x, int64_t begin, int64_t end) {
  Best best;
  int64_t i = begin;
  if (end - begin >= 8) {
    __m256 values = _mm256_loadu_ps(x + i);
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = lanes;  // positions relative to begin
    __m256 unordered = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
    for (i += 8; i + 8 <= end; i += 8) {
      at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 larger = _mm256_cmp_ps(v, values, _CMP_GT_OQ);
      values = _mm256_blendv_ps(values, v, larger);
      lanes = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lanes), _mm256_castsi256_ps(at), larger));
    }
    if (_mm256_movemask_ps(unordered)) {  // rare: the first NaN, found one value at a time
      for (int64_t j = begin; j < end; ++j)
        if (std::isnan(x[j])) return Best{x[j], j, true};
    }
    alignas(32) float lane_values[8];
    alignas(32) int32_t lane_index[8];
    _mm256_store_ps(lane_values, values);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_index), lanes);
    for (int k = 0; k < 8; ++k)
      if (better(lane_values[k], begin + lane_index[k], best)) best = Best{lane_values[k], begin + lane_index[k], false};
  }
  for (; i < end; ++i)
    if (better(x[i], i, best)) best = Best{x[i], i, std::isnan(x[i])};
  return best;
}

}  // namespace

// logits [M, V] float32 -> [M] int64, each row's torch.argmax.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0,
              "logits must be a float32 CPU tensor [rows, vocab], vocab > 0");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "vocab must fit 31 bits");
  auto rows = logits.contiguous();
  const int64_t M = rows.size(0), V = rows.size(1);
  const int64_t parts = std::min<int64_t>(64, (V + 4095) / 4096);  // pieces of one row, merged in order
  std::vector<Best> found(M * parts);
  const float* x = rows.data_ptr<float>();
  kiln::SpinPool::run(M * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / parts, part = t % parts;
      found[t] = scan(x + row * V, V * part / parts, V * (part + 1) / parts);
    }
  });
  auto out = torch::empty({M}, torch::kLong);
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < M; ++row) {
    Best best;
    for (int64_t part = 0; part < parts; ++part) {
      const Best& piece = found[row * parts + part];
      if (better(piece.value, piece.index, best)) best = piece;
    }
    index[row] = best.index;
  }
  return out;
}
