// Weight-only int8 and batch-invariant float32 linear layers for AVX2 CPUs: y[M, N] = x[M, K] . W[N, K]^T.
//
// Why a kernel of our own: decoding reads every weight once per token and the CPU's memory bandwidth is the
// bound, so weights should cross it as int8 and become float32 only in registers. PyTorch's own
// weight-only int8/int4 CPU kernels have no fast AVX2 path, and fbgemm's dynamic int8 quantises the
// activations too (one scale per tensor, which both loses accuracy on Gemma's outlier channels and makes a
// row's result depend on the rest of its batch).
//
// Every output element is computed the same way whatever M is and wherever its row sits in the batch: one
// 8-lane accumulator per (row, output) pair, fused multiply-adds in ascending k, then a fixed horizontal sum.
// So a row's result is bit-identical alone, in a batch, or in a prefill chunk of any size (batch invariance,
// which the deterministic mode relies on).
//
// Formats (one weight row each):
//   f32:  K floats.
//   int8: K int8 values q, w = q * scale[n] (symmetric per output row).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <tuple>

namespace {

// Tiles (output rows x input rows) keep weight vectors, input vectors and accumulators in AVX2's 16
// registers. One input row (decode of one sequence): 4 output rows, so 4 independent accumulator chains
// hide the multiply-add latency. Several input rows (batches, speculative verification): 2 output rows x
// 4 inputs, so each weight vector is loaded and widened once for 4 inputs.
constexpr int64_t kSingleRows = 4;  // the switch in run() covers 1..4
constexpr int64_t kBatchRows = 2;  // likewise 1..2
constexpr int64_t kBatchInputs = 4;
// Each tile reads its rows as separate streams, which the hardware prefetcher follows poorly: asking for
// the cache line 1 KiB ahead in each row, once per line, read the embedded model's LM head in 16 ms
// instead of 24 (int8, one row, both measured on the loaded 2-core machine). Prefetching past a row's
// end is harmless: a hint, never a fault.
constexpr int64_t kPrefetchBytes = 1024;

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v);
  __m128 high = _mm256_extractf128_ps(v, 1);
  __m128 sum = _mm_add_ps(low, high);
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
  return _mm_cvtss_f32(sum);
}

// Loads 8 consecutive float32 weights of row `n` starting at column k (k a multiple of 8).
struct F32Rows {
  const float* w;
  int64_t K;
  inline __m256 load(int64_t n, int64_t k) const { return _mm256_loadu_ps(w + n * K + k); }
  inline float finish(int64_t, float acc) const { return acc; }
};

struct Int8Rows {
  const int8_t* w;
  const float* scale;
  int64_t K;
  inline __m256 load(int64_t n, int64_t k) const {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + n * K + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  inline float finish(int64_t n, float acc) const { return acc * scale[n]; }
};

// Output rows [n0, n0 + rows) for input rows [m0, m0 + inputs). Each weight vector is loaded (and widened)
// once for all the tile's inputs. Both counts are compile-time constants, so the accumulators stay in
// registers (with a run-time count the compiler keeps them in memory, several times slower).
template <typename Rows, int64_t inputs, int64_t rows>
inline void tile(const Rows& W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int64_t m0,
                 int64_t n0) {
  __m256 acc[inputs][rows];
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows; ++r) acc[i][r] = _mm256_setzero_ps();
  constexpr int64_t line = 64 / sizeof(*W.w), ahead = kPrefetchBytes / sizeof(*W.w);  // in weight values
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[inputs];
    for (int64_t i = 0; i < inputs; ++i) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int64_t r = 0; r < rows; ++r) {
      if (k % line == 0) _mm_prefetch(reinterpret_cast<const char*>(W.w + (n0 + r) * K + k + ahead), _MM_HINT_T0);
      const __m256 wv = W.load(n0 + r, k);
      for (int64_t i = 0; i < inputs; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows; ++r) {
      const float out = W.finish(n0 + r, horizontal_sum(acc[i][r]));
      y[(m0 + i) * N + n0 + r] = bias ? out + bias[n0 + r] : out;
    }
}

template <typename Rows>
torch::Tensor run(const Rows& W, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t N) {
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t per_tile = M == 1 ? kSingleRows : kBatchRows;
  const int64_t tiles = (N + per_tile - 1) / per_tile;
  // Grain: enough tiles per task that thread start-up is noise next to reading their weights.
  at::parallel_for(0, tiles, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * per_tile, rows = std::min(per_tile, N - n0);
      if (M == 1) {
        switch (rows) {  // a partial tile only at the end of N
          case 4: tile<Rows, 1, 4>(W, xp, yp, bp, N, K, 0, n0); break;
          case 3: tile<Rows, 1, 3>(W, xp, yp, bp, N, K, 0, n0); break;
          case 2: tile<Rows, 1, 2>(W, xp, yp, bp, N, K, 0, n0); break;
          default: tile<Rows, 1, 1>(W, xp, yp, bp, N, K, 0, n0);
        }
        continue;
      }
      int64_t m = 0;
      for (; m + kBatchInputs <= M; m += kBatchInputs) {
        if (rows == 2) tile<Rows, kBatchInputs, 2>(W, xp, yp, bp, N, K, m, n0);
        else tile<Rows, kBatchInputs, 1>(W, xp, yp, bp, N, K, m, n0);
      }
      for (; m < M; ++m) {
        if (rows == 2) tile<Rows, 1, 2>(W, xp, yp, bp, N, K, m, n0);
        else tile<Rows, 1, 1>(W, xp, yp, bp, N, K, m, n0);
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

void check_input(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t N, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be a float32 CPU tensor");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(K % 8 == 0, "in_features must be a multiple of 8, got ", K);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be a contiguous float32 tensor of ", N, " values");
}

}  // namespace

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32 && w.dim() == 2, "w: contiguous float32 [N, K]");
  check_input(x, bias, w.size(0), w.size(1));
  return run(F32Rows{w.data_ptr<float>(), w.size(1)}, x, bias, w.size(0));
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kInt8 && w.dim() == 2, "w: contiguous int8 [N, K]");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 && scale.numel() == w.size(0),
              "scale: contiguous float32 [N]");
  check_input(x, bias, w.size(0), w.size(1));
  return run(Int8Rows{w.data_ptr<int8_t>(), scale.data_ptr<float>(), w.size(1)}, x, bias, w.size(0));
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                              torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                              double scale);  // attention.cpp

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset);  // norms.cpp
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor qkv, c10::optional<torch::Tensor> norm_weight,
                                                      double eps, double offset, torch::Tensor cos, torch::Tensor sin,
                                                      int64_t heads);  // norms.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "fused RMSNorm (norms.cpp)");
  m.def("qk_norm_rope", &qk_norm_rope, "fused q/k head norms and rotary embedding (norms.cpp)");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (attention.cpp)");
  m.def("linear_f32", &linear_f32, "batch-invariant float32 linear");
  m.def("linear_int8", &linear_int8, "weight-only int8 linear (per-row scales)");
}
