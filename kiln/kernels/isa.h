// Which of the kernels' instruction-set paths runs: chosen once from cpuid when the library loads, and
// switchable for tests (an AVX-512 host runs the AVX2 path when told to).
//
// One library serves every x86-64 CPU with AVX2: the whole build targets AVX2 (build.py), and the functions
// that gain from AVX-512 are compiled for it in translation units of their own, called only when the CPU
// has it: the block formats' dot products (blocks_avx512.cpp: VNNI, one instruction for a multiply-add of
// four byte pairs into an int32, where AVX2 needs three) and attention's inner tiles (attention_avx512.cpp:
// 16 float lanes and 32 registers). Both paths give the same results: integer sums are exact, and the float
// work is the same operations in the same order on every lane.
#pragma once

#include <string>

namespace kiln {

enum class Isa { kAvx2, kAvx512Vnni };

// The path kernels take now.
Isa active_isa();
// Whether this CPU runs `isa` (AVX-512 VNNI: AVX512F, BW, VL and VNNI all present).
bool cpu_has(Isa isa);
std::string isa_name(Isa isa);
// Takes the path named "avx2" or "avx512_vnni" from now on (process-wide); returns the previous one's name.
// A path the CPU lacks is a TORCH_CHECK failure.
std::string use_isa(const std::string& name);

}  // namespace kiln
