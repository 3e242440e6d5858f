// int8 and batch-invariant float32 linear layers for AVX2 CPUs: y[M, N] = x[M, K] . W[N, K]^T.
//
// Why a kernel of our own: decoding reads every weight once per token and the CPU's memory bandwidth is the
// bound, so weights should cross it as int8. PyTorch's own weight-only int8/int4 CPU kernels have no fast
// AVX2 path, and fbgemm's dynamic int8 quantises the activations with one scale per tensor, which makes a
// row's result depend on the rest of its batch (and loses accuracy on Gemma's outlier channels).
//
// Every output element is computed the same way whatever M is and wherever its row sits in the batch, so a
// row's result is bit-identical alone, in a batch, or in a prefill chunk of any size (batch invariance,
// INV-3, which the deterministic mode relies on):
//   float32: one 8-lane accumulator per (row, output) pair, fused multiply-adds in ascending k, then a
//            fixed horizontal sum.
//   int8:    the input row quantised to int16 with a scale of its own, exact integer sums (see run_int8).
//
// Formats (of one weight row; rows are packed in blocks of 8, see kBlock):
//   f32:  K floats.
//   int8: K int8 values q, w = q * scale[n] (symmetric per output row).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "isa.h"
#include "kernels.h"
#include "pool.h"
#include "vec_math.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace {

// Weights are packed in blocks of kBlock output rows: for each 8 columns k..k+7, the block's 8 rows hold
// their 8 values one after another (element (n, k) at ((n / 8) * K + k) * 8 + (n % 8) * 8 + k % 8). One
// decode tile reads a whole block, and so one contiguous stream, 8 rows x 8 values (one cache line of
// int8) per step of k. Row-major rows instead made each tile read 4-8 separate streams, which the
// hardware prefetcher follows poorly (bench/README.md gives the LM head's times both ways; bench/kernels.py
// measures them). quant.py packs once, at quantisation.
constexpr int64_t kBlock = 8;
// Software prefetch distance in the block's stream: 2 KiB ahead was the fastest of the distances tried
// (shorter ones, and none, were slower on the small matrices).
constexpr int64_t kPrefetchBytes = 2048;

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

// float32: output rows [n0, n0 + rows) (inside one block) for input rows [m0, m0 + inputs): one 8-lane
// accumulator per (input, output) pair, multiply-adds in ascending k, each weight vector loaded once for
// all the tile's inputs. Both counts are compile-time constants, so the accumulators stay in registers.
// Outputs at n >= N (a partial last block's zero rows) are computed and not stored. Never inlined: inlined
// into the block loop next to its other shapes, the 4 x 2 tile lost its registers to the compiler's
// allocation there and ran much slower.
template <int64_t inputs, int64_t rows>
__attribute__((noinline)) void tile(const Packed<float>& W, const float* x, float* y, const float* bias, int64_t N, int64_t K,
                                    int64_t m0, int64_t n0) {
  __m256 acc[inputs][rows];
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    W.prefetch(n0, k, rows);
    __m256 xv[inputs];
    for (int64_t i = 0; i < inputs; ++i) xv[i] = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 wv = _mm256_loadu_ps(W.at(n0 + r, k));
      for (int64_t i = 0; i < inputs; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t r = 0; r < rows && n0 + r < N; ++r) {
      const float out = kiln::horizontal_sum(acc[i][r]);
      y[(m0 + i) * N + n0 + r] = bias ? out + bias[n0 + r] : out;
    }
}

// All the inputs against the block of rows n0..: groups of 4 inputs x 2 rows, the last 2 or 3 inputs x 4
// rows, a lone input (x 8 rows) only when it is the only one. A lone input after a group costs about as
// much as a whole group, hence 5 = 3 + 2. Tiling from registers beat widening each block into a float32
// buffer first at every row count tried.
inline void tiles(const Packed<float>& W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int64_t M, int64_t n0) {
  if (M == 1) {
    tile<1, kBlock>(W, x, y, bias, N, K, 0, n0);
    return;
  }
  int64_t m = 0;
  for (; M - m >= 4 && M - m != 5; m += 4)
    for (int64_t r = 0; r < kBlock; r += 2) tile<4, 2>(W, x, y, bias, N, K, m, n0 + r);
  if (M - m == 5) {
    for (int64_t r = 0; r < kBlock; r += 4) tile<3, 4>(W, x, y, bias, N, K, m, n0 + r);
    m += 3;
  }
  if (M - m == 3)
    for (int64_t r = 0; r < kBlock; r += 4) tile<3, 4>(W, x, y, bias, N, K, m, n0 + r);
  if (M - m == 2)
    for (int64_t r = 0; r < kBlock; r += 4) tile<2, 4>(W, x, y, bias, N, K, m, n0 + r);
}

// int8 layers compute in integers: each input row is quantised to int16, x ~= q * s with one scale per row
// (s = max|x| / levels), and y = (sum_k q[k] * w[n, k]) * s * scale[n]. The sum is exact in int32, so its
// order is free: the result depends on the row alone, never on its batch (INV-3). One _mm256_madd_epi16
// multiplies 16 int16 pairs (an FMA: 8 floats) and widening int8 to int16 is one instruction per 16
// weights (into float32: two per 8). Against the kernel this replaced (int8 widened to float32, FMA) it is
// faster from a few rows up and equal at one row, where reading the weights is the bound; and faster than
// widening the weights once for BLAS at every prefill size tried (bench/README.md has the figures).
//
// Levels: as many as int16 holds, as long as the int32 sum of K products of at most 127 * levels cannot
// overflow: 26,420 for K = 640, 8,256 for K = 2048. The quantisation step, max|x| / levels, stays far below
// the weights' own (max|w| / 127).
inline int64_t activation_levels(int64_t K) {
  return std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * K));
}

// Rows [begin, end) of x [M, K] as int16 codes q (round half to even of x * (levels / max|x|)) and
// scales s = max|x| / levels; an all-zero row gets zero codes and scale 0. A row holding a NaN gets scale
// NaN, so its outputs are NaN as float arithmetic would make them (an infinity: codes 0, scale inf, NaN).
void quantize_rows(const float* x, int64_t K, int64_t levels, int64_t begin, int64_t end, int16_t* q, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = begin; m < end; ++m) {
    const float* row = x + m * K;
    __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_loadu_ps(row + k);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const float amax = kiln::horizontal_max(top);
    const float inverse = amax > 0.0f ? static_cast<float>(levels) / amax : 0.0f;
    s[m] = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : amax / static_cast<float>(levels);
    const __m256 by = _mm256_set1_ps(inverse);
    for (int64_t k = 0; k < K; k += 8) {
      const __m256i codes = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), by));  // MXCSR: half to even
      const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + k), packed);
    }
  }
}

struct QuantizedInput {
  const int16_t* q;  // [M, K], K the weights'
  const float* scale;
};

// The sums of the accumulators of `pairs` row pairs (each: row n's 4 lanes, then row n + 1's), in row order
// n0, n0 + 1, ... in the first 2 * pairs lanes. Exact: integer adds, which cannot overflow (activation_levels).
template <int64_t pairs>
inline __m256i row_sums(const __m256i* acc) {
  static_assert(pairs == 2 || pairs == 4, "2 or 4 row pairs");
  const __m256i low = _mm256_hadd_epi32(acc[0], acc[1]);
  const __m256i high = pairs == 4 ? _mm256_hadd_epi32(acc[2], acc[3]) : low;
  // Low half: pair j's first row in lane j; high half: its second row (pairs 2: each pair twice).
  const __m256i sums = _mm256_hadd_epi32(low, high);
  return _mm256_permutevar8x32_epi32(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// acc + madd(w, x), as one unit the compiler cannot split. Written with intrinsics, GCC issued every
// input's multiply-add before any add, which needs a scratch register per input: with the tile's
// accumulators, inputs and weights already in the 16 registers, it spilled an accumulator to the stack and
// copied the others back each step. As one asm unit, a tile with its weights in cache comes close to the
// rate of a loop of bare multiply-adds and adds.
// With AVX-512 VNNI (isa.h) the pair is one instruction, vpdpwssd, with the same exact result.
template <bool vnni>
inline __m256i madd_accumulate(__m256i acc, __m256i w, __m256i x) {
  if constexpr (vnni) {
    asm("%{evex%} vpdpwssd %[x], %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "v"(x));
  } else {
    __m256i products;
    asm("vpmaddwd %[x], %[w], %[products]\n\tvpaddd %[products], %[acc], %[acc]"
        : [acc] "+x"(acc), [products] "=&x"(products)
        : [w] "x"(w), [x] "x"(x));
  }
  return acc;
}

// Output rows [n0, n0 + 2 * pairs) (inside one block) for input rows [m0, m0 + inputs). The packed block
// holds, for each 8 columns, row n's 8 values and then row n + 1's: one 16-byte load widened to int16
// meets the input's 8 codes broadcast to both halves, so one accumulator carries two output rows (row n in
// its low 4 lanes, n + 1 in its high 4). Never inlined, for the reason `tile` gives.
template <bool vnni, int64_t inputs, int64_t pairs>
__attribute__((noinline)) void int8_tile(const Packed<int8_t>& W, const float* w_scale, const QuantizedInput& X, float* y,
                                         const float* bias, int64_t N, int64_t m0, int64_t n0) {
  const int64_t K = W.K;
  __m256i acc[inputs][pairs];
  for (int64_t i = 0; i < inputs; ++i)
    for (int64_t p = 0; p < pairs; ++p) acc[i][p] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 8) {
    W.prefetch(n0, k, 2 * pairs);
    __m256i xv[inputs];
    for (int64_t i = 0; i < inputs; ++i)
      xv[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(X.q + (m0 + i) * K + k)));
    for (int64_t p = 0; p < pairs; ++p) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.at(n0 + 2 * p, k))));
      for (int64_t i = 0; i < inputs; ++i) acc[i][p] = madd_accumulate<vnni>(acc[i][p], wv, xv[i]);
    }
  }
  // Masked loads and stores only for a partial last block: they cost several times plain ones on AMD.
  const int64_t count = std::min<int64_t>(2 * pairs, N - n0);
  const bool whole = count == 2 * pairs;
  const __m256i valid = kiln::first_lanes(count);
  const auto load = [&](const float* from) {
    if (!whole) return _mm256_maskload_ps(from, valid);
    return pairs == 4 ? _mm256_loadu_ps(from) : _mm256_castps128_ps256(_mm_loadu_ps(from));
  };
  const __m256 w_scales = load(w_scale + n0);
  const __m256 biases = bias ? load(bias + n0) : _mm256_setzero_ps();
  for (int64_t i = 0; i < inputs; ++i) {
    const __m256 sums = _mm256_cvtepi32_ps(row_sums<pairs>(acc[i]));
    __m256 out = _mm256_mul_ps(_mm256_mul_ps(sums, _mm256_set1_ps(X.scale[m0 + i])), w_scales);
    if (bias) out = _mm256_add_ps(out, biases);
    float* to = y + (m0 + i) * N + n0;
    if (!whole) _mm256_maskstore_ps(to, valid, out);
    else if (pairs == 4) _mm256_storeu_ps(to, out);
    else _mm_storeu_ps(to, _mm256_castps256_ps128(out));
  }
}

// Input rows [m0, m1) against the block of rows n0..: groups of 4 inputs x 4 rows, then 3 inputs x 4 rows or
// 2 or 1 inputs x 8 rows (accumulators, inputs and a weight vector all in the 16 registers).
template <bool vnni>
inline void int8_tiles(const Packed<int8_t>& W, const float* w_scale, const QuantizedInput& X, float* y, const float* bias,
                       int64_t N, int64_t m0, int64_t m1, int64_t n0) {
  int64_t m = m0;
  for (; m1 - m >= 4; m += 4)
    for (int64_t r = 0; r < kBlock; r += 4) int8_tile<vnni, 4, 2>(W, w_scale, X, y, bias, N, m, n0 + r);
  if (m1 - m == 3)
    for (int64_t r = 0; r < kBlock; r += 4) int8_tile<vnni, 3, 2>(W, w_scale, X, y, bias, N, m, n0 + r);
  if (m1 - m == 2) int8_tile<vnni, 2, 4>(W, w_scale, X, y, bias, N, m, n0);
  if (m1 - m == 1) int8_tile<vnni, 1, 4>(W, w_scale, X, y, bias, N, m, n0);
}

// Input rows per pass over a thread's blocks: their codes (64 x K int16, 80-256 KiB here) stay in L2 while
// every block of weights meets them.
constexpr int64_t kInputChunk = 64;

torch::Tensor run_int8(const Packed<int8_t>& W, const float* w_scale, const torch::Tensor& x,
                       const c10::optional<torch::Tensor>& bias, int64_t N) {
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int64_t levels = activation_levels(K);
  // The codes live for this call only: the calling thread's buffers, grown to the largest call's and kept,
  // so a decode step (73 projections) allocates no more than before.
  thread_local std::vector<int16_t> codes;
  thread_local std::vector<float> x_scale;
  codes.resize(std::max<size_t>(codes.size(), M * K));
  x_scale.resize(std::max<size_t>(x_scale.size(), M));
  int16_t* const q = codes.data();  // the workers take these pointers: in a worker, `codes` names its own
  float* const q_scale = x_scale.data();
  kiln::SpinPool::run(M, 16, [&](int64_t begin, int64_t end) { quantize_rows(xp, K, levels, begin, end, q, q_scale); });
  const QuantizedInput X{q, q_scale};
  float* yp = y.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const bool vnni = kiln::active_isa() == kiln::Isa::kAvx512Vnni;
  kiln::SpinPool::run(blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kInputChunk)
      for (int64_t b = begin; b < end; ++b) {
        if (vnni) int8_tiles<true>(W, w_scale, X, yp, bp, N, m0, std::min(M, m0 + kInputChunk), b * kBlock);
        else int8_tiles<false>(W, w_scale, X, yp, bp, N, m0, std::min(M, m0 + kInputChunk), b * kBlock);
      }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

torch::Tensor run_f32(const Packed<float>& W, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t N) {
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
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 4 && w.size(0) == (N + kBlock - 1) / kBlock && w.size(2) == kBlock &&
              w.size(3) == 8, "w must be packed weights [ceil(N / 8), K / 8, 8, 8] for N = ", N);
  return w.size(1) * 8;
}

void check_input(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "x must be a float32 CPU tensor");
  const int64_t K = check_packed(w, N);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
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
  return run_f32(Packed<float>{w.data_ptr<float>(), x.size(-1)}, x, bias, N);
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8, "w: packed int8");
  TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32, "scale: contiguous float32 [N]");
  check_input(x, w, bias, scale.numel());
  TORCH_CHECK(activation_levels(x.size(-1)) >= 127, "int8 inputs of ", x.size(-1), " features leave too few int16 levels");
  return run_int8(Packed<int8_t>{w.data_ptr<int8_t>(), x.size(-1)}, scale.data_ptr<float>(), x, bias, scale.numel());
}

// Writes the row-major float32 [N, K] matrix packed weights stand for into `out` (scale: int8's per-row
// scales, else none) and returns it.
torch::Tensor unpack(torch::Tensor w, c10::optional<torch::Tensor> scale, int64_t N, torch::Tensor out) {
  const int64_t K = check_packed(w, N);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == torch::kFloat32 && out.numel() == N * K, "out: contiguous float32 [N, K]");
  const bool int8 = w.scalar_type() == torch::kInt8;
  TORCH_CHECK(int8 == scale.has_value() && (int8 || w.scalar_type() == torch::kFloat32), "int8 weights take scales, float32 none");
  TORCH_CHECK(!int8 || (scale->device().is_cpu() && scale->is_contiguous() && scale->scalar_type() == torch::kFloat32 &&
                        scale->numel() == N), "scale: contiguous float32 [N]");
  float* op = out.data_ptr<float>();
  kiln::SpinPool::run(N, 64, [&](int64_t begin, int64_t end) {
    if (int8) unpack_rows(Packed<int8_t>{w.data_ptr<int8_t>(), K}, scale->data_ptr<float>(), begin, end, op);
    else unpack_rows(Packed<float>{w.data_ptr<float>(), K}, nullptr, begin, end, op);
  });
  return out;
}
