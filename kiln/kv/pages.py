"""Per-sequence page tables and the token-chain hashes that name full pages.

A full page's identity is h_i = H(h_{i-1}, salt, tokens of page i): equal hashes mean equal token
prefixes under the same model and policy (the salt), hence equal K/V, so such pages can be shared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

PageHash = bytes


def chain_hashes(
    tokens: list[int], page_size: int, salt: bytes, previous: PageHash = b"", start_page: int = 0
) -> list[PageHash]:
    """Hashes of the full pages of `tokens` from page `start_page` on, chained from `previous`
    (the hash of page start_page - 1, or b"" at the start of a sequence)."""
    hashes = []
    for start in range(start_page * page_size, len(tokens) - page_size + 1, page_size):
        page = np.fromiter(islice(tokens, start, start + page_size), dtype=np.int64, count=page_size)
        previous = hashlib.sha256(previous + salt + page.tobytes()).digest()[:16]
        hashes.append(previous)
    return hashes


@dataclass
class PageTable:
    """The pages one sequence holds, per KV group, in position order.

    pages[g][i] holds positions [i * page_size, (i + 1) * page_size) for group g, or None once the
    group's sliding window has moved past it and it was released. `hashes[i]` names full page i (the
    same for every group: it hashes tokens, not K/V).
    """

    pages: list[list[int | None]]
    hashes: list[PageHash] = field(default_factory=list)

    @classmethod
    def empty(cls, num_groups: int) -> PageTable:
        return cls([[] for _ in range(num_groups)])

    def first_resident(self, group: int) -> int:
        """Index of the group's first page still held (released pages form a prefix)."""
        table = self.pages[group]
        index = 0
        while index < len(table) and table[index] is None:
            index += 1
        return index

    def resident(self) -> list[int]:
        return [page for table in self.pages for page in table if page is not None]
