// Linear layers over GGUF's quantised blocks as the file stores them: y[M, N] = x[M, K] . W[N, K]^T where
// W's rows are one or more tensors of a GGUF file (a fused q/k/v or gate/up layer's parts), each in its own
// block type, read where they lie in the mmapped file.
//
// Why: decoding reads every weight once per token, so the bytes read are the bound on a CPU with cores
// to spare. Re-quantising a Q4_K file to int8 read ~1.7x the bytes llama.cpp reads, and rounded the
// weights a second time (bench/README.md § gguf_sizes). Computing the blocks as stored reads what
// llama.cpp reads, keeps the file's quality, and leaves no converted copy on disk or in memory.
//
// How, as llama.cpp's vec_dot kernels do: each input row is quantised per block of 32 values to int8 with
// a scale of its own (blocks.h, Acts), and each weight sub-block of 32 meets it in an exact integer dot
// product, scaled in float (block_dot.h). llama.cpp quantises inputs per 256 values for the K-quants
// (Q8_K); per 32 here rounds finer at the cost of a float multiply per sub-block. Results depend on the
// row alone (batch invariance, INV-3) and not on the instruction-set path (isa.h).
#include <torch/extension.h>
#include <immintrin.h>

#include "blocks.h"
#include "checks.h"
#include "isa.h"
#include "kernels.h"
#include "pool.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using kiln::blocks::kActBlock;

// The largest |value| of x[0, count) (count a multiple of 8), and whether any is NaN.
inline float largest_magnitude(const float* x, int64_t count, bool& nan) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  return kiln::horizontal_max(top);
}

// 32 values times `by`, rounded half to even (MXCSR), stored as int8 codes; returns the sums of the first
// and the last 16 codes.
inline std::pair<int32_t, int32_t> store_codes(const float* values, __m256 by, int8_t* q) {
  __m256i codes[4];
  for (int i = 0; i < 4; ++i) codes[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * i), by));
  // Codes 0..31 in order: packs interleave 128-bit halves, which the permute undoes.
  const __m256i words = _mm256_packs_epi32(codes[0], codes[1]), words2 = _mm256_packs_epi32(codes[2], codes[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  return {kiln::horizontal_sum_i32(_mm256_add_epi32(codes[0], codes[1])), kiln::horizontal_sum_i32(_mm256_add_epi32(codes[2], codes[3]))};
}

// The multiplier that maps a block's largest magnitude to code 127 (0 for an all-zero block), and the
// block's scale: amax / 127, NaN for a block holding a NaN, so its outputs are NaN as float arithmetic
// would make them.
inline std::pair<__m256, float> code_scale(const float* x, int64_t count) {
  bool nan = false;
  const float amax = largest_magnitude(x, count, nan);
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
  return {_mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), scale};
}

// Rows [begin, end) of x [M, K] as Acts' per-32 form.
void quantize_32(const float* x, int64_t K, int64_t begin, int64_t end, int8_t* q, float* d, float* ds) {
  const int64_t blocks = K / kActBlock;
  for (int64_t m = begin; m < end; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* values = x + m * K + b * kActBlock;
      const auto [by, scale] = code_scale(values, kActBlock);
      const auto [first, last] = store_codes(values, by, q + m * K + b * kActBlock);
      d[m * blocks + b] = scale;
      ds[m * blocks + b] = scale * static_cast<float>(first + last);
    }
}

// Rows [begin, end) of x [M, K] as Acts' per-256 form.
void quantize_256(const float* x, int64_t K, int64_t begin, int64_t end, int8_t* q, float* d, int16_t* bsums, int16_t* sums32) {
  const int64_t blocks = K / 256;
  for (int64_t m = begin; m < end; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* values = x + m * K + b * 256;
      const auto [by, scale] = code_scale(values, 256);
      d[m * blocks + b] = scale;
      for (int64_t j = 0; j < 8; ++j) {
        const auto [first, last] = store_codes(values + 32 * j, by, q + m * K + b * 256 + 32 * j);
        bsums[m * (K / 16) + b * 16 + 2 * j] = static_cast<int16_t>(first);  // |sum| <= 16 x 127
        bsums[m * (K / 16) + b * 16 + 2 * j + 1] = static_cast<int16_t>(last);
        sums32[m * (K / 32) + b * 8 + j] = static_cast<int16_t>(first + last);
      }
    }
}

// The call's segments, checked against `data` and K: every byte a segment names lies inside `data`.
std::vector<kiln::blocks::Segment> checked_segments(const torch::Tensor& data, const torch::Tensor& segments, int64_t K, int64_t N) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.dim() == 1 && data.is_contiguous(),
              "data: a contiguous 1-D uint8 CPU tensor (a GGUF file's bytes)");
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == torch::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
              segments.size(0) > 0, "segments: an int64 [S, 3] CPU tensor of (byte offset, rows, GGML type)");
  const auto s = segments.contiguous();
  const int64_t* rows = s.data_ptr<int64_t>();
  std::vector<kiln::blocks::Segment> out;
  int64_t first = 0;
  for (int64_t i = 0; i < s.size(0); ++i) {
    const int64_t offset = rows[3 * i], count = rows[3 * i + 1], type = rows[3 * i + 2];
    const int64_t values = kiln::blocks::block_values(type);
    TORCH_CHECK(values > 0, "segments[", i, "]: GGML type ", type, " is not a block format these kernels compute");
    TORCH_CHECK(K % values == 0, "segments[", i, "]: ", K, " input features are not whole blocks of ", values);
    const int64_t row_bytes = K / values * kiln::blocks::block_bytes(type);
    TORCH_CHECK(offset >= 0 && count > 0 && offset <= data.numel() && count <= (data.numel() - offset) / row_bytes,
                "segments[", i, "]: ", count, " rows of ", row_bytes, " bytes from ", offset, " lie outside the ", data.numel(), " bytes of data");
    TORCH_CHECK(!kiln::blocks::repacked(type) || (count % kiln::blocks::kGroupRows == 0 && first % kiln::blocks::kGroupRows == 0),
                "segments[", i, "]: repacked rows come in groups of ", kiln::blocks::kGroupRows, " from a multiple of ",
                kiln::blocks::kGroupRows, ", got ", count, " rows from row ", first);
    out.push_back({data.data_ptr<uint8_t>() + offset, count, row_bytes, type, first});
    first += count;
  }
  TORCH_CHECK(first == N, "segments hold ", first, " rows, not the layer's ", N);
  return out;
}

}  // namespace

torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor data, torch::Tensor segments, c10::optional<torch::Tensor> columns,
                            c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() >= 1, "x must be a float32 CPU tensor");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % kActBlock == 0, "x has ", K, " features; block formats take a multiple of ", kActBlock);
  const auto parts = checked_segments(data, segments, K, N);
  torch::Tensor column_map;
  if (columns.has_value()) {
    column_map = kiln::index_tensor(*columns, "columns", 1);
    TORCH_CHECK(column_map.numel() == N, "columns: ", N, " output columns, got ", column_map.numel());
    kiln::check_range(column_map.data_ptr<int64_t>(), N, 0, N, "columns");
  }
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be a contiguous float32 tensor of ", N, " values");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  const bool per_32 = std::any_of(parts.begin(), parts.end(), [](const auto& p) { return kiln::blocks::block_values(p.type) == 32; });
  const bool per_256 = std::any_of(parts.begin(), parts.end(), [](const auto& p) { return kiln::blocks::block_values(p.type) == 256; });
  // The codes live for this call only: the calling thread's buffers, grown to the largest call's and kept.
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  thread_local std::vector<int16_t> sums;
  codes.resize(std::max<size_t>(codes.size(), 2 * M * K));
  scales.resize(std::max<size_t>(scales.size(), 2 * M * (K / kActBlock) + M * (K / 256)));
  sums.resize(std::max<size_t>(sums.size(), per_256 ? M * (K / 16 + K / 32) : 0));
  // The workers take these pointers: in a worker, `codes` names its own.
  int8_t* const q32 = codes.data();
  int8_t* const q256 = q32 + M * K;
  float* const d32 = scales.data();
  float* const ds32 = d32 + M * (K / kActBlock);
  float* const d256 = ds32 + M * (K / kActBlock);
  int16_t* const bsums = sums.data();
  int16_t* const sums32 = bsums + M * (K / 16);
  const float* xp = x2.data_ptr<float>();
  kiln::SpinPool::run(M, 16, [&](int64_t begin, int64_t end) {
    if (per_32) quantize_32(xp, K, begin, end, q32, d32, ds32);
    if (per_256) quantize_256(xp, K, begin, end, q256, d256, bsums, sums32);
  });
  const kiln::blocks::Acts acts{q32, d32, ds32, q256, d256, bsums, sums32, K};
  const kiln::blocks::Out out{y.data_ptr<float>(), N, columns.has_value() ? column_map.data_ptr<int64_t>() : nullptr,
                              bias.has_value() ? bias->data_ptr<float>() : nullptr};
  const auto dot_rows = kiln::active_isa() == kiln::Isa::kAvx512Vnni ? &kiln::blocks_avx512::dot_rows : &kiln::blocks_avx2::dot_rows;
  // Output rows split over the threads in groups of eight (a repacked segment's unit), each thread's share
  // walking the segments it overlaps.
  constexpr int64_t group = kiln::blocks::kGroupRows;
  kiln::SpinPool::run((N + group - 1) / group, 1, [&](int64_t first_group, int64_t end_group) {
    const int64_t begin = first_group * group, end = std::min(N, end_group * group);
    for (const auto& part : parts) {
      const int64_t r0 = std::max(begin, part.first_row) - part.first_row;
      const int64_t r1 = std::min(end, part.first_row + part.rows) - part.first_row;
      if (r0 < r1) dot_rows(part, r0, r1, acts, 0, M, out);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}
