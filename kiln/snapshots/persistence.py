"""Persistence: snapshots of sessions, explicit and automatic, over one SnapshotStore.

- Explicit: `snapshot(session)` writes a checkpoint with its own id and returns when it is durable;
  `restore(snapshot_id)` verifies it completely, then loads it into a new session.
- Automatic: after each completed turn a session is marked; a background worker captures it (between
  engine steps, copying only pages it has not captured before) and saves it as the session's own
  snapshot, coalescing marks per session. Idle-TTL and LRU eviction capture the session at once and
  queue its save, so eviction frees memory without losing the session; a later call on its id (in this
  process or, after a restart, another) restores it lazily, with the same id, owner and history.
  Graceful shutdown saves every live session. Closing a session deletes its snapshot.

Saves are incremental by construction: a page is named by the SHA-256 of its bytes and written only if
the store lacks it, so a turn writes its new full pages, its partial last page and a manifest. Hashing
and compression run on a small thread pool, off the engine thread and outside every lock. A failing
save (full disk, Redis gone) raises or is counted; the session in memory is untouched.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from kiln.engine.engine import Engine
from kiln.errors import FailedPreconditionError, KilnError, NotFoundError
from kiln.kv.image import KVImage, PageKey
from kiln.results import SnapshotInfo
from kiln.snapshots import blobs
from kiln.snapshots.manifest import (
    KIND_CHECKPOINT,
    KIND_SESSION,
    SNAPSHOT_ID,
    GroupPages,
    Manifest,
    check_snapshot_id,
    owner_digest,
    session_snapshot_id,
)
from kiln.snapshots.restore import engine_shape, fetch
from kiln.snapshots.store import SaveReport, SnapshotStore

if TYPE_CHECKING:
    from kiln.sessions import SessionStore

logger = logging.getLogger(__name__)
HASH_THREADS = 2  # hashing and zstd release the GIL: pages of one save are encoded in parallel
Observer = Callable[[str, float], None]  # ("save" | "restore", seconds)
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class SessionCapture:
    """What a session snapshot holds besides pages: who owns it and how it lives."""

    session_id: str
    owner: str | None
    ttl_s: float
    created_at: float
    image: KVImage


@dataclass
class SnapshotStats:
    """Counters of one Persistence, updated under its lock (exported as metrics)."""

    saves: Counter[str] = field(default_factory=Counter)  # by kind
    save_failures: Counter[str] = field(default_factory=Counter)  # by error code
    restores: Counter[str] = field(default_factory=Counter)  # by source: checkpoint | session
    verification_failures: int = 0
    bytes_written: int = 0  # compressed blobs and manifests
    dedup_bytes: int = 0  # raw page bytes not written because the store already held them
    blobs_written: int = 0


_MARK = object()  # a pending job: capture the live session when the worker gets to it


class Persistence:
    def __init__(self, store: SnapshotStore, engine: Engine, sessions: SessionStore) -> None:
        self.store = store
        self.engine = engine
        self.sessions = sessions
        self.stats = SnapshotStats()
        self._observers: list[Observer] = []
        self._memo: dict[str, dict[PageKey, tuple[int, str]]] = {}  # session -> full page -> (pool page, digest)
        # bumped whenever a session leaves memory: a live capture's digests are remembered only if no
        # session left meanwhile (else its pool pages may since belong to another sequence)
        self._epoch = 0
        self._pending: OrderedDict[str, object] = OrderedDict()  # session id -> _MARK or a SessionCapture
        self._inflight: str | None = None
        self._forgotten: set[str] = set()  # closed while its save was in flight: delete after it
        self._cond = threading.Condition()
        self._stopping = False
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kiln-snapshot-encode")
        self._worker = threading.Thread(target=self._run, name="kiln-snapshots", daemon=True)
        self._worker.start()

    def add_observer(self, observe: Observer) -> None:
        """Called with ("save" | "restore", seconds) after each successful one (metrics)."""
        self._observers.append(observe)

    # ---- explicit snapshots -------------------------------------------------------------------------

    def snapshot(self, session_id: str, owner: str | None) -> str:
        """A checkpoint of an idle session; returns its id once it is durable."""
        epoch = self._epoch
        capture = self.sessions.capture(session_id, owner, self.known(session_id))
        snapshot_id = "snap-" + secrets.token_urlsafe(16)
        self._save(capture, snapshot_id, KIND_CHECKPOINT, epoch)
        return snapshot_id

    def restore(self, snapshot_id: str, owner: str | None) -> str:
        """A new session (new id, this owner) with a snapshot's history and K/V; returns its id."""
        manifest = self._manifest(snapshot_id, owner)
        capture = self._fetch(manifest, owner)
        session_id = self.sessions.adopt(capture)
        with self._cond:
            self.stats.restores[KIND_CHECKPOINT] += 1
        return session_id

    def info(self, snapshot_id: str, owner: str | None) -> SnapshotInfo:
        return _info(self._manifest(snapshot_id, owner))

    def list(self, owner: str | None) -> list[SnapshotInfo]:
        """The owner's checkpoints, oldest first."""
        found = [m for m in self.store.manifests(owner_digest(owner)) if m.kind == KIND_CHECKPOINT]
        return [_info(m) for m in sorted(found, key=lambda m: m.created_at)]

    def delete(self, snapshot_id: str, owner: str | None) -> None:
        manifest = self._manifest(snapshot_id, owner)
        self.store.delete_manifest(manifest.snapshot_id)

    def _manifest(self, snapshot_id: str, owner: str | None) -> Manifest:
        manifest = self.store.get_manifest(check_snapshot_id(snapshot_id))
        if manifest is None or manifest.owner != owner_digest(owner):  # another key's: does not exist
            raise NotFoundError(f"snapshot {snapshot_id} does not exist")
        return manifest

    # ---- session persistence (called by the SessionStore) ------------------------------------------

    def mark(self, session_id: str) -> None:
        """The session changed (a turn ended): save it soon, in the background."""
        with self._cond:
            self._pending[session_id] = _MARK  # the session is live: newer than any queued capture
            self._cond.notify()

    def keep(self, capture: SessionCapture) -> None:
        """The session leaves memory (evicted): save this capture of it, in the background."""
        with self._cond:
            self._drop_memo(capture.session_id)
            self._pending[capture.session_id] = capture
            self._pending.move_to_end(capture.session_id)
            self._cond.notify()

    def forget(self, session_id: str) -> None:
        """The session was closed: its snapshot goes (after a save of it in flight, if any)."""
        with self._cond:
            self._pending.pop(session_id, None)
            self._drop_memo(session_id)
            if self._inflight == session_id:
                self._forgotten.add(session_id)
                return
        self.store.delete_manifest(session_snapshot_id(session_id))

    def load(self, session_id: str, owner: str | None) -> SessionCapture | None:
        """A session that is not in memory, from its queued capture or its snapshot; None if it has
        none (or another owner's). Raises a typed error for a snapshot that fails verification."""
        if not SNAPSHOT_ID.fullmatch(session_snapshot_id(session_id)):
            return None  # not an id this server issues
        with self._cond:
            while self._inflight == session_id:
                self._cond.wait()
            queued = self._pending.get(session_id)
        if isinstance(queued, SessionCapture):
            return queued if queued.owner == owner else None
        manifest = self.store.get_manifest(session_snapshot_id(session_id))
        if manifest is None or manifest.owner != owner_digest(owner):
            return None
        capture = self._fetch(manifest, owner)
        with self._cond:
            self.stats.restores[KIND_SESSION] += 1
        return capture

    def save_now(self, capture: SessionCapture) -> None:
        """Save a session's own snapshot in this thread (graceful shutdown)."""
        self._save(capture, session_snapshot_id(capture.session_id), KIND_SESSION, epoch=None)

    def known(self, session_id: str) -> dict[PageKey, int]:
        """Full pages of a live session saved before, by (group, index): their pool page (KVCache.capture)."""
        with self._cond:
            return {key: page for key, (page, _) in self._memo.get(session_id, {}).items()}

    def _drop_memo(self, session_id: str) -> None:
        self._memo.pop(session_id, None)
        self._epoch += 1

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued save is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._inflight is not None:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    return False
        return True

    def close(self) -> None:
        """Finish queued saves, stop the worker, release the store."""
        self.flush()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._worker.join()
        self._pool.shutdown()
        self.store.close()

    # ---- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                session_id, job = self._pending.popitem(last=False)
                # In flight from here: `load` of an evicted session waits for it, `flush` too, and a
                # close meanwhile (`forget`) deletes the snapshot after the save instead of before it.
                self._inflight = session_id
            try:
                epoch = self._epoch if job is _MARK else None
                capture = job if epoch is None else self.sessions.capture_idle(session_id, self.known(session_id))
                if capture is not None:
                    self._save(capture, session_snapshot_id(session_id), KIND_SESSION, epoch)
            except KilnError as error:
                logger.warning("saving session %s failed: %s", session_id, error)
            except Exception:
                logger.exception("saving session %s failed", session_id)
            finally:
                self._settle(session_id)

    def _settle(self, session_id: str) -> None:
        with self._cond:
            forgotten = self._inflight == session_id and session_id in self._forgotten
            self._forgotten.discard(session_id)
            self._inflight = None
            self._cond.notify_all()
        if forgotten:
            try:
                self.store.delete_manifest(session_snapshot_id(session_id))
            except KilnError as error:
                logger.warning("deleting the snapshot of closed session %s failed: %s", session_id, error)

    # ---- save and fetch -----------------------------------------------------------------------------

    def _save(self, capture: SessionCapture, snapshot_id: str, kind: str, epoch: int | None) -> SaveReport:
        """`epoch` (of a live session's capture): if the session is still in memory afterwards, it still
        holds these pages: their digests are remembered, so its next save neither copies nor hashes
        them again."""
        started = time.perf_counter()
        try:
            report, digests = self._write(capture, snapshot_id, kind)
        except KilnError as error:
            with self._cond:
                self.stats.save_failures[error.code] += 1
            raise
        image = capture.image
        full = image.full_pages(self.engine.kv_layout.page_size)
        with self._cond:
            if epoch is not None and epoch == self._epoch:
                self._memo[capture.session_id] = {
                    key: (image.pages[key[0]][key[1]], digest) for key, digest in digests.items() if key[1] < full
                }
            self.stats.saves[kind] += 1
            self.stats.bytes_written += report.bytes_written
            self.stats.blobs_written += report.blobs_written
            self.stats.dedup_bytes += report.blobs_deduplicated * self.engine.kv_page_bytes
        for observe in self._observers:
            observe("save", time.perf_counter() - started)
        return report

    def _write(self, capture: SessionCapture, snapshot_id: str, kind: str) -> tuple[SaveReport, dict[PageKey, str]]:
        image = capture.image
        with self._cond:
            memo = dict(self._memo.get(capture.session_id, {}))
        keys = list(image.blocks)
        digests = dict(zip(keys, self._map(lambda key: blobs.digest(_buffer(image.blocks[key])), keys), strict=True))
        for key, (page, digest) in memo.items():
            if key not in digests and image.pages[key[0]][key[1]] == page:
                digests[key] = digest
        missing = self.store.missing({digests[key] for key in keys})
        fresh = {digest: key for key, digest in digests.items() if digest in missing and key in image.blocks}
        compressed = dict(zip(fresh, self._map(lambda d: blobs.compress(_buffer(image.blocks[fresh[d]])), list(fresh)), strict=True))
        layout = self.engine.kv_layout
        groups = tuple(
            GroupPages(group.layers, group.window, tuple(None if page is None else digests[(g, i)] for i, page in enumerate(image.pages[g])))
            for g, group in enumerate(layout.groups)
        )
        manifest = Manifest(
            snapshot_id=snapshot_id, kind=kind, owner=owner_digest(capture.owner), session_id=capture.session_id,
            created_at=time.time(), ttl_s=capture.ttl_s, policy=image.policy.key.decode(), shape=engine_shape(self.engine),
            token_ids=tuple(image.tokens), num_computed=image.num_computed, groups=groups,
            session_created_at=capture.created_at,
        )
        return self.store.save(manifest, compressed), digests

    def _map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """fn over items on the encoding threads, in about one batch per thread (a future per page would
        cost more than hashing a small page)."""
        size = max(1, -(-len(items) // HASH_THREADS))
        batches = self._pool.map(lambda batch: [fn(item) for item in batch], [items[i : i + size] for i in range(0, len(items), size)])
        return [result for batch in batches for result in batch]

    def _fetch(self, manifest: Manifest, owner: str | None) -> SessionCapture:
        started = time.perf_counter()
        try:
            image = fetch(manifest, self.engine, self.store)
        except FailedPreconditionError:
            with self._cond:
                self.stats.verification_failures += 1
            raise
        for observe in self._observers:
            observe("restore", time.perf_counter() - started)
        return SessionCapture(manifest.session_id or "", owner, manifest.ttl_s, manifest.session_created_at, image)


def _buffer(block: torch.Tensor) -> memoryview:
    """A CPU page's bytes (uint8 [page_nbytes]) without a copy."""
    return memoryview(block.numpy())


def _info(manifest: Manifest) -> SnapshotInfo:
    return SnapshotInfo(manifest.snapshot_id, manifest.session_id or "", len(manifest.token_ids),
                        manifest.num_computed, manifest.page_count(), manifest.created_at)
