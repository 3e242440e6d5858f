"""Per-sequence page tables and the token-chain hashes that name full pages.

A full page's identity is h_i = H(h_{i-1}, salt, tokens of page i): equal hashes mean equal token
prefixes under the same KV format and policy (the salt), hence equal K/V, so such pages can be shared.
Hashing is incremental: a step hashes only the pages it filled, so its cost never grows with history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kiln.kv.policy import FULL, KVPolicy

PageHash = bytes


def chain_hashes(
    tokens: Sequence[int], page_size: int, salt: bytes, previous: PageHash = b"", start_page: int = 0, end_page: int | None = None
) -> list[PageHash]:
    """Hashes of full pages start_page .. end_page - 1 of `tokens` (default: every full page), chained
    from `previous` (the hash of page start_page - 1, or b"" at the start of a sequence)."""
    last = len(tokens) // page_size if end_page is None else end_page
    hashes = []
    for index in range(start_page, last):
        page = np.asarray(tokens[index * page_size : (index + 1) * page_size], dtype=np.int64)
        previous = hashlib.sha256(previous + salt + page.tobytes()).digest()[:16]
        hashes.append(previous)
    return hashes


@dataclass(eq=False)
class PageTable:
    """The pages one sequence holds, per KV group, in position order. Only KVCache changes it.

    pages[g][i] holds positions [i * page_size, (i + 1) * page_size) for group g, or None once the
    sequence's policy no longer keeps it resident and it went back to the pool; for a `restore` policy
    `tiered[g]` holds the indices of such pages whose K/V a tier keeps under (g, hashes[i]) (referenced
    by this table, released with it). `hashes[i]` names full
    page i (the same for every group: it hashes tokens, not K/V). `checked` counts the hashes INV-1 has
    verified and `swept[g]` the pages of group g already considered for release, so each step only
    looks at pages it changed.
    """

    pages: list[list[int | None]]
    policy: KVPolicy = FULL
    hashes: list[PageHash] = field(default_factory=list)
    checked: int = 0
    swept: list[int] = field(default_factory=list)
    tiered: list[set[int]] = field(default_factory=list)

    @classmethod
    def empty(cls, num_groups: int, policy: KVPolicy = FULL) -> PageTable:
        return cls([[] for _ in range(num_groups)], policy, swept=[0] * num_groups, tiered=[set() for _ in range(num_groups)])

    def resident(self) -> list[int]:
        return [page for table in self.pages for page in table if page is not None]

    @property
    def holds_pages(self) -> bool:
        return any(page is not None for table in self.pages for page in table)
