"""PagePool: the preallocated K/V page tensors and the life of each page.

A page is free (no content), used (refcount > 0) or cached (named content, refcount 0, evictable in LRU
order). Allocation takes a free page first and evicts the least recently used cached page second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from kiln.kv.layout import KVLayout
from kiln.kv.prefix import PrefixIndex


@dataclass(frozen=True)
class PoolUsage:
    used: int
    cached: int
    free: int


class PagePool:
    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, device: str | torch.device) -> None:
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        shape = (layout.slots, num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim)
        self.layout = layout
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.prefix = PrefixIndex()
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    def allocate(self) -> int | None:
        """A page with refcount 1, or None when every page is in use."""
        page = self._free.popleft() if self._free else self.prefix.evict_oldest()
        if page is not None:
            self.refcount[page] = 1
        return page

    def acquire(self, page: int) -> None:
        """Take one more reference to a page that is used or cached (a prefix hit or a shared page)."""
        if self.refcount[page] == 0:
            self.prefix.touch(page)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} released more times than acquired")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.prefix.is_named(page):
                self.prefix.cache(page)
            else:
                self._free.append(page)

    def available(self) -> int:
        """Pages an allocation could get right now (free plus evictable cached)."""
        return len(self._free) + self.prefix.num_cached

    def usage(self) -> PoolUsage:
        cached = self.prefix.num_cached
        return PoolUsage(used=self.num_pages - len(self._free) - cached, cached=cached, free=len(self._free))

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes(self.k.element_size())
