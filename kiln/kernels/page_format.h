// The KV page byte format as the kernels know it (kv_store.cpp writes it, attention.cpp reads it), defined
// once for C++. Python's twin is page_format.py beside it; the extension exports these values (bindings.cpp,
// `page_format`) and tests/kernels/test_page_format.py checks that the two agree.
//
// A coded (token, head) row: codes, then one float16 scale per group of channels (and one float16 zero
// point for 4-bit codes). 8-bit codes are symmetric, value = code * scale, code in [-kInt8Max, kInt8Max];
// 4-bit codes are asymmetric, value = code * scale + zero, code in [0, kInt4Max], two a byte with the even
// channel in the low nibble. A scale never goes below kTinyScale, so an all-zero group encodes to zeros.
#pragma once

#include <cstdint>

namespace kiln::page_format {

constexpr float kTinyScale = 5.9604645e-08f;  // 2^-24, the smallest float16 above zero
constexpr int kInt8Max = 127;                 // 8-bit codes: [-127, 127]
constexpr int kInt4Max = 15;                  // 4-bit codes: [0, 15]
// Attention cuts a query's keys at multiples of this position (attention.cpp says why); a page must not
// straddle a cut, so page sizes divide it.
constexpr int64_t kChunkTokens = 256;
constexpr int64_t kMaxPageTokens = 256;  // tokens per page, at most (the kernels' per-page buffers)

}  // namespace kiln::page_format
