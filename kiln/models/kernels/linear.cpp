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
// Formats (of one weight row; rows are packed in blocks of 8, see kBlock):
//   f32:  K floats.
//   int8: K int8 values q, w = q * scale[n] (symmetric per output row).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "pool.h"

#include <string>
#include <tuple>

namespace {

// Weights are packed in blocks of kBlock output rows: for each 8 columns k..k+7, the block's 8 rows hold
// their 8 values one after another (element (n, k) at ((n / 8) * K + k) * 8 + (n % 8) * 8 + k % 8). One
// decode tile reads a whole block, and so one contiguous stream, 8 rows x 8 values (one cache line of
// int8) per step of k. Row-major rows instead made each tile read 4-8 separate streams, which the
// hardware prefetcher follows poorly: on the 2-core machines here the embedded model's LM head took
// 13.8 ms (row-major, 4 rows a tile) against 7.4 ms packed (int8, one input row), the read bandwidth
// limit being 5.8 ms (bench/kernels.py). quant.py packs once, at quantisation.
constexpr int64_t kBlock = 8;
// Software prefetch distance in the block's stream: 2 KiB ahead measured best (1 KiB: 7-15 % slower on the
// small matrices; none: 20-25 % slower).
constexpr int64_t kPrefetchBytes = 2048;

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v);
  __m128 high = _mm256_extractf128_ps(v, 1);
  __m128 sum = _mm_add_ps(low, high);
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1));
  return _mm_cvtss_f32(sum);
}

// The packed weights of one format; `at(n, k)` points at row n's values k..k+7 (k a multiple of 8).
template <typename T>
struct Packed {
  const T* w;
  int64_t K;
  inline const T* at(int64_t n, int64_t k) const { return w + ((n / kBlock) * K + k) * kBlock + (n % kBlock) * 8; }
  // Asks for what the step of k `kPrefetchBytes` further along the stream of rows [n0, n0 + rows) reads.
  inline void prefetch(int64_t n0, int64_t k, int64_t rows) const {
    const char* next = reinterpret_cast<const char*>(at(n0, k)) + kPrefetchBytes;
    for (int64_t line = 0; line < rows * 8 * static_cast<int64_t>(sizeof(T)); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
  }
};

struct F32Rows : Packed<float> {
  inline __m256 load(int64_t n, int64_t k) const { return _mm256_loadu_ps(at(n, k)); }
  inline float finish(int64_t, float acc) const { return acc; }
};

struct Int8Rows : Packed<int8_t> {
  const float* scale;
  inline __m256 load(int64_t n, int64_t k) const {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at(n, k)));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  inline float finish(int64_t n, float acc) const { return acc * scale[n]; }
};

// Output rows [n0, n0 + rows) (inside one block) for input rows [m0, m0 + inputs): one 8-lane accumulator
// per (input, output) pair, multiply-adds in ascending k, each weight vector loaded (and widened) once for
// all the tile's inputs. Both counts are compile-time constants, so the accumulators stay in registers.
// Outputs at n >= N (a partial last block's zero rows) are computed and not stored. Never inlined: inlined
// into the block loop next to its other shapes, the 4 x 2 tile lost its registers to the compiler's
// allocation there and ran 1.3-2x slower (LM head at 4 rows: 25-33 ms against 16-19).
template <typename Rows, int64_t inputs, int64_t rows>
__attribute__((noinline)) void tile(const Rows& W, const float* x, float* y, const float* bias, int64_t N, int64_t K,
                                    int64_t m0, int64_t n0) {
  __m256 acc[inputs][rows];
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    W.prefetch(n0, k, rows);
    __m256 xv[inputs];
    for (int64_t i = 0; i < inputs; ++i) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 wv = W.load(n0 + r, k);
      for (int64_t i = 0; i < inputs; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows && n0 + r < N; ++r) {
      const float out = W.finish(n0 + r, horizontal_sum(acc[i][r]));
      y[(m0 + i) * N + n0 + r] = bias ? out + bias[n0 + r] : out;
    }
}

// All the inputs against the block of rows n0.., each weight vector read from the block (in cache after the
// first tile) and widened in registers once per tile: groups of 4 inputs x 2 rows, the last 2 or 3 inputs
// x 4 rows, a lone input (x 8 rows) only when it is the only one. A lone input after a group costs about
// as much as a whole group, hence 5 = 3 + 2. Measured on the embedded model's LM head, interleaved, against
// widening each int8 block into a float32 buffer first and tiling 3 inputs x 4 rows from it: 2 / 4 / 16
// rows took 10.4 / 14.9 / 49.5 ms against 41.9 / 30.4 / 62.9, and it was no slower on the other projections.
template <typename Rows>
inline void tiles(const Rows& W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int64_t M, int64_t n0) {
  if (M == 1) {
    tile<Rows, 1, kBlock>(W, x, y, bias, N, K, 0, n0);
    return;
  }
  int64_t m = 0;
  for (; M - m >= 4 && M - m != 5; m += 4)
    for (int64_t r = 0; r < kBlock; r += 2) tile<Rows, 4, 2>(W, x, y, bias, N, K, m, n0 + r);
  if (M - m == 5) {
    for (int64_t r = 0; r < kBlock; r += 4) tile<Rows, 3, 4>(W, x, y, bias, N, K, m, n0 + r);
    m += 3;
  }
  if (M - m == 3)
    for (int64_t r = 0; r < kBlock; r += 4) tile<Rows, 3, 4>(W, x, y, bias, N, K, m, n0 + r);
  if (M - m == 2)
    for (int64_t r = 0; r < kBlock; r += 4) tile<Rows, 2, 4>(W, x, y, bias, N, K, m, n0 + r);
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
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Grain: enough blocks per thread that handing out the job is noise next to reading their weights.
  kiln::SpinPool::run(blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) tiles(W, xp, yp, bp, N, K, M, b * kBlock);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// Checks that w is packed weights [ceil(N / 8), K / 8, 8, 8] (see kBlock) and returns K.
int64_t check_packed(const torch::Tensor& w, int64_t N) {
  TORCH_CHECK(w.is_contiguous() && w.dim() == 4 && w.size(0) == (N + kBlock - 1) / kBlock && w.size(2) == kBlock &&
              w.size(3) == 8, "w must be packed weights [ceil(N / 8), K / 8, 8, 8] for N = ", N);
  return w.size(1) * 8;
}

void check_input(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be a float32 CPU tensor");
  const int64_t K = check_packed(w, N);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be a contiguous float32 tensor of ", N, " values");
}

// Rows [begin, end) of packed weights as row-major float32 in out [N, K], times scale[n] when given.
template <typename T>
void unpack_rows(const Packed<T>& W, const float* scale, int64_t begin, int64_t end, float* out) {
  for (int64_t n = begin; n < end; ++n) {
    const float factor = scale ? scale[n] : 1.0f;
    for (int64_t k = 0; k < W.K; k += 8) {
      const T* values = W.at(n, k);
      for (int64_t j = 0; j < 8; ++j) out[n * W.K + k + j] = static_cast<float>(values[j]) * factor;
    }
  }
}

}  // namespace

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "w: packed float32");
  check_input(x, w, bias, N);
  return run(F32Rows{{w.data_ptr<float>(), x.size(-1)}}, x, bias, N);
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8, "w: packed int8");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32, "scale: contiguous float32 [N]");
  check_input(x, w, bias, scale.numel());
  return run(Int8Rows{{w.data_ptr<int8_t>(), x.size(-1)}, scale.data_ptr<float>()}, x, bias, scale.numel());
}

// Writes the row-major float32 [N, K] matrix packed weights stand for into `out` (scale: int8's per-row
// scales, else none) and returns it.
torch::Tensor unpack(torch::Tensor w, c10::optional<torch::Tensor> scale, int64_t N, torch::Tensor out) {
  const int64_t K = check_packed(w, N);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat32 && out.numel() == N * K, "out: contiguous float32 [N, K]");
  const bool int8 = w.scalar_type() == torch::kInt8;
  TORCH_CHECK(int8 == scale.has_value() && (int8 || w.scalar_type() == torch::kFloat32), "int8 weights take scales, float32 none");
  float* op = out.data_ptr<float>();
  kiln::SpinPool::run(N, 64, [&](int64_t begin, int64_t end) {
    if (int8) unpack_rows(Packed<int8_t>{w.data_ptr<int8_t>(), K}, scale->data_ptr<float>(), begin, end, op);
    else unpack_rows(Packed<float>{w.data_ptr<float>(), K}, nullptr, begin, end, op);
  });
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                              torch::Tensor first_pos, torch::Tensor row_seq, torch::Tensor row_pos, int64_t window,
                              double scale);  // attention.cpp
torch::Tensor paged_attention_coded(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_scales, torch::Tensor k_zeros,
                                    torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_zeros,
                                    torch::Tensor block_table, torch::Tensor first_pos, torch::Tensor row_seq,
                                    torch::Tensor row_pos, int64_t window, double scale);  // attention.cpp

void store_kv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, torch::Tensor pages,
              torch::Tensor offsets);  // kv_store.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset);  // norms.cpp
std::tuple<torch::Tensor, torch::Tensor> residual_norm(torch::Tensor x, torch::Tensor y, c10::optional<torch::Tensor> y_weight,
                                                       double y_eps, double y_offset, c10::optional<torch::Tensor> out_weight,
                                                       double out_eps, double out_offset);  // norms.cpp
torch::Tensor gated_activation(torch::Tensor gate_up, const std::string& activation);  // activations.cpp
torch::Tensor argmax_rows(torch::Tensor logits);  // argmax.cpp
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(torch::Tensor qkv, c10::optional<torch::Tensor> norm_weight,
                                                      double eps, double offset, torch::Tensor cos, torch::Tensor sin,
                                                      int64_t heads);  // norms.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "fused RMSNorm (norms.cpp)");
  m.def("residual_norm", &residual_norm, "residual add of a (normed) sublayer output, and its norm (norms.cpp)");
  m.def("gated_activation", &gated_activation, "act(gate) * up of a fused gate/up projection (activations.cpp)");
  m.def("argmax_rows", &argmax_rows, "each row's torch.argmax (argmax.cpp)");
  m.def("qk_norm_rope", &qk_norm_rope, "fused q/k head norms and rotary embedding (norms.cpp)");
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention (attention.cpp)");
  m.def("paged_attention_coded", &paged_attention_coded, "paged attention over 8-bit / 4-bit coded pages (attention.cpp)");
  m.def("store_kv", &store_kv, "new K/V rows stored into raw or coded pages (kv_store.cpp)");
  m.def("linear_f32", &linear_f32, "batch-invariant float32 linear (packed weights)");
  m.def("unpack", &unpack, "packed weights -> row-major float32");
  m.def("linear_int8", &linear_int8, "weight-only int8 linear (packed weights, per-row scales)");
}
