// The gated MLP's activation, act(gate) * up, in one pass for float32 on AVX2 CPUs.
//
// Why: the op-by-op form (chunk, gelu, multiply) makes three passes and two temporaries over the gate and
// up values of every layer at every decode step, where per-op overhead dominates; this reads them once and
// writes once.
//
// Both activations are x * sigmoid(z): SiLU with z = x, tanh-GELU with z = 2 sqrt(2 / pi) (x + 0.044715 x^3)
// (0.5 (1 + tanh(u)) = sigmoid(2u)), so one exp and one division a value, no cancellation near zero. exp
// is vec_math.h's (about 1 ulp); results agree with PyTorch's to float rounding (test_fused_kernels.py, and
// test_parity.py runs both paths). Each value is computed on its own: a row's result never depends on its
// batch.
#include <torch/extension.h>
#include <immintrin.h>

#include "kernels.h"
#include "pool.h"
#include "vec_math.h"
#include <string>

namespace {

enum class Kind { silu, gelu_tanh };

inline __m256 sigmoid_argument(__m256 x, Kind kind) {
  if (kind == Kind::silu) return x;
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  return _mm256_mul_ps(_mm256_set1_ps(1.5957691216f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
}

// act(gate) * up for 8 values: x * sigmoid(z) * up.
inline __m256 gated(__m256 x, __m256 up, Kind kind) {
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), kiln::exp256(_mm256_sub_ps(_mm256_setzero_ps(), sigmoid_argument(x, kind))));
  return _mm256_mul_ps(_mm256_div_ps(x, denominator), up);
}

}  // namespace

// gate_up [..., 2 I] (gate then up) -> [..., I] = act(gate) * up; activation "silu" or "gelu_pytorch_tanh".
torch::Tensor gated_activation(torch::Tensor gate_up, const std::string& activation) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", "activation must be silu or gelu_pytorch_tanh, got ", activation);
  const Kind kind = activation == "silu" ? Kind::silu : Kind::gelu_tanh;
  const int64_t width = gate_up.size(-1), I = width / 2;
  auto rows = gate_up.reshape({-1, width}).contiguous();
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == torch::kFloat32 && width % 2 == 0,
              "gate_up must be a float32 CPU tensor with an even last dim");
  auto out = torch::empty({rows.size(0), I}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  kiln::SpinPool::run(rows.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = src + r * width, *up = gate + I;
      float* y = dst + r * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(y + i, gated(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), kind));
      if (i < I) {  // a partial last vector, masked
        const __m256i lanes = kiln::first_lanes(I - i);
        _mm256_maskstore_ps(y + i, lanes, gated(_mm256_maskload_ps(gate + i, lanes), _mm256_maskload_ps(up + i, lanes), kind));
      }
    }
  });
  auto shape = gate_up.sizes().vec();
  shape.back() = I;
  return out.view(shape);
}
