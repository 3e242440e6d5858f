// Storing a step's new K/V rows into KV pages: raw float32 or float16, or encoded (kiln/kv/codec.py's 8-bit and 4-bit
// formats).
//
// Why: the codec's torch encoding is some twenty small tensor operations per layer and side, which cost a
// small model's decode step more than the attention itself. This makes the same float32 operations in the same order, rounding included (scales to float16
// round to nearest even, codes round half to even), so its bytes equal the torch encoding's.
//
// Raw pages go through here too: one call instead of two index_put calls per layer.
//
// Layout: x [N, kv_heads, D] float32 rows; codes a view [P, page_size, kv_heads, D] float32 or float16 (raw:
// rows copied as they are, or rounded to nearest even as torch's .half() does; scales and zeros empty),
// int8 (symmetric 8-bit, value = code * scale) or [..., D / 2] uint8 (4-bit, two a byte, even channel in
// the low nibble, value = code * scale + zero); scales (and zeros for 4 bits) float16 [P, page_size,
// kv_heads, G], one per group of D / G channels; any page stride, contiguous inside a page. Row n goes to
// (pages[n], offsets[n]).
#include <torch/extension.h>
#include <immintrin.h>

#include "checks.h"
#include "kernels.h"
#include "page_format.h"
#include "pool.h"
#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using kiln::page_format::kInt4Max;
using kiln::page_format::kInt8Max;
using kiln::page_format::kTinyScale;

inline float to_half_and_back(float x, at::Half* out) {
  const uint16_t bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  out->x = bits;
  return _cvtsh_ss(bits);
}

// Rounded to nearest even, overflow to infinity: the IEEE conversion torch's .half() makes.
void to_half(const float* x, int64_t D, at::Half* out) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
  for (; d < D; ++d) out[d].x = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
}

void encode_8bit(const float* x, int64_t D, int64_t group, int8_t* codes, at::Half* scales) {
  for (int64_t begin = 0, g = 0; begin < D; begin += group, ++g) {
    float top = 0.0f;
    for (int64_t d = begin; d < begin + group; ++d) top = std::max(top, std::fabs(x[d]));
    const float top_code = static_cast<float>(kInt8Max);
    const float scale = to_half_and_back(std::max(top / top_code, kTinyScale), &scales[g]);
    for (int64_t d = begin; d < begin + group; ++d)
      codes[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / scale), -top_code, top_code));
  }
}

void encode_4bit(const float* x, int64_t D, int64_t group, uint8_t* codes, at::Half* scales, at::Half* zeros) {
  for (int64_t begin = 0, g = 0; begin < D; begin += group, ++g) {
    float low = x[begin], high = x[begin];
    for (int64_t d = begin; d < begin + group; ++d) low = std::min(low, x[d]), high = std::max(high, x[d]);
    const float zero = to_half_and_back(low, &zeros[g]);
    const float top_code = static_cast<float>(kInt4Max);
    const float scale = to_half_and_back(std::max((high - zero) / top_code, kTinyScale), &scales[g]);
    for (int64_t d = begin; d < begin + group; d += 2) {
      const auto code = [&](int64_t c) { return static_cast<uint8_t>(std::clamp(std::nearbyint((x[c] - zero) / scale), 0.0f, top_code)); };
      codes[d / 2] = static_cast<uint8_t>(code(d) | (code(d + 1) << 4));
    }
  }
}

}  // namespace

void store_kv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, torch::Tensor pages,
              torch::Tensor offsets) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x: contiguous float32 CPU tensor [N, kv_heads, D]");
  TORCH_CHECK(codes.device().is_cpu(), "codes: a CPU tensor");
  const bool half = codes.scalar_type() == torch::kHalf, raw = half || codes.scalar_type() == torch::kFloat32;
  const bool four = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(raw || four || codes.scalar_type() == torch::kInt8,
              "codes: float32 or float16 (raw), int8 (8-bit) or uint8 (two 4-bit codes a byte)");
  const int64_t N = x.size(0), kv_heads = x.size(1), D = x.size(2), groups = raw ? 1 : scales.size(-1);
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kv_heads && codes.size(3) == (four ? D / 2 : D) && codes.stride(3) == 1 &&
              codes.stride(2) == codes.size(3) && codes.stride(1) == kv_heads * codes.size(3), "codes: [P, page_size, kv_heads, D or D / 2], contiguous inside a page");
  TORCH_CHECK(raw || (scales.scalar_type() == torch::kHalf && scales.dim() == 4 && groups > 0 && D % groups == 0 && (D / groups) % 2 == 0 &&
              scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(2) == kv_heads &&
              scales.stride(3) == 1 && scales.stride(2) == groups && scales.stride(1) == kv_heads * groups),
              "scales: float16 [P, page_size, kv_heads, G] like the codes' pages, contiguous inside a page");
  TORCH_CHECK(!four || (zeros.sizes() == scales.sizes() && zeros.strides() == scales.strides() && zeros.scalar_type() == torch::kHalf),
              "zeros: float16 like the scales (4-bit codes)");
  const auto page_of = kiln::index_tensor(pages, "pages", 1), offset_of = kiln::index_tensor(offsets, "offsets", 1);
  TORCH_CHECK(page_of.numel() == N && offset_of.numel() == N, "pages, offsets: one per row");
  const int64_t* page = page_of.data_ptr<int64_t>();
  const int64_t* offset = offset_of.data_ptr<int64_t>();
  kiln::check_range(page, N, 0, codes.size(0), "pages");
  kiln::check_range(offset, N, 0, codes.size(1), "offsets");
  const float* xp = x.data_ptr<float>();
  auto* code_base = static_cast<uint8_t*>(codes.data_ptr());
  const int64_t code_bytes = codes.element_size();
  auto* scale_base = raw ? nullptr : scales.data_ptr<at::Half>();
  auto* zero_base = four ? zeros.data_ptr<at::Half>() : nullptr;
  const int64_t group = D / groups;
  kiln::SpinPool::run(N * kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / kv_heads, h = r % kv_heads;
      uint8_t* row_codes = code_base + (page[n] * codes.stride(0) + offset[n] * codes.stride(1) + h * codes.stride(2)) * code_bytes;
      if (half) {
        to_half(xp + r * D, D, reinterpret_cast<at::Half*>(row_codes));
        continue;
      }
      if (raw) {
        std::memcpy(row_codes, xp + r * D, D * sizeof(float));
        continue;
      }
      at::Half* row_scales = scale_base + page[n] * scales.stride(0) + offset[n] * scales.stride(1) + h * groups;
      if (four)
        encode_4bit(xp + r * D, D, group, row_codes, row_scales,
                    zero_base + page[n] * zeros.stride(0) + offset[n] * zeros.stride(1) + h * groups);
      else
        encode_8bit(xp + r * D, D, group, reinterpret_cast<int8_t*>(row_codes), row_scales);
    }
  });
}
