// The instruction-set choice isa.h declares.
#include "isa.h"

#include <torch/extension.h>

#include <atomic>

namespace kiln {

namespace {

Isa best() { return cpu_has(Isa::kAvx512Vnni) ? Isa::kAvx512Vnni : Isa::kAvx2; }

std::atomic<Isa>& current() {
  static std::atomic<Isa> isa{best()};
  return isa;
}

}  // namespace

bool cpu_has(Isa isa) {
  if (isa == Isa::kAvx2) return true;  // the library's floor: build.py, and kernels/__init__.py's check
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

Isa active_isa() { return current().load(std::memory_order_relaxed); }

std::string isa_name(Isa isa) { return isa == Isa::kAvx2 ? "avx2" : "avx512_vnni"; }

std::string use_isa(const std::string& name) {
  TORCH_CHECK(name == "avx2" || name == "avx512_vnni", "unknown instruction set ", name, "; known: avx2, avx512_vnni");
  const Isa wanted = name == "avx2" ? Isa::kAvx2 : Isa::kAvx512Vnni;
  TORCH_CHECK(cpu_has(wanted), "this CPU lacks ", name);
  return isa_name(current().exchange(wanted));
}

}  // namespace kiln
