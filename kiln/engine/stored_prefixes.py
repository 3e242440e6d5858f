"""StoredPrefixes: the engine's side of the persistent prefix store (kiln/snapshots/prefix_store.py;
docs/architecture.md § The persistent prefix store). The engine sits below persistence, so it is handed
a `PageStore` and knows nothing of the snapshot store behind it.

- Write-behind: every page the pool's prefix index names is copied out in the lock hold that named it and
  offered to the store, which writes it on its own thread (a page it holds already is only touched).
- Fetch at admission: when the pool's prefix index stops short of a prompt's full pages and the store holds
  the chain further, the fetch starts on a background thread and the request waits out of the steps (the
  others run) until its pages arrive or until the time recomputing them would take has passed
  (`RestoreCosts`). Then it is admitted and computes only what it still lacks. A fetch that lands during
  the prefill that followed still helps: between steps the request jumps to the fetched pages' end. So
  a request whose fetch is slow, fails (the store unreachable, a blob missing or corrupt: verified by
  digest) or cannot be taken (a pool too full) recomputes, having waited at most the recompute's time.
- A session whose K/V was dropped for room takes the same path at its next turn: its pages were named
  and written behind like any others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.engine.sequence import Request
from kiln.engine.stats import EngineStats
from kiln.errors import KilnError
from kiln.kv.cache import Key, KVCache
from kiln.kv.pages import PageHash

logger = logging.getLogger(__name__)
# Costs until this engine has measured its own, the embedded Gemma 3 270M's on 2 cores: one KV group's
# page (48 KiB) read from a directory store and verified in 0.06-0.12 ms (bench/results/prefix_store.json);
# a prompt token prefilled in 0.86 ms on the quiet machine (bench/results/snapshot.json; 4-6 ms under the
# load prefix_store.json ran in). The lower figure keeps a request's wait for its fetch the shorter.
FETCH_PAGE_S = 0.0001
COMPUTE_TOKEN_S = 0.0009
# Page positions worth a fetch: one already pays. A fetch of one position (its six groups' pages) took
# 0.5-1.6 ms, its own overhead included, against 14 ms (quiet) to 90 ms (loaded) to compute its 16 tokens.
MIN_FETCH_PAGES = 1
SMOOTHING = 0.2  # weight of a new measurement in the moving averages
MEASURED_STEP_TOKENS = 64  # a step computing fewer rows says little about prefill's cost per token


class PageStore(Protocol):
    """What the engine asks of the persistent prefix store. Every call is quick and never blocks on the
    store's medium, except `fetch`, which runs on the fetch thread."""

    def stored(self, keys: Iterable[Key]) -> set[Key]:
        """The keys among `keys` the store holds a page for."""

    def touch(self, keys: Iterable[Key]) -> None:
        """The pages were used now (the store evicts the least recently used first)."""

    def offer(self, pages: list[tuple[Key, torch.Tensor]]) -> None:
        """Write these pages' bytes (uint8 [page_nbytes] each, named by key) behind; may drop them."""

    def fetch(self, keys: Sequence[Key]) -> dict[Key, torch.Tensor]:
        """The pages' bytes, each verified against its digest; pages that are missing or fail are left out
        (and counted by the store). Raises a KilnError when the store cannot be read."""


@dataclass
class RestoreCosts:
    """What restoring costs against recomputing, on this engine: moving averages of seconds per page
    fetched (one KV group's page, fetched, verified and installed) and per prompt token computed."""

    fetch_page_s: float = FETCH_PAGE_S
    compute_token_s: float = COMPUTE_TOKEN_S

    def worth(self, pages: int, tokens: int) -> bool:
        """Whether fetching `pages` pages should beat computing the `tokens` tokens they hold."""
        return pages * self.fetch_page_s < tokens * self.compute_token_s

    def patience_s(self, tokens: int) -> float:
        """How long a request waits for its fetch: what computing its `tokens` would take."""
        return tokens * self.compute_token_s

    def observe_fetch(self, seconds: float, pages: int) -> None:
        if pages:
            self.fetch_page_s += SMOOTHING * (seconds / pages - self.fetch_page_s)

    def observe_step(self, seconds: float, tokens: int) -> None:
        if tokens >= MEASURED_STEP_TOKENS:
            self.compute_token_s += SMOOTHING * (seconds / tokens - self.compute_token_s)


@dataclass(eq=False)
class _Fetch:
    chain: list[PageHash]  # the prompt's chain hashes up to the fetched pages' end
    keys: list[Key]
    until: float  # time.monotonic() after which the request stops waiting for it
    future: Future[dict[Key, torch.Tensor]]
    late: bool = False  # counted as late (the request was admitted without its pages)


class StoredPrefixes:
    """Called under the engine lock (the fetch thread touches only the store and `costs`)."""

    def __init__(self, cache: KVCache, store: PageStore, stats: EngineStats, wake: Callable[[], None]) -> None:
        self.cache = cache
        self.store = store
        self.stats = stats
        self.costs = RestoreCosts()
        self._wake = wake  # tells the engine loop a fetch ended
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kiln-prefix-fetch")
        self._fetches: dict[Request, _Fetch] = {}
        cache.track_named()

    # ---- write-behind -------------------------------------------------------------------------------

    def write_behind(self) -> None:
        """Offer the pages named since the last call (under the lock hold that named them)."""
        named = self.cache.take_named()
        if not named:
            return
        stored = self.store.stored(key for key, _ in named)
        self.store.touch(stored)
        fresh = [(key, page) for key, page in named if key not in stored]
        if fresh:
            rows = self.cache.copy_out([page for _, page in fresh])
            self.store.offer([(key, row) for (key, _), row in zip(fresh, rows, strict=True)])

    # ---- fetches ------------------------------------------------------------------------------------

    def begin(self, request: Request) -> bool:
        """Before a request with no K/V attaches: start fetching what the store holds of its prompt past
        the pool's prefix, when that should beat computing it. True if a fetch started (the request waits
        for it, `waiting`). Once per request."""
        seq = request.seq
        if request.fetch_tried or seq.num_computed or seq.table.holds_pages:
            return False
        request.fetch_tried = True
        policy, groups = seq.table.policy, range(self.cache.layout.num_groups)
        chain = self.cache.chain(policy, seq.tokens)
        start = self.cache.reach(policy, chain, 0)
        self.store.touch((g, h) for h in chain[:start] for g in groups)  # a hit in memory keeps them in the store
        if start == len(chain):
            return False
        stored = self.store.stored((g, h) for h in chain[start:] for g in groups)
        end = self.cache.reach(policy, chain, start, stored.__contains__)
        keys = [key for key in self.cache.missing(policy, chain[:end], start) if key in stored]
        tokens = (end - start) * self.cache.page_size
        if end - start < MIN_FETCH_PAGES or not keys or not self.costs.worth(len(keys), tokens):
            return False
        future = self._executor.submit(self._fetch, keys)
        self._fetches[request] = _Fetch(chain[:end], keys, time.monotonic() + self.costs.patience_s(tokens), future)
        future.add_done_callback(lambda _: self._wake())
        self.stats.prefix_fetches["started"] += 1
        return True

    def _fetch(self, keys: list[Key]) -> dict[Key, torch.Tensor]:
        """On the fetch thread."""
        started = time.perf_counter()
        pages = self.store.fetch(keys)
        self.costs.observe_fetch(time.perf_counter() - started, len(keys))
        return pages

    def waiting(self, request: Request) -> bool:
        """Whether the request waits for its fetch: its pages are not in and its patience has not run out."""
        fetch = self._fetches.get(request)
        return fetch is not None and not fetch.future.done() and time.monotonic() < fetch.until

    def timeout_s(self) -> float | None:
        """Seconds until a waiting request's patience runs out (the engine loop wakes then), or None."""
        waits = [fetch.until for fetch in self._fetches.values() if not fetch.future.done() and not fetch.late]
        return max(0.0, min(waits) - time.monotonic()) if waits else None

    def apply(self, request: Request) -> int:
        """Put the request's fetched pages into its table if they arrived and take it further than what it
        computed meanwhile (a partial last page is given up for them). Returns the tokens restored."""
        fetch = self._fetches.get(request)
        if fetch is None:
            return 0
        if not fetch.future.done():
            if not fetch.late and time.monotonic() >= fetch.until:
                fetch.late = True
                self.stats.prefix_fetches["late"] += 1
            return 0
        del self._fetches[request]
        try:
            pages = fetch.future.result()
        except KilnError as error:
            logger.warning("fetching %d prefix pages failed (recomputed instead): %s", len(fetch.keys), error)
            self.stats.prefix_fetches["failed"] += 1
            return 0
        seq, page_size = request.seq, self.cache.page_size
        held = seq.num_computed // page_size
        if held >= len(fetch.chain) or seq.uncomputed <= 1:
            self.stats.prefix_fetches["unused"] += 1
            return 0
        if seq.num_computed % page_size:
            seq.num_computed = self.cache.drop(seq.table, held * page_size)
        reached = self.cache.extend(seq.table, fetch.chain[held:], pages)
        restored = (reached - held) * page_size
        seq.num_computed = reached * page_size
        self.stats.restored_tokens += restored
        self.stats.prefix_fetches["restored" if restored else "unused"] += 1
        return restored

    def forget(self, request: Request) -> None:
        """The request ended: its fetch, if any, is of no use any more."""
        fetch = self._fetches.pop(request, None)
        if fetch is not None:
            fetch.future.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
