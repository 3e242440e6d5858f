// Checks of the index tensors kernels take (page ids, rows' sequences and positions): a kernel indexes memory
// with these, so every value it will use is checked first, and a bad one is a TORCH_CHECK failure (an
// InvariantViolation in Python, bindings.cpp) instead of a read or write out of bounds.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace kiln {

// `t` as a contiguous int64 tensor, after checking that it holds integers and has `dim` dimensions.
inline torch::Tensor index_tensor(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && c10::isIntegralType(t.scalar_type(), /*includeBool=*/false) && t.dim() == dim, name,
              ": expected a ", dim, "-D integer CPU tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  return t.to(torch::kLong).contiguous();
}

// Every one of values[0, count) in [low, high).
inline void check_range(const int64_t* values, int64_t count, int64_t low, int64_t high, const char* name) {
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(values[i] >= low && values[i] < high, name, "[", i, "] = ", values[i], " lies outside [", low, ", ", high, ")");
}

}  // namespace kiln
