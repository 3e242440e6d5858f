"""KVImage: a sequence's K/V lifted out of the page pool (to snapshot it) or on its way back in.

Pages are copied as whole PageStorage blocks (a page's bytes in the pool's codec), so a page leaves
and returns byte for byte. Positions of a partial last page past the computed tokens are zeroed
in the copy: a recycled page may still hold another sequence's K/V there, which must not leave with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kv.policy import KVPolicy

PageKey = tuple[int, int]  # (KV group, page index in the sequence)


@dataclass
class KVImage:
    """tokens[:num_computed] have K/V in the pages. `pages[g][i]` is None where the sequence no longer
    held a page (a window group released it), else the pool page the K/V came from (on capture; any
    page number on load). `blocks` holds a CPU copy of each held page's bytes, except on capture the
    full pages the caller said it already had."""

    tokens: list[int]
    num_computed: int
    policy: KVPolicy
    pages: list[list[int | None]]
    blocks: dict[PageKey, torch.Tensor]

    def full_pages(self, page_size: int) -> int:
        """Pages (per group) whose every position is computed: immutable while the sequence holds them."""
        return self.num_computed // page_size
