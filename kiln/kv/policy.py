"""KVPolicy: which pages of a sequence attention reads, hence which pages it must keep resident.

A policy is chosen per sequence. It answers, for a KV group and the next position a query may be at,
which page indices are still readable; every other page of the group can go back to the pool. Ranges
rather than a prefix, so a global group can keep sink pages and a recent window that are not one
contiguous span. Policies that change what attention reads also change the K/V later layers compute,
so a policy's `key` is part of the page-chain salt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVPolicy:
    """`full`: every layer reads every earlier key its attention allows (exact). Sliding-window layers
    read only the window, so their older pages are released whatever the policy."""

    name: str = "full"

    @property
    def key(self) -> bytes:
        return self.name.encode()

    def readable(self, window: int | None, num_pages: int, next_position: int, page_size: int) -> list[range]:
        """Page indices (below `num_pages`) a query at `next_position` or later may read, in order."""
        if window is None:
            return [range(0, num_pages)]
        return [range(min(num_pages, max(0, next_position - window + 1) // page_size), num_pages)]


FULL = KVPolicy()
