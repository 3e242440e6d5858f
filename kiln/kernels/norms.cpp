// Fused RMSNorm, residual add + RMSNorm, and q/k norm + rotary embedding for float32 on AVX2 CPUs.
//
// Why: a decode step of a small model is dozens of tiny elementwise ops per layer, and on the CPU each op
// costs more in dispatch and temporaries than in arithmetic (the embedded Gemma 3 spent about a third of
// a decode step outside its matrix products). One call per norm, and one for the q/k norms with RoPE,
// replace about twenty ops per layer. Each row is computed on its own in a fixed order, so results do not
// depend on the batch (the deterministic mode relies on that).
//
// Norm: y = x / sqrt(mean(x^2) + eps) * (offset + w), in float32 (Gemma's offset is 1, Llama's 0).
// Rotary: the rotate-half convention; cos/sin hold the first half of head_dim (the halves are equal).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "pool.h"
#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

inline float sum_of_squares(const float* x, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
  return _mm_cvtss_f32(sum);
}

// out = x * inverse_rms * (offset + w), D a multiple of 8.
inline void normalize(const float* x, const float* w, float offset, float eps, int64_t D, float* out) {
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(sum_of_squares(x, D) / static_cast<float>(D) + eps));
  const __m256 shift = _mm256_set1_ps(offset);
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + d), scale);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(normed, _mm256_add_ps(shift, _mm256_loadu_ps(w + d))));
  }
}

// In place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves of one head.
inline void rotate(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; j += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + j), x2 = _mm256_loadu_ps(x + half + j);
    const __m256 c = _mm256_loadu_ps(cos + j), s = _mm256_loadu_ps(sin + j);
    _mm256_storeu_ps(x + j, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
    _mm256_storeu_ps(x + half + j, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
  }
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

// x [..., D] -> same shape. weight [D].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset) {
  const int64_t D = x.size(-1);
  auto rows = x.reshape({-1, D}).contiguous();
  check_float(rows, "x");
  check_float(weight, "weight");
  TORCH_CHECK(weight.numel() == D && D % 8 == 0, "weight must have the ", D, " features of x, a multiple of 8");
  auto y = torch::empty_like(rows);
  const float *xp = rows.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  kiln::SpinPool::run(rows.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize(xp + r * D, wp, offset, eps, D, yp + r * D);
  });
  return y.view(x.sizes());
}

// The residual stream after a sublayer: x [N, D] + (y [N, D] normed with y_weight, or y as it is when there
// is none), and that sum normed with out_weight (the next sublayer's input; undefined when there is none).
// Each norm has its own eps and offset. The same float operations as rms_norm followed by an add, so the
// results equal the two-call path's.
std::tuple<torch::Tensor, torch::Tensor> residual_norm(torch::Tensor x, torch::Tensor y, c10::optional<torch::Tensor> y_weight,
                                                       double y_eps, double y_offset, c10::optional<torch::Tensor> out_weight,
                                                       double out_eps, double out_offset) {
  check_float(x, "x");
  check_float(y, "y");
  const int64_t D = x.size(-1), N = x.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(y.sizes() == x.sizes() && D % 8 == 0, "x and y: the same shape [..., D], D a multiple of 8");
  for (const auto* w : {&y_weight, &out_weight})
    if (w->has_value()) {
      check_float(**w, "weight");
      TORCH_CHECK((*w)->numel() == D, "norm weights must have the ", D, " features of x");
    }
  auto total = torch::empty_like(x);
  auto normed = out_weight.has_value() ? torch::empty_like(x) : torch::Tensor();
  const float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float* yw = y_weight.has_value() ? y_weight->data_ptr<float>() : nullptr;
  const float* ow = out_weight.has_value() ? out_weight->data_ptr<float>() : nullptr;
  float *tp = total.data_ptr<float>(), *np = ow ? normed.data_ptr<float>() : nullptr;
  kiln::SpinPool::run(N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = yp + r * D;
      float* sum = tp + r * D;
      if (yw) {
        normalize(src, yw, y_offset, y_eps, D, sum);
        src = sum;
      }
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(sum + d, _mm256_add_ps(_mm256_loadu_ps(xp + r * D + d), _mm256_loadu_ps(src + d)));
      if (ow) normalize(sum, ow, out_offset, out_eps, D, np + r * D);
    }
  });
  return {total, normed};
}

// qkv [N, H + 2 * KV, D] -> (q [N, H, D], k [N, KV, D]): each q and k head normed with its row of
// norm_weight [H + KV, D] when one is given, then rotated by its row's cos/sin [N, D / 2].
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor qkv, c10::optional<torch::Tensor> norm_weight,
                                                      double eps, double offset, torch::Tensor cos, torch::Tensor sin,
                                                      int64_t heads) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(qkv.dim() == 3, "qkv: [N, heads + 2 * kv_heads, head_dim]");
  const int64_t N = qkv.size(0), D = qkv.size(2), kv_heads = (qkv.size(1) - heads) / 2;
  TORCH_CHECK(heads + 2 * kv_heads == qkv.size(1) && kv_heads > 0, "qkv holds ", qkv.size(1), " heads, not ", heads,
              " + 2 * kv_heads");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(cos.numel() == N * D / 2 && sin.numel() == N * D / 2, "cos and sin: [N, head_dim / 2]");
  const float* wp = nullptr;
  if (norm_weight.has_value()) {
    check_float(*norm_weight, "norm_weight");
    TORCH_CHECK(norm_weight->numel() == (heads + kv_heads) * D, "norm_weight: [heads + kv_heads, head_dim]");
    wp = norm_weight->data_ptr<float>();
  }
  auto q = torch::empty({N, heads, D}, qkv.options());
  auto k = torch::empty({N, kv_heads, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const int64_t width = qkv.size(1);
  kiln::SpinPool::run(N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* x = src + (n * width + h) * D;
        float* out = h < heads ? qp + (n * heads + h) * D : kp + (n * kv_heads + h - heads) * D;
        if (wp) normalize(x, wp + h * D, offset, eps, D, out);
        else std::copy(x, x + D, out);
        rotate(out, cp + n * D / 2, sp + n * D / 2, D);
      }
  });
  return {q, k};
}
