// block_dot.h for CPUs with AVX-512 VNNI: the same code compiled for that target, called only where
// cpuid reports it (isa.h). Everything included before the target pragma keeps the build's AVX2 target, so
// no inline function shared with other files is ever emitted with AVX-512 instructions.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "blocks.h"
#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define KILN_BLOCKS_NS blocks_avx512
#define KILN_BLOCKS_VNNI 1
#include "block_dot.h"
#pragma GCC pop_options
