"""KVCache: page tables of sequences over one PagePool, with prefix reuse and sliding-window release.

The scheduler is the only caller that changes pages (DESIGN.md § Data flow). Every method keeps two
facts true: a sequence's full pages are named by the chain hash of its tokens, and a page is written
only while exactly one sequence holds it (shared pages are full, hence immutable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageHash, PageTable, chain_hashes
from kiln.kv.pool import PagePool


@dataclass
class PrefixMatch:
    """Cached pages that give the K/V of the first `num_tokens` tokens, per group (None = not needed)."""

    num_tokens: int
    pages: list[list[int | None]]
    hashes: list[PageHash]


class KVCache:
    def __init__(
        self, layout: KVLayout, num_pages: int, dtype: torch.dtype, device: str | torch.device, salt: bytes
    ) -> None:
        self.layout = layout
        self.pool = PagePool(layout, num_pages, dtype, device)
        self.salt = salt

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def first_needed_page(self, group: int, next_position: int) -> int:
        """First page a query at `next_position` (or later) may read in this group."""
        window = self.layout.groups[group].window
        if window is None:
            return 0
        return max(0, next_position - window + 1) // self.page_size

    def match(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of whole pages whose K/V every layer has, leaving at least one token
        to compute (its logits are what a request samples from)."""
        hashes = chain_hashes(tokens[: max(0, len(tokens) - 1)], self.page_size, self.salt)
        index = self.pool.prefix
        full = [g for g, group in enumerate(self.layout.groups) if group.window is None]
        count = 0
        while count < len(hashes) and all(index.lookup(g, hashes[count]) is not None for g in full):
            count += 1
        while count > 0 and not self._windows_cached(hashes, count):
            count -= 1
        pages = [
            [
                index.lookup(g, hashes[i]) if i >= self.first_needed_page(g, count * self.page_size) else None
                for i in range(count)
            ]
            for g in range(self.layout.num_groups)
        ]
        return PrefixMatch(count * self.page_size, pages, hashes[:count])

    def _windows_cached(self, hashes: list[PageHash], count: int) -> bool:
        index = self.pool.prefix
        return all(
            index.lookup(g, hashes[i]) is not None
            for g in range(self.layout.num_groups)
            for i in range(self.first_needed_page(g, count * self.page_size), count)
        )

    def attach(self, table: PageTable, match: PrefixMatch) -> None:
        """Start an empty page table from a prefix match, taking a reference to each page."""
        if table.resident() or table.hashes:
            raise RuntimeError("attach needs an empty page table")
        for group, pages in enumerate(match.pages):
            for page in pages:
                if page is not None:
                    self.pool.acquire(page)
            table.pages[group] = list(pages)
        table.hashes = list(match.hashes)

    def pages_needed(self, table: PageTable, num_tokens: int) -> int:
        """New pages `ensure` would allocate to cover positions [0, num_tokens)."""
        total = -(-num_tokens // self.page_size)
        return sum(max(0, total - len(pages)) for pages in table.pages)

    def ensure(self, table: PageTable, num_tokens: int) -> bool:
        """Allocate pages so every group covers positions [0, num_tokens). All or nothing: on False the
        table is unchanged and the pool has what it had."""
        total = -(-num_tokens // self.page_size)
        taken: list[tuple[int, int]] = []
        for group, pages in enumerate(table.pages):
            for _ in range(total - len(pages)):
                page = self.pool.allocate()
                if page is None:
                    for g, p in reversed(taken):
                        table.pages[g].pop()
                        self.pool.release(p)
                    return False
                pages.append(page)
                taken.append((group, page))
        return True

    def commit(self, table: PageTable, tokens: list[int], num_computed: int) -> None:
        """After K/V for tokens[:num_computed] is written: name newly full pages so others can reuse
        them, and release pages no later query of this sequence can read (sliding-window groups)."""
        done = num_computed // self.page_size
        if done > len(table.hashes):
            previous = table.hashes[-1] if table.hashes else b""
            new = chain_hashes(tokens[: done * self.page_size], self.page_size, self.salt, previous, len(table.hashes))
            for offset, page_hash in enumerate(new):
                for group, pages in enumerate(table.pages):
                    page = pages[len(table.hashes) + offset]
                    if page is not None:
                        self.pool.prefix.register(group, page_hash, page)
            table.hashes.extend(new)
        # One page of slack: `rewind` may step back up to a page, and its queries must still find keys.
        horizon = max(0, num_computed - self.page_size)
        for group, pages in enumerate(table.pages):
            for i in range(table.first_resident(group), min(self.first_needed_page(group, horizon), done)):
                self.pool.release(pages[i])
                pages[i] = None

    def rewind(self, table: PageTable, num_computed: int) -> int:
        """Make at least one token uncomputed again (a request needs a last token to take logits from,
        e.g. after a generation was cancelled right after its final forward). Returns the new computed
        count. A full last page may be shared, so it is released and recomputed into a private page
        rather than rewritten."""
        keep = num_computed - 1
        full = keep // self.page_size
        if len(table.hashes) > full:
            del table.hashes[full:]
            self.truncate(table, full * self.page_size)
            return full * self.page_size
        return keep

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        """Drop pages past position num_tokens - 1 (pages allocated for a step that did not run)."""
        keep = -(-num_tokens // self.page_size)
        for pages in table.pages:
            while len(pages) > keep:
                page = pages.pop()
                if page is not None:
                    self.pool.release(page)

    def release(self, table: PageTable) -> None:
        """Give back every page of a sequence: named pages stay cached for reuse, others become free."""
        for page in table.resident():
            self.pool.release(page)
        table.pages = [[] for _ in table.pages]
        table.hashes = []

    def resident_bytes(self, table: PageTable) -> int:
        return len(table.resident()) * self.pool.page_bytes
