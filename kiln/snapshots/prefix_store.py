"""PrefixStore: the persistent prefix store. Full KV pages the engine's prefix index names are written behind
to the snapshot store, so a prefix outlives the process and the pool: after a restart, or once the pool
evicted them, a prompt that shares them fetches the pages instead of recomputing them (the engine's side:
kiln/engine/stored_prefixes.py; docs/architecture.md § The persistent prefix store).

Keys and identity: a page is keyed by (KV group, chain hash) within a prefix space, `prefix_space(engine)`,
a digest of everything that decides a page's bytes and where they go: the KV format fingerprint (the
model's content, config included: its position encoding; the weight format; KV dtype and codec; page size;
page layout version) and the KV layout (each group's layers and window, heads, head size, page bytes).
The chain hash covers the whole token prefix, the format fingerprint and the KV policy, and a page's index
in the chain is its position: a record matches only the same tokens before it under the same model,
format and policy. Another model or codec is another space, never read.

Storage: a page's blob is named by the SHA-256 of its bytes, as a snapshot's are (kiln/snapshots/blobs.py),
so a page a session's snapshot holds is stored once for both. A record maps the key to that digest, the
blob's stored size and its last use (kiln/snapshots/store.py § prefix records). A fetched blob is verified
against its digest; one missing or corrupt is left out, its record dropped, and counted.

Budget: the records' stored bytes stay within `budget_bytes`; past it the least recently used go (a write,
a fetch and a prefix hit in the pool, which the engine reports with `touch`, are uses). A dropped record's
blob is garbage unless a manifest or another record names it: once the bytes dropped since the last
collection pass a quarter of the budget, the writer runs the store's gc (safe beside saves by its contract).

Threads: the engine's calls (`stored`, `touch`, `offer`) take only this object's lock, a leaf, and never wait
on the medium. The writer thread writes what was offered (a bounded queue: pages offered while it is full
are dropped and counted), then touches, drops and collects, and re-reads the records now and then (other
servers sharing the store add and drop them). `fetch` runs on the engine's fetch thread. A store outage fails
writes and fetches, counted and logged; generation never waits for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from kiln.engine.engine import Engine
from kiln.errors import FailedPreconditionError, KilnError
from kiln.snapshots import blobs
from kiln.snapshots.restore import engine_groups, engine_shape
from kiln.snapshots.store import PrefixKey, PrefixRecord, SnapshotStore

logger = logging.getLogger(__name__)
QUEUE_BYTES = 64 * 2**20  # page bytes offered and not yet written, at most
FLUSH_S = 1.0  # how long touches wait to be written with others
REFRESH_S = 30.0  # how often the records are read again from the store
GC_FRACTION = 0.25  # of the budget dropped since the last gc, before the next


def prefix_space(engine: Engine) -> str:
    """The prefix space of an engine's pages: 32 hex digits naming its KV format and layout (module doc)."""
    identity = {"shape": asdict(engine_shape(engine)), "groups": engine_groups(engine)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class PrefixStoreStats:
    """Counters of one PrefixStore (exported as metrics), changed under its lock."""

    pages_written: int = 0  # records written (their blobs new or already stored)
    bytes_written: int = 0  # blob bytes new to the store
    write_failures: int = 0  # pages a failed write lost (the store unreachable, full)
    dropped_pages: int = 0  # pages offered while the queue was full, never written
    evicted_pages: int = 0  # records dropped for the budget
    fetched_pages: int = 0  # pages fetched and verified
    failed_pages: int = 0  # pages whose blob was missing or corrupt (their records dropped)
    gc_runs: int = 0
    gc_failures: int = 0


class PrefixStore:
    def __init__(self, store: SnapshotStore, space: str, page_bytes: int, budget_bytes: int,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.store = store
        self.space = space
        self.page_bytes = page_bytes
        self.budget_bytes = budget_bytes
        self.queue_bytes = queue_bytes
        self.stats = PrefixStoreStats()
        self._cond = threading.Condition()
        self._index: OrderedDict[PrefixKey, PrefixRecord] = OrderedDict()  # least recently used first
        self._bytes = 0  # stored bytes of the indexed records
        self._queue: dict[PrefixKey, torch.Tensor] = {}
        self._touched: dict[PrefixKey, float] = {}
        self._dropped: set[PrefixKey] = set()  # records to drop from the store (bad blobs)
        self._freed = 0  # bytes of records dropped since the last gc
        # Digests whose stored blob failed verification: the store still holds it under that name (a write
        # of the same page would deduplicate against it), so such pages are not recorded again.
        self._corrupt: set[str] = set()
        self._codec: str | None = None  # how new blobs are stored, chosen on the first pages written
        self._refreshed = 0.0
        self._busy = False  # the writer holds a batch it took from the queue
        self._closing = False
        self._refresh()
        self._writer = threading.Thread(target=self._run, name="kiln-prefix-store", daemon=True)
        self._writer.start()

    @classmethod
    def for_engine(cls, store: SnapshotStore, engine: Engine, budget_bytes: int) -> PrefixStore:
        return cls(store, prefix_space(engine), engine.kv_page_bytes, budget_bytes)

    # ---- what the engine calls (kiln/engine/stored_prefixes.py PageStore) -----------------------------

    def stored(self, keys: Iterable[PrefixKey]) -> set[PrefixKey]:
        with self._cond:
            return {key for key in keys if key in self._index}

    def touch(self, keys: Iterable[PrefixKey]) -> None:
        now = time.time()
        with self._cond:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)
                    self._touched[key] = now

    def offer(self, pages: list[tuple[PrefixKey, torch.Tensor]]) -> None:
        with self._cond:
            if self._closing:
                return
            for key, page in pages:
                if key in self._queue or key in self._index:
                    continue
                if (len(self._queue) + 1) * self.page_bytes > self.queue_bytes:
                    self.stats.dropped_pages += 1
                    continue
                self._queue[key] = page
            self._cond.notify_all()

    def fetch(self, keys: Sequence[PrefixKey]) -> dict[PrefixKey, torch.Tensor]:
        """Pages verified against their digests; missing or corrupt ones are left out (their records go)."""
        with self._cond:
            wanted = {key: self._index[key].digest for key in keys if key in self._index}
        found = self.store.get_blobs(set(wanted.values()))
        raws: dict[str, torch.Tensor | None] = {}
        corrupt = set()
        for digest in set(wanted.values()):
            try:
                raw = blobs.decode(found[digest], digest, self.page_bytes) if digest in found else None
            except FailedPreconditionError as error:
                logger.warning("a prefix page is refused and will be recomputed: %s", error)
                raw = None
                corrupt.add(digest)
            raws[digest] = None if raw is None else torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        pages = {key: raws[digest] for key, digest in wanted.items() if raws[digest] is not None}
        bad = [key for key in wanted if key not in pages]
        now = time.time()
        with self._cond:
            self.stats.fetched_pages += len(pages)
            self.stats.failed_pages += len(bad)
            for key in pages:
                if key in self._index:
                    self._index.move_to_end(key)
                    self._touched[key] = now
            for key in bad:
                self._forget(key)
                self._dropped.add(key)
            self._corrupt |= corrupt
            self._cond.notify_all()
        return pages  # type: ignore[return-value]

    # ---- what is stored -----------------------------------------------------------------------------

    @property
    def stored_pages(self) -> int:
        with self._cond:
            return len(self._index)

    @property
    def stored_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything offered so far was written (or failed); True unless timed out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the writer; the snapshot store stays open
        (Persistence closes it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join(timeout_s)

    # ---- the writer ---------------------------------------------------------------------------------

    def _run(self) -> None:
        """One pass as soon as there is something to write (touches wait up to FLUSH_S for company), and
        at least every REFRESH_S; after the last pass once closing began."""
        while True:
            with self._cond:
                if not (self._closing or self._queue or self._dropped or self._bytes > self.budget_bytes):
                    self._cond.wait(FLUSH_S if self._touched else REFRESH_S)
                batch, self._queue = self._queue, {}
                touched, self._touched = self._touched, {}
                self._busy = bool(batch)
                closing = self._closing
            try:
                self._work(batch, touched)
            except Exception:  # noqa: BLE001 - a bug must not stop the writer: the store is only a cache
                logger.exception("the prefix store's writer failed a pass")
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                if closing and not self._queue:
                    return

    def _work(self, batch: dict[PrefixKey, torch.Tensor], touched: dict[PrefixKey, float]) -> None:
        if batch:
            self._write(batch)
        with self._cond:
            victims = self._evict()
            dropped, self._dropped = self._dropped | set(victims), set()
        self._guarded("dropping prefix records", lambda: self.store.drop_prefix(self.space, dropped) if dropped else None)
        self._guarded("touching prefix records", lambda: self.store.touch_prefix(self.space, touched) if touched else None)
        if self._freed and self._freed >= GC_FRACTION * self.budget_bytes:
            self._collect()
        if time.monotonic() - self._refreshed >= REFRESH_S:
            self._refresh()

    def _write(self, batch: dict[PrefixKey, torch.Tensor]) -> None:
        named = [(key, memoryview(page.numpy())) for key, page in batch.items()]
        hashed = [(key, page, blobs.digest(page)) for key, page in named]
        with self._cond:
            hashed = [entry for entry in hashed if entry[2] not in self._corrupt]
        if not hashed:
            return
        keys, pages, digests = (list(column) for column in zip(*hashed, strict=True))
        try:
            absent = self.store.missing(digests)
            fresh = {d: page for d, page in zip(digests, pages, strict=True) if d in absent}
            codec = self._choose_codec(list(fresh.values()))
            encoded = {d: blobs.encode(page, codec) for d, page in fresh.items()}
            sizes = {**self.store.blob_sizes(set(digests) - absent), **{d: len(b) for d, b in encoded.items()}}
            now = time.time()
            records = [PrefixRecord(g, h, d, sizes.get(d, self.page_bytes), now) for (g, h), d in zip(keys, digests, strict=True)]
            report = self.store.save_prefix(self.space, records, encoded)
        except KilnError as error:
            logger.warning("writing %d prefix pages failed (they stay uncached): %s", len(keys), error)
            with self._cond:
                self.stats.write_failures += len(keys)
            return
        with self._cond:
            for record in records:
                self._forget(record.key)
                self._index[record.key] = record
                self._bytes += record.size
            self.stats.pages_written += len(records)
            self.stats.bytes_written += report.bytes_written

    def _choose_codec(self, pages: list[memoryview]) -> str:
        if self._codec is None and pages:
            self._codec = blobs.choose_codec(pages[: blobs.SAMPLE_PAGES])
        return self._codec or blobs.CODEC_RAW

    def _evict(self) -> list[PrefixKey]:
        """Under the lock: drop the least recently used records past the budget; their keys."""
        victims = []
        while self._bytes > self.budget_bytes and self._index:
            key = next(iter(self._index))
            self._freed += self._index[key].size
            self._forget(key)
            victims.append(key)
        self.stats.evicted_pages += len(victims)
        return victims

    def _forget(self, key: PrefixKey) -> None:
        """Under the lock."""
        record = self._index.pop(key, None)
        if record is not None:
            self._bytes -= record.size
        self._touched.pop(key, None)

    def _collect(self) -> None:
        self._freed = 0
        with self._cond:
            self.stats.gc_runs += 1
        if not self._guarded("collecting dropped prefix pages", self.store.gc):
            with self._cond:
                self.stats.gc_failures += 1

    def _refresh(self) -> None:
        """The records as the store holds them now, least recently used first (touches not yet written are
        kept). While the store cannot be read, the index stays as it is."""
        self._refreshed = time.monotonic()
        records: list[PrefixRecord] = []
        if not self._guarded("reading prefix records", lambda: records.extend(self.store.prefix_records(self.space))):
            return
        with self._cond:
            touched = self._touched
            self._index = OrderedDict((r.key, r) for r in sorted(records, key=lambda r: max(r.last_used, touched.get(r.key, 0.0))))
            self._bytes = sum(r.size for r in records)

    def _guarded(self, what: str, call: Callable[[], object]) -> bool:
        """Run a store call on the writer thread; a KilnError is logged (the store is a cache) and False."""
        try:
            call()
        except KilnError as error:
            logger.warning("%s failed: %s", what, error)
            return False
        return True
