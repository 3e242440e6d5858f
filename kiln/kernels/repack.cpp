// GGUF blocks repacked eight rows to a group, the layouts blocks.h describes (kRepacked): done once at load by
// kiln/models/gguf_blocks.py, into the layer's own memory.
//
// Why: with a vector lane per row, a group's scales and float steps are one vector operation for eight rows,
// its input codes are four bytes broadcast to every lane and no row ends in a horizontal sum; decode and
// prefill computed 1.1-4.9x faster per layer than row by row (bench/README.md § gguf_sizes). llama.cpp
// repacks its common types for the same reason. Why here and not in torch: one pass over the bytes, in
// parallel, with no temporaries; a torch version took 23 s to load an 8B file.
//
// The bytes stay the file's, rearranged; only packed scales are unpacked (Q4_K 148 bytes a row-block, the
// file's 144; Q5_K 180 / 176; IQ4_XS 138 / 136).
#include <torch/extension.h>

#include "blocks.h"
#include "kernels.h"
#include "pool.h"

#include <array>
#include <cstring>

namespace {

using kiln::blocks::kGroupRows;
using Rows = std::array<const uint8_t*, kGroupRows>;  // one block of each of a group's rows

// A group's scales (or any per-row field of `bytes` bytes at `at`) row after row.
uint8_t* by_row(uint8_t* out, const Rows& rows, int64_t at, int64_t bytes) {
  for (int64_t r = 0; r < kGroupRows; ++r) std::memcpy(out + r * bytes, rows[r] + at, bytes);
  return out + kGroupRows * bytes;
}

// Codes (0..15) of `count` values per row, a multiple of 8, as nibble vectors: per 8 values q, each row's
// 4 bytes, byte k holding value 8q + k in its low nibble and 8q + 4 + k in its high one.
uint8_t* nibble_vectors(uint8_t* out, const uint8_t (*codes)[256], int64_t first, int64_t count) {
  for (int64_t q = 0; q < count / 8; ++q)
    for (int64_t r = 0; r < kGroupRows; ++r)
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t v = first + 8 * q + k;
        *out++ = static_cast<uint8_t>((codes[r][v] & 15) | (codes[r][v + 4] & 15) << 4);
      }
  return out;
}

// The fifth bits (bit 4 of the codes) of 32 values per row from `first`: each row's 4 bytes, byte k's bit
// 2q + h holding value 8q + 4h + k's.
uint8_t* fifth_bits(uint8_t* out, const uint8_t (*codes)[256], int64_t first) {
  for (int64_t r = 0; r < kGroupRows; ++r)
    for (int64_t k = 0; k < 4; ++k) {
      uint8_t byte = 0;
      for (int64_t q = 0; q < 4; ++q)
        for (int64_t h = 0; h < 2; ++h) byte |= ((codes[r][first + 8 * q + 4 * h + k] >> 4) & 1) << (2 * q + h);
      *out++ = byte;
    }
  return out;
}

// Q4_K / Q5_K scale and minimum j from the 12 packed bytes (ggml's get_scale_min_k4).
std::pair<uint8_t, uint8_t> scale_min_k4(const uint8_t* q, int64_t j) {
  if (j < 4) return {static_cast<uint8_t>(q[j] & 63), static_cast<uint8_t>(q[j + 4] & 63)};
  return {static_cast<uint8_t>((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4)), static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4))};
}

// One group block of `type` from its rows' blocks (blocks.h's layout, block_bytes(kRepacked + type) x 8
// bytes: tests/kernels/test_blocks.py computes every type from it); returns the end of what it wrote.
uint8_t* repack_group(int64_t type, const Rows& rows, uint8_t* out) {
  namespace b = kiln::blocks;
  uint8_t codes[kGroupRows][256];
  switch (type) {
    case b::kQ4_0: case b::kIQ4_NL: case b::kQ4_1: case b::kQ5_0: case b::kQ5_1: {
      const bool minimum = type == b::kQ4_1 || type == b::kQ5_1, fifth = type == b::kQ5_0 || type == b::kQ5_1;
      const int64_t nibbles = 2 + 2 * minimum + 4 * fifth;
      for (int64_t r = 0; r < kGroupRows; ++r) {
        uint32_t high = 0;
        if (fifth) std::memcpy(&high, rows[r] + 2 + 2 * minimum, 4);
        for (int64_t j = 0; j < 16; ++j) {
          codes[r][j] = static_cast<uint8_t>((rows[r][nibbles + j] & 15) | ((high >> j) & 1) << 4);
          codes[r][j + 16] = static_cast<uint8_t>((rows[r][nibbles + j] >> 4) | ((high >> (j + 16)) & 1) << 4);
        }
      }
      out = by_row(out, rows, 0, 2);
      if (minimum) out = by_row(out, rows, 2, 2);
      if (fifth) out = fifth_bits(out, codes, 0);
      return nibble_vectors(out, codes, 0, 32);
    }
    case b::kQ8_0:
      out = by_row(out, rows, 0, 2);
      for (int64_t v = 0; v < 8; ++v)
        for (int64_t r = 0; r < kGroupRows; ++r, out += 4) std::memcpy(out, rows[r] + 2 + 4 * v, 4);
      return out;
    case b::kQ4_K: case b::kQ5_K: {
      const bool fifth = type == b::kQ5_K;
      for (int64_t r = 0; r < kGroupRows; ++r) {
        const uint8_t* qs = rows[r] + (fifth ? 48 : 16);
        for (int64_t c = 0; c < 4; ++c)  // sub-block 2c: chunk c's low nibbles; 2c + 1: its high ones
          for (int64_t l = 0; l < 32; ++l) {
            const uint8_t high = fifth ? rows[r][16 + l] : 0;
            codes[r][64 * c + l] = static_cast<uint8_t>((qs[32 * c + l] & 15) | ((high >> (2 * c)) & 1) << 4);
            codes[r][64 * c + 32 + l] = static_cast<uint8_t>((qs[32 * c + l] >> 4) | ((high >> (2 * c + 1)) & 1) << 4);
          }
      }
      out = by_row(out, rows, 0, 2);
      out = by_row(out, rows, 2, 2);
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t r = 0; r < kGroupRows; ++r) *out++ = scale_min_k4(rows[r] + 4, j).first;
      for (int64_t pair = 0; pair < 4; ++pair)
        for (int64_t r = 0; r < kGroupRows; ++r)
          for (int64_t j = 2 * pair; j < 2 * pair + 2; ++j) *out++ = scale_min_k4(rows[r] + 4, j).second;
      for (int64_t j = 0; j < 8; ++j) {
        if (fifth) out = fifth_bits(out, codes, 32 * j);
        out = nibble_vectors(out, codes, 32 * j, 32);
      }
      return out;
    }
    case b::kQ6_K: {
      for (int64_t r = 0; r < kGroupRows; ++r)
        for (int64_t part = 0; part < 2; ++part)
          for (int64_t l = 0; l < 32; ++l) {
            const uint8_t* ql = rows[r] + 64 * part;
            const uint8_t high = rows[r][128 + 32 * part + l];
            uint8_t* v = codes[r] + 128 * part;
            v[l] = static_cast<uint8_t>((ql[l] & 15) | (high & 3) << 4);
            v[l + 32] = static_cast<uint8_t>((ql[l + 32] & 15) | ((high >> 2) & 3) << 4);
            v[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | ((high >> 4) & 3) << 4);
            v[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | ((high >> 6) & 3) << 4);
          }
      out = by_row(out, rows, 208, 2);
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t r = 0; r < kGroupRows; ++r) *out++ = rows[r][192 + j];
      for (int64_t j = 0; j < 16; ++j) {
        out = nibble_vectors(out, codes, 16 * j, 16);
        for (int64_t r = 0; r < kGroupRows; ++r)  // the top two bits: byte k's 0-1 value k, 4-5 4 + k, 2-3 8 + k, 6-7 12 + k
          for (int64_t k = 0; k < 4; ++k) {
            const uint8_t* v = codes[r] + 16 * j + k;
            *out++ = static_cast<uint8_t>((v[0] >> 4) | (v[4] >> 4) << 4 | (v[8] >> 4) << 2 | (v[12] >> 4) << 6);
          }
      }
      return out;
    }
    case b::kIQ4_XS: {
      for (int64_t r = 0; r < kGroupRows; ++r)
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t l = 0; l < 16; ++l) {
            codes[r][32 * j + l] = rows[r][8 + 16 * j + l] & 15;
            codes[r][32 * j + 16 + l] = rows[r][8 + 16 * j + l] >> 4;
          }
      out = by_row(out, rows, 0, 2);
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t r = 0; r < kGroupRows; ++r) {
          uint16_t high;
          std::memcpy(&high, rows[r] + 2, 2);
          const int scale = ((rows[r][4 + j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4;
          *out++ = static_cast<uint8_t>(static_cast<int8_t>(scale - 32));
        }
      for (int64_t j = 0; j < 8; ++j) out = nibble_vectors(out, codes, 32 * j, 32);
      return out;
    }
    default:
      return out;  // repacked_row_bytes refuses the others first
  }
}

}  // namespace

int64_t repacked_row_bytes(int64_t type, int64_t cols) {
  const int64_t values = kiln::blocks::block_values(type);
  if (!kiln::blocks::repacked(kiln::blocks::kRepacked + type) || values == 0 || cols % values != 0) return 0;
  return cols / values * kiln::blocks::block_bytes(kiln::blocks::kRepacked + type);
}

int64_t repack_blocks(torch::Tensor stored, int64_t type, torch::Tensor out) {
  TORCH_CHECK(stored.device().is_cpu() && stored.scalar_type() == torch::kUInt8 && stored.dim() == 2 && stored.stride(1) == 1,
              "stored: uint8 CPU rows [rows, bytes], each row contiguous");
  const int64_t rows = stored.size(0), block_bytes = kiln::blocks::block_bytes(type);
  TORCH_CHECK(kiln::blocks::repacked(kiln::blocks::kRepacked + type) && block_bytes > 0, "GGML type ", type, " does not repack");
  TORCH_CHECK(rows % kGroupRows == 0 && stored.size(1) % block_bytes == 0, "stored: rows in groups of ", kGroupRows, " and whole blocks of ",
              block_bytes, " bytes, got ", rows, " x ", stored.size(1));
  const int64_t blocks = stored.size(1) / block_bytes, values = kiln::blocks::block_values(type);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kUInt8 && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == rows * repacked_row_bytes(type, blocks * values),
              "out: contiguous uint8 of ", rows * repacked_row_bytes(type, blocks * values), " bytes");
  const uint8_t* source = stored.data_ptr<uint8_t>();
  const int64_t row_stride = stored.stride(0);
  const int64_t group_bytes = kGroupRows * kiln::blocks::block_bytes(kiln::blocks::kRepacked + type);
  uint8_t* target = out.data_ptr<uint8_t>();
  kiln::SpinPool::run(rows / kGroupRows, 1, [&](int64_t first, int64_t end) {
    for (int64_t g = first; g < end; ++g)
      for (int64_t n = 0; n < blocks; ++n) {
        Rows group;
        for (int64_t r = 0; r < kGroupRows; ++r) group[r] = source + (g * kGroupRows + r) * row_stride + n * block_bytes;
        repack_group(type, group, target + (g * blocks + n) * group_bytes);
      }
  });
  return kiln::blocks::kRepacked + type;
}
