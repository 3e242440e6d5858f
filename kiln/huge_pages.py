"""huge_page_buffer: memory for weights that are read whole every step, backed by 2 MiB pages where the OS
gives them.

Why: a decode step streams every weight once, and at 4 KiB a page the streaming kernels spend part of
their time on TLB misses. The embedded model's LM head (178 MB of Q8_0 blocks) read at 24-27 GB/s from
4 KiB pages and at 31-34 GB/s from 2 MiB ones on the 2-core reference machine, about a tenth of a decode
step (bench/README.md § Design figures). Linux backs a private anonymous mapping with huge pages only
where it was advised to (transparent_hugepage "madvise", the common default) and only on 2 MiB-aligned
extents, so the buffer starts on such a boundary and only the extents it fills whole are advised: its
tail stays on small pages, and no huge page is committed beyond the buffer's end.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled, writable uint8 [nbytes] tensor on its own anonymous mapping, starting on a 2 MiB
    boundary with its whole 2 MiB extents advised for huge pages. Where the OS has no huge pages to advise
    (not Linux, or a kernel without them), the same buffer on its small pages."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None and nbytes >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # EINVAL: a kernel without transparent huge pages; small pages then
            region.madvise(advise, start, nbytes - nbytes % HUGE_PAGE)
    return whole[start : start + nbytes]
