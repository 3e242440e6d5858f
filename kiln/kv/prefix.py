"""Prefix index: which page holds the K/V of a given token-chain hash, per KV group, and the LRU order
of cached pages (full pages no sequence references, kept for reuse until the pool needs the room)."""

from __future__ import annotations

from collections import OrderedDict

from kiln.kv.pages import PageHash

Key = tuple[int, PageHash]  # (KV group, chain hash)


class PrefixIndex:
    def __init__(self) -> None:
        self._page_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first

    def lookup(self, group: int, page_hash: PageHash) -> int | None:
        return self._page_of.get((group, page_hash))

    def register(self, group: int, page_hash: PageHash, page: int) -> None:
        """Name a freshly filled page. If another page already holds that content, the first stays the
        canonical one and this page remains unnamed (it is freed, not cached, when released)."""
        key = (group, page_hash)
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def is_named(self, page: int) -> bool:
        return page in self._key_of

    def cache(self, page: int) -> None:
        """The page's last reference went away: keep it for reuse, most recently used last."""
        self._lru[page] = None

    def touch(self, page: int) -> None:
        """The page is referenced again: it is no longer a candidate for eviction."""
        self._lru.pop(page, None)

    def evict_oldest(self) -> int | None:
        """Forget the least recently used cached page and return it, or None when nothing is cached."""
        if not self._lru:
            return None
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page

    def lru_order(self) -> list[int]:
        return list(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)
