// block_dot.h for every AVX2 CPU (the build's own target flags).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "blocks.h"
#include "vec_math.h"

#define KILN_BLOCKS_NS blocks_avx2
#define KILN_BLOCKS_VNNI 0
#include "block_dot.h"
