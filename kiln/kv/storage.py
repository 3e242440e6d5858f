"""PageStorage: the preallocated memory every KV page lives in.

Page p is one contiguous block `[2 (K, V), slots, page_size, kv_heads, head_dim]`: all the K/V one KV
group keeps for page_size positions. Contiguous per page so a page can be hashed, written to disk,
moved to another tier or encoded as one piece of memory. Models never see this tensor: they write and
read through a KVStep (kiln/kv/step.py), which knows this layout.
"""

from __future__ import annotations

import torch

from kiln.kv.layout import KVLayout


class PageStorage:
    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, device: str | torch.device) -> None:
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        self.layout = layout
        self.layer_slots = layout.layer_slots()  # (group, slot) of each model layer, read by every step
        self.num_pages = num_pages
        self.data = torch.zeros(
            (num_pages, 2, layout.slots, layout.page_size, layout.num_kv_heads, layout.head_dim), dtype=dtype, device=device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def page(self, page: int) -> torch.Tensor:
        """The page's block, [2, slots, page_size, kv_heads, head_dim] (a view: writes go to the page)."""
        return self.data[page]

    def copy_page(self, source: int, target: int) -> None:
        self.data[target].copy_(self.data[source])

    def rows(self) -> torch.Tensor:
        """[num_pages * 2 * slots * page_size, kv_heads, head_dim]: one row per (page, K/V, slot, offset)."""
        return self.data.view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def row_base(self, page: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Row in `rows()` of slot 0's K at (page, offset); slot s adds s * page_size, V adds
        slots * page_size."""
        return page * (2 * self.layout.slots * self.layout.page_size) + offset

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one slot across all pages, each [num_pages, page_size, kv_heads, head_dim] (strided)."""
        return self.data[:, 0, slot], self.data[:, 1, slot]
