"""PageStorage: the memory every KV page lives in, in its codec's format (kiln/kv/codec.py).

Page p is one contiguous block of `codec.page_nbytes` bytes: all the K/V one KV group keeps for
page_size positions, encoded. Contiguous per page so a page can be hashed, written to disk, moved to
another tier or snapshotted as one piece of memory, without re-encoding. Models never see this tensor:
they write and read through a KVStep (kiln/kv/step.py), which goes through the methods here.

The pool is reserved whole (kv_budget_bytes) but committed as it is used: on the CPU its memory is an
anonymous mapping, zero-filled by the OS and backed only once a page is first written, and KVCache hands
out the lowest free page first, so the resident part is the high-water mark of pages used (and cached),
not the budget (docs/architecture.md § Memory).
"""

from __future__ import annotations

import mmap
import sys

import torch

from kiln.kernels import kernels
from kiln.kv.codec import KVCodec, Segment
from kiln.kv.layout import KVLayout
from kiln.platform import Platform

# Python 3.11's mmap lacks the constant; 0x4000 is Linux's value on x86-64 and arm64. Elsewhere the OS does
# not charge an untouched private mapping anyway.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


class PageStorage:
    def __init__(self, layout: KVLayout, num_pages: int, codec: KVCodec, device: str | torch.device) -> None:
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        self.layout = layout
        self.codec = codec
        self.layer_slots = layout.layer_slots()  # (group, slot) of each model layer, read by every step
        self.num_pages = num_pages
        self.data = zeroed_pool(num_pages, codec.page_nbytes, torch.device(device))
        # Views of each slot's K and V segments across the pool, built once: every layer of every step uses them.
        self._segments = [(codec.segment(self.data, 0, s), codec.segment(self.data, 1, s)) for s in range(layout.slots)]
        self._kernel_parts = [(*k.kernel_parts(), *v.kernel_parts()) for k, v in self._segments]
        # New rows are stored (and encoded) by the C++ kernel where it runs: the same bytes as the codec's torch
        # path, without its handful (raw) or score (coded) of small operations per layer. Attention reads them in
        # place there too (Runner.kernel_attention).
        self.kernel_pages = Platform.of(self.data.device).kernel_pages(codec.read_dtype)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def read_dtype(self) -> torch.dtype:
        """The dtype `read` decodes pages to."""
        return self.codec.read_dtype

    @property
    def page_bytes(self) -> int:
        return self.codec.page_nbytes

    def page(self, page: int) -> torch.Tensor:
        """The page's bytes, uint8 [page_nbytes] (a view: writes go to the page)."""
        return self.data[page]

    def copy_page(self, source: int, target: int) -> None:
        self.data[target].copy_(self.data[source])

    def segments(self, slot: int) -> tuple[Segment, Segment]:
        """K and V of one slot across all pages, as the codec's typed views (strided)."""
        return self._segments[slot]

    def kernel_parts(self, slot: int) -> tuple[torch.Tensor, ...]:
        """K's then V's codes, scales and zeros of one slot across the pool, as the C++ kernels take them."""
        return self._kernel_parts[slot]

    def write(self, slot: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode new K/V rows [N, kv_heads, head_dim] of one slot into (pages[i], offsets[i])."""
        for kind, (segment, x) in enumerate(zip(self._segments[slot], (k, v), strict=True)):
            if self.kernel_pages:
                kernels().store_kv(x.float().contiguous(), *segment.kernel_parts(), pages, offsets)
            else:
                self.codec.store(segment, kind, (pages, offsets), x)

    def read(self, slot: int, ids: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """K and V of one slot of pages `ids`, decoded into out (each [len(ids), page_size, kv_heads, head_dim])."""
        for segment, buffer in zip(self._segments[slot], out, strict=True):
            self.codec.load(segment, ids, buffer)


def zeroed_pool(num_pages: int, page_nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [num_pages, page_nbytes] of zeros. On the CPU, an anonymous mapping: the OS backs a page of it
    with memory only when it is first written, so an unused tail of the pool costs address space, not RSS
    (torch.zeros would write, and so commit, every byte at start). Mapped MAP_NORESERVE: Linux's overcommit
    heuristic counts every accounted mapping again when the process forks, so pools reserved past the
    machine's memory (however little of them is used) made every fork fail with ENOMEM (a subprocess with a
    preexec_fn, Ray starting its processes)."""
    if not Platform.of(device).on_host:
        return torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=device)
    region = mmap.mmap(-1, num_pages * page_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(region, dtype=torch.uint8).view(num_pages, page_nbytes)
