"""KVCache: the one owner of KV pages. The pool (free list, refcounts), the prefix index (chain hash ->
page, LRU of cached pages) and every sequence's page table change only through its methods, all called
under the engine lock: attach (prefix match), ensure, commit, fork, drop (roll back), release, and
extend (pages fetched from the persistent prefix store, kiln/snapshots/prefix_store.py).

A page is free (no content), used (refcount > 0) or cached (named content, refcount 0, evictable in LRU
order). Allocation takes a free page first and evicts the least recently used cached page second. A page
is written only while exactly one sequence holds it and it is not named: named pages are full, hence
immutable and shareable (forks and prefix hits share them: copy-on-write by construction).

A `restore` sequence's global-group pages that leave its resident set go to the tiers (kiln/kv/tiers.py)
under the same key before the pool page is released; its table then references the tier page, and a
prefix match or a fork may take tier pages as well as pool pages. When no tier has room a page simply
stays resident (exact, just not bounded): K/V someone reads is never lost.

With the persistent prefix store on (`track_named`), every page the index names is logged, so the engine
copies it out in the same lock hold and the store writes it behind; `extend` puts pages that store fetched
back, named like computed ones. A named page's key holds the whole prefix under the KV format and policy
(kiln/kv/pages.py), so any named page, of any group, is restored exactly by its bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.errors import InvariantViolation
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat
from kiln.kv.image import KVImage, PageKey
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageHash, PageTable, chain_hashes
from kiln.kv.policy import KVPolicy
from kiln.kv.storage import PageStorage
from kiln.kv.tiers import PageTiers

Key = tuple[int, PageHash]  # (KV group, chain hash)


@dataclass(frozen=True)
class PoolUsage:
    used: int
    cached: int
    free: int
    evicted: int = 0  # cached pages taken for new content since the start (the prefix cache's LRU evictions)


class KVCache:
    def __init__(
        self, layout: KVLayout, num_pages: int, codec: KVCodec, device: str | torch.device, kv_format: KVFormat,
        tiers: PageTiers | None = None,
    ) -> None:
        if tiers is not None and (tiers.codec.name, tiers.codec.page_nbytes) != (codec.name, codec.page_nbytes):
            raise ValueError("the tiers must hold pages in the pool's codec: they move its bytes as they are")
        self.layout = layout
        self.tiers = tiers
        self.storage = PageStorage(layout, num_pages, codec, device)
        self.format = kv_format
        self._fingerprint = kv_format.fingerprint()
        self.refcount = [0] * num_pages
        # A stack, page 0 on top: a freed page is handed out again before any page never used, so the pool's
        # memory is committed (PageStorage maps it lazily) only up to the most pages held at once.
        self._free: list[int] = list(reversed(range(num_pages)))
        self._high_water = 0  # pages below this have been handed out at least once (their memory is committed)
        self._page_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._evicted = 0
        self._named: list[tuple[Key, int]] | None = None  # pages named since `take_named` (None: not tracked)

    # ---- the pool as a whole ------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_pages(self) -> int:
        return self.storage.num_pages

    @property
    def page_bytes(self) -> int:
        return self.storage.page_bytes

    def usage(self) -> PoolUsage:
        cached = len(self._lru)
        return PoolUsage(used=self.num_pages - len(self._free) - cached, cached=cached, free=len(self._free),
                         evicted=self._evicted)

    @property
    def committed_bytes(self) -> int:
        """Bytes of the pool that have held a page (the CPU pool's resident part): grows with the most pages
        ever in use or cached at once, up to the budget."""
        return self._high_water * self.page_bytes

    def available(self) -> int:
        """Pages an allocation could get right now (free plus evictable cached)."""
        return len(self._free) + len(self._lru)

    def cached_pages(self) -> list[int]:
        """Cached pages, the next to be evicted first."""
        return list(self._lru)

    def lookup(self, group: int, page_hash: PageHash) -> int | None:
        return self._page_of.get((group, page_hash))

    def salt(self, policy: KVPolicy) -> bytes:
        return self._fingerprint + policy.key

    # ---- sequence operations ------------------------------------------------------------------------

    def chain(self, policy: KVPolicy, tokens: Sequence[int]) -> list[PageHash]:
        """Chain hashes of the full pages a sequence over `tokens` may take without computing: every full
        page but one holding the last token (its logits are what a request samples from)."""
        return chain_hashes(tokens, self.page_size, self.salt(policy), end_page=max(0, len(tokens) - 1) // self.page_size)

    def attach(self, table: PageTable, tokens: Sequence[int]) -> int:
        """Start an empty table from the longest cached prefix of whole pages whose K/V every page the
        policy reads is cached for, leaving at least one token to compute. Takes a reference to each page;
        returns the number of tokens now computed."""
        if table.holds_pages or table.hashes:
            raise RuntimeError("attach needs an empty page table")
        hashes = self.chain(table.policy, tokens)
        count = self.reach(table.policy, hashes, 0)
        table.swept = [0] * self.layout.num_groups
        self._take(table, hashes[:count], {})
        return count * self.page_size

    def reach(self, policy: KVPolicy, hashes: Sequence[PageHash], start: int,
              also: Callable[[Key], bool] = lambda key: False) -> int:
        """How far (in pages) a table holding pages [0, start) of the chain `hashes` could be extended now,
        counting a page as there when the prefix index has it or `also` says it can be had (the persistent
        prefix store's): every global group's page up to there (for a tiered policy a tier's will do), and
        in the pool every page the policy keeps resident there."""
        tiers = self.tiers if policy.tiered else None
        unbounded = [g for g, group in enumerate(self.layout.groups) if group.window is None]

        def pooled(g: int, i: int) -> bool:
            return self.lookup(g, hashes[i]) is not None or also((g, hashes[i]))

        end = start
        while end < len(hashes) and all(pooled(g, end) or (tiers is not None and tiers.has((g, hashes[end])))
                                        for g in unbounded):
            end += 1
        checked = set(unbounded) if tiers is None and policy.name == "full" else set()  # the loop above saw them
        while end > start and not all(pooled(g, i) for g, i in self._resident(policy, end) if i >= start and g not in checked):
            end -= 1
        return end

    def extend(self, table: PageTable, hashes: Sequence[PageHash], fetched: dict[Key, torch.Tensor]) -> int:
        """Grow a table that holds whole pages only ([0, len(table.hashes)), nothing past) along its chain:
        `hashes` names the next pages. Each page comes from the prefix index (or a tier) where it is there,
        else from `fetched` (bytes the persistent prefix store returned, verified): those are written to
        new pool pages and named like computed ones. Goes as far as `reach` allows, all or nothing: when the
        pool cannot take the fetched pages now, nothing changes. Returns the pages the table holds."""
        start = len(table.hashes)
        if any(len(pages) != start for pages in table.pages):
            raise RuntimeError("extend needs a table of whole pages only")
        chain = [*table.hashes, *hashes]
        end = self.reach(table.policy, chain, start, fetched.__contains__)
        if end == start or len(self._sources(table.policy, chain, start, end)[2]) > self.available():
            return start
        self._take(table, chain[start:end], fetched)
        return end

    def missing(self, policy: KVPolicy, chain: Sequence[PageHash], start: int) -> list[Key]:
        """Keys of the pages [start, len(chain)) a table of the chain would hold that neither the pool nor a
        tier has now: what `extend` needs fetched."""
        return [(g, chain[i]) for g, i in self._sources(policy, chain, start, len(chain))[2]]

    def _take(self, table: PageTable, hashes: Sequence[PageHash], fetched: dict[Key, torch.Tensor]) -> None:
        """Append the pages `hashes` names to a table of whole pages, where `reach` found them: references to
        pool and tier pages first (so that writing fetched pages to new ones evicts none of them), then the
        fetched pages, named, in new pool pages. Pages the policy does not keep are None."""
        start = len(table.hashes)
        chain = [*table.hashes, *hashes]
        pooled, tiered, new = self._sources(table.policy, chain, start, len(chain))
        slots: list[list[int | None]] = [[None] * len(hashes) for _ in table.pages]
        for (g, i), page in pooled.items():
            self._acquire(page)
            slots[g][i - start] = page
        for g, i in tiered:
            self.tiers.acquire((g, chain[i]))  # type: ignore[union-attr]
            table.tiered[g].add(i)
        for g, i in new:
            page = self._allocate()
            self.storage.page(page).copy_(fetched[(g, chain[i])])
            self._register(g, chain[i], page, log=False)
            slots[g][i - start] = page
        for pages, added in zip(table.pages, slots, strict=True):
            pages.extend(added)
        table.hashes = chain

    def _sources(self, policy: KVPolicy, chain: Sequence[PageHash], start: int,
                 end: int) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]], list[tuple[int, int]]]:
        """Where each page index [start, end) of a table of `end` pages comes from: pool pages by (group,
        index), (group, index) pairs from a tier, and pairs to write anew. The table holds in the pool the
        pages the policy keeps resident, and under a tiered policy every global page besides, from a tier
        where the pool lacks it."""
        resident = set(self._resident(policy, end))
        global_groups = [g for g, group in enumerate(self.layout.groups) if group.window is None]
        held = resident | ({(g, i) for g in global_groups for i in range(end)} if policy.tiered else set())
        pooled, tiered, new = {}, [], []
        for g, i in sorted(pair for pair in held if pair[1] >= start):
            page = self.lookup(g, chain[i])
            if page is not None:
                pooled[(g, i)] = page
            elif (g, i) not in resident and self.tiers is not None and self.tiers.has((g, chain[i])):
                tiered.append((g, i))
            else:
                new.append((g, i))
        return pooled, tiered, new

    def pages_needed(self, table: PageTable, num_tokens: int) -> int:
        """New pages `ensure` would allocate to cover positions [0, num_tokens)."""
        total = -(-num_tokens // self.page_size)
        return sum(max(0, total - len(pages)) for pages in table.pages)

    def ensure(self, table: PageTable, num_tokens: int) -> bool:
        """Allocate pages so every group covers positions [0, num_tokens). All or nothing: on False the
        table is unchanged and the pool has what it had."""
        if self.pages_needed(table, num_tokens) > self.available():
            return False
        total = -(-num_tokens // self.page_size)
        for pages in table.pages:
            while len(pages) < total:
                pages.append(self._allocate())
        return True

    def commit(self, table: PageTable, tokens: Sequence[int], num_computed: int) -> None:
        """After K/V for tokens[:num_computed] is written: name newly full pages so others can reuse
        them, and release pages the policy no longer reads. Costs O(new pages), whatever the history."""
        done = num_computed // self.page_size
        start = len(table.hashes)
        if done > start:
            previous = table.hashes[-1] if table.hashes else b""
            new = chain_hashes(tokens, self.page_size, self.salt(table.policy), previous, start, done)
            for offset, page_hash in enumerate(new):
                for group, pages in enumerate(table.pages):
                    page = pages[start + offset]
                    if page is not None:
                        self._register(group, page_hash, page)
            table.hashes.extend(new)
        # One page of slack: `drop` may step back up to a page, and its queries must still find keys.
        self._sweep(table, max(0, num_computed - self.page_size), done)

    def fork(self, parent: PageTable, parent_computed: int, tokens: Sequence[int]) -> tuple[PageTable, int]:
        """A table for a sequence whose history is `tokens`, a prefix of the parent's: it shares the
        parent's full pages and gets a private copy of a partial last page. Returns it with the number of
        tokens it has computed. Falls back to the prefix cache when the parent holds none of the K/V or no
        longer holds pages the child must read (a window the parent moved past)."""
        ps = self.page_size
        computed = min(len(tokens), parent_computed)
        child = PageTable.empty(self.layout.num_groups, parent.policy)
        count = -(-computed // ps)
        needed = self._resident(parent.policy, count, computed)
        unbounded = [g for g, group in enumerate(self.layout.groups) if group.window is None and parent.policy.tiered]
        missing = computed == 0 or any(parent.pages[g][i] is None for g, i in needed)
        missing = missing or any(parent.pages[g][i] is None and i not in parent.tiered[g] for g in unbounded for i in range(count))
        if missing or (computed % ps and self.available() < self.layout.num_groups):
            return child, self.attach(child, tokens)
        wanted = set(needed)
        for g in range(self.layout.num_groups):
            for i in range(count):
                page = parent.pages[g][i] if (g, i) in wanted or g in unbounded else None
                if page is not None and i == computed // ps:  # the partial last page: copy on write
                    copy = self._allocate()
                    self.storage.copy_page(page, copy)
                    page = copy
                elif page is not None:
                    self._acquire(page)
                elif i in parent.tiered[g] and self.tiers is not None:
                    self.tiers.acquire((g, parent.hashes[i]))
                    child.tiered[g].add(i)
                child.pages[g].append(page)
        child.hashes = parent.hashes[: computed // ps]
        child.checked = min(parent.checked, len(child.hashes))
        child.swept = [0] * self.layout.num_groups
        return child, computed

    def drop(self, table: PageTable, keep: int) -> int:
        """Roll K/V back to the first `keep` tokens (uncommitted or speculative tokens, or a last token
        to recompute). A shared or named page is never written again, so if position keep - 1 lies in
        one, that page goes too and the result is the page boundary before it. Returns the tokens still
        computed. Stays within a page of slack of the committed horizon (see `commit`)."""
        ps = self.page_size
        full = keep // ps
        if keep % ps and any(len(pages) > full and self._shared(pages[full]) for pages in table.pages):
            keep = full * ps
        self._release_from(table, -(-keep // ps))  # before the hashes go: tier pages are named by them
        del table.hashes[keep // ps :]
        table.checked = min(table.checked, len(table.hashes))
        if any(table.pages[g][i] is None for g, i in self._resident(table.policy, len(table.pages[0]), keep)):
            raise RuntimeError(f"rollback to {keep} tokens needs pages already released")
        return keep

    def release(self, table: PageTable) -> None:
        """Give back every page, last page first: named pages stay cached for reuse, the others become
        free. Tail first, so LRU eviction takes a chain's end before its start and a released history
        stays matchable from page 0 for as long as the pool allows."""
        self._release_from(table, 0)
        table.hashes = []
        table.checked = 0
        table.swept = [0] * self.layout.num_groups

    def check(self, table: PageTable, tokens: Sequence[int], num_computed: int) -> None:
        """INV-1: the K/V held agrees with the tokens: pages for exactly what is computed, and every full
        page named by the chain hash of these tokens. Verifies the pages named since the last check and
        the last page again (O(new pages)); raises InvariantViolation."""
        ps = self.page_size
        if not 0 <= num_computed <= len(tokens):
            raise InvariantViolation("inv1", f"{num_computed} computed of {len(tokens)} tokens")
        pages = -(-num_computed // ps)
        if any(len(group) != pages for group in table.pages):
            lengths = [len(group) for group in table.pages]
            raise InvariantViolation("inv1", f"page tables {lengths} for {num_computed} computed tokens")
        if len(table.hashes) != num_computed // ps:
            raise InvariantViolation("inv1", f"{len(table.hashes)} page hashes for {num_computed} computed tokens")
        start = max(0, min(table.checked, len(table.hashes) - 1))
        previous = table.hashes[start - 1] if start else b""
        if chain_hashes(tokens, ps, self.salt(table.policy), previous, start, len(table.hashes)) != table.hashes[start:]:
            raise InvariantViolation("inv1", "page hashes do not match the token history")
        table.checked = len(table.hashes)

    # ---- images (snapshots) -------------------------------------------------------------------------

    def capture(self, table: PageTable, tokens: Sequence[int], num_computed: int, known: dict[PageKey, int]) -> KVImage:
        """A copy of an idle sequence's K/V. `known` maps (group, index) to the pool page of a full page
        the caller captured before: if the table still holds that page there, its bytes are unchanged
        (a held full page is never written) and are not copied again. A tiered policy's (`restore`)
        evicted pages live in the tiers, not the table: its image holds the history alone, and a restore
        recomputes the K/V (exactly) on the next turn."""
        if table.policy.tiered:
            return KVImage(list(tokens), 0, table.policy, [[] for _ in table.pages], {})
        full = num_computed // self.page_size
        wanted = [((g, i), page) for g, pages in enumerate(table.pages) for i, page in enumerate(pages)
                  if page is not None and not (i < full and known.get((g, i)) == page)]
        blocks = {}
        if wanted:
            rows = self.copy_out([page for _, page in wanted])
            for row, (key, _) in zip(rows, wanted, strict=True):
                if key[1] == full:  # the partial last page: nothing past the computed tokens leaves
                    self.storage.codec.clear_from(row, num_computed % self.page_size)
                blocks[key] = row
        return KVImage(list(tokens), num_computed, table.policy, [list(pages) for pages in table.pages], blocks)

    def copy_out(self, pages: Sequence[int]) -> torch.Tensor:
        """The pages' bytes in CPU memory, uint8 [len(pages), page_nbytes]: one gather (a copy per page
        costs more in calls than in bytes)."""
        ids = torch.tensor(list(pages), dtype=torch.long, device=self.storage.device)
        return self.storage.data.index_select(0, ids).to("cpu")

    def track_named(self) -> None:
        """Log every page named from now on, for `take_named` (the persistent prefix store's write-behind)."""
        self._named = []

    def take_named(self) -> list[tuple[Key, int]]:
        """The pages named since the last call that still hold what they were named for, with their keys,
        and forget them. Call under the lock hold that copies them out (`copy_out`): a page released may
        be handed out again at the next allocation."""
        named, self._named = self._named or [], [] if self._named is not None else None
        return [(key, page) for key, page in named if self._key_of.get(page) == key]

    def load(self, image: KVImage) -> PageTable | None:
        """A table holding an image's K/V in fresh pages, its full pages named for the prefix index like
        computed ones. None, with nothing allocated, when the pool cannot hold them now."""
        if len(image.blocks) > self.available():
            return None
        table = PageTable.empty(self.layout.num_groups, image.policy)
        for g, pages in enumerate(image.pages):
            for i, source in enumerate(pages):
                page = None if source is None else self._allocate()
                if page is not None:
                    self.storage.page(page).copy_(image.blocks[(g, i)])
                table.pages[g].append(page)
        hashes = chain_hashes(image.tokens, self.page_size, self.salt(image.policy), end_page=image.full_pages(self.page_size))
        for i, page_hash in enumerate(hashes):
            for g, pages in enumerate(table.pages):
                if pages[i] is not None:
                    self._register(g, page_hash, pages[i])
        table.hashes = hashes
        return table

    # ---- pages --------------------------------------------------------------------------------------

    def _resident(self, policy: KVPolicy, num_pages: int, next_position: int | None = None) -> list[tuple[int, int]]:
        """(group, page index) pairs a query at `next_position` (default: just past the pages) needs in
        the pool (for `restore`, the other pages of global groups may be in a tier instead)."""
        position = num_pages * self.page_size if next_position is None else next_position
        return [
            (g, i)
            for g, group in enumerate(self.layout.groups)
            for span in policy.resident(group.window, num_pages, position, self.page_size)
            for i in span
        ]

    def _sweep(self, table: PageTable, position: int, done: int) -> None:
        """Release full pages below `done` that no query at `position` or later reads. Only pages past
        each group's sweep mark are looked at: what a policy keeps only shrinks as positions grow. A
        `restore` table's global pages go to a tier first, or stay if no tier has room."""
        for g, group in enumerate(self.layout.groups):
            pages = table.pages[g]
            start = table.swept[g]
            tiers = self.tiers if table.policy.tiered and group.window is None else None
            for span in self._gaps(table.policy, group.window, min(done, len(pages)), position):
                for i in range(max(start, span.start), span.stop):
                    page = pages[i]
                    if page is None or (tiers is not None and not tiers.hold((g, table.hashes[i]), self.storage.page(page))):
                        continue
                    if tiers is not None:
                        table.tiered[g].add(i)
                    self._release_page(page)
                    pages[i] = None
                start = max(start, span.stop)
            table.swept[g] = start

    def _gaps(self, policy: KVPolicy, window: int | None, num_pages: int, position: int) -> list[range]:
        gaps, previous = [], 0
        for span in policy.resident(window, num_pages, position, self.page_size):
            if span.start > previous:
                gaps.append(range(previous, span.start))
            previous = max(previous, span.stop)
        if previous < num_pages:
            gaps.append(range(previous, num_pages))
        return gaps

    def _release_from(self, table: PageTable, index: int) -> None:
        for i in range(max(map(len, table.pages)) - 1, index - 1, -1):
            for g, pages in enumerate(table.pages):
                if i < len(pages):
                    page = pages.pop()
                    if page is not None:
                        self._release_page(page)
                    elif i in table.tiered[g] and self.tiers is not None:
                        table.tiered[g].discard(i)
                        self.tiers.release((g, table.hashes[i]))

    def reserve_page(self) -> int:
        """A page taken out of the pool for good, never cached, shared or released: the scratch page that decode
        graphs' padding rows write to (kiln/engine/decode_graphs.py). It counts as used."""
        return self._allocate()

    def _shared(self, page: int | None) -> bool:
        return page is not None and (self.refcount[page] > 1 or page in self._key_of)

    def _allocate(self) -> int:
        if self._free:
            page = self._free.pop()
            self._high_water = max(self._high_water, page + 1)
        else:
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self._evicted += 1
        self.refcount[page] = 1
        return page

    def _acquire(self, page: int) -> None:
        if self.refcount[page] == 0:
            self._lru.pop(page, None)
        self.refcount[page] += 1

    def _release_page(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} released more times than acquired")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._key_of:
                self._lru[page] = None
            else:
                self._free.append(page)

    def _register(self, group: int, page_hash: PageHash, page: int, log: bool = True) -> None:
        """Name a freshly filled page (logged for `take_named` unless its bytes came from the prefix store).
        If another page already holds that content, the first stays the canonical one and this page
        remains unnamed (it is freed, not cached, when released)."""
        key = (group, page_hash)
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key
            if log and self._named is not None:
                self._named.append((key, page))
