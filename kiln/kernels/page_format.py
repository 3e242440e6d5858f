"""The KV page byte format's constants, defined once for Python. C++'s twin is page_format.h beside this file;
the extension exports its values and tests/kernels/test_page_format.py checks that the two agree.

They live with the kernels, the lowest layer (docs/architecture.md § Layers), because every layer above
shares them: the KV cache encodes, decodes and stores pages by them (kiln/kv/codec.py, storage.py, step.py),
the models' attention cuts keys at CHUNK_TOKENS as the kernels do, and EngineConfig takes only PAGE_SIZES.

A coded (token, head) row is its codes followed by one float16 scale per group of GROUP channels (and one
float16 zero point for 4-bit codes). 8-bit codes are symmetric (value = code * scale, |code| <= INT8_MAX);
4-bit codes asymmetric (value = code * scale + zero, 0 <= code <= INT4_MAX), two a byte with the even
channel in the low nibble. Scales never go below TINY_SCALE, so an all-zero group encodes to zeros, not NaN.
"""

from __future__ import annotations

import torch

GROUP = 32  # channels one scale covers (KIVI's group size); gcd(head_dim, GROUP) where head_dim is not a multiple
TINY_SCALE = 2.0**-24  # the smallest float16 above zero
INT8_MAX = 127
INT4_MAX = 15
# Attention kernels cut a query's keys at multiples of CHUNK_TOKENS positions (kernels/attention.cpp keeps a
# partial softmax state per row per chunk); a page never straddles a cut, so a page size divides it.
CHUNK_TOKENS = 256
MAX_PAGE_TOKENS = 256
PAGE_SIZES = tuple(size for size in range(1, MAX_PAGE_TOKENS + 1) if CHUNK_TOKENS % size == 0)
# Raw (uncoded) pages the kernels read and write in place (kv_store.cpp, attention.cpp); coded pages decode
# to float32.
KERNEL_DTYPES = (torch.float32, torch.float16)
