"""Persistence: snapshots of sessions, explicit and automatic, over one SnapshotStore.

One direction (docs/architecture.md § Locks): the SessionStore owns live sessions and hands Persistence
captures (copies of a session's history and K/V, taken outside the store lock); Persistence saves them and
returns loads. It never calls back into the SessionStore, so no lock of the store ever waits on the saver
and the saver never waits on the store's lock.

- Explicit: `checkpoint(capture)` writes a checkpoint under its own id and returns once it is durable;
  `open_checkpoint(id, owner)` verifies one completely and returns it as a capture for a new session.
- Automatic: `submit(capture)` queues a session's newest state for its own snapshot; a newer capture of
  the same session replaces a queued older one. One background saver writes the queue, oldest unsaved
  change first. A save that fails keeps its capture queued and is retried with backoff (`Backoff`): a
  session's history is never dropped for a failed save; failures are counted by code and per session
  (`status`). `load(id, owner)` brings a session that is not in memory back: its newest queued capture,
  else its snapshot. `delete_session` (close) deletes the snapshot, or raises and changes nothing.
- Listing without the store: `saved()` describes every snapshot this process knows (owner, history,
  time, stored size) from an index updated by each save and delete; the store is read once to seed it.

Durability rule: every change to a session (its creation, an append, a fork, a turn's end) is captured
and queued by the thread that made it before the change is acknowledged, and survives a crash once the
saver has written it. A crash therefore loses only what is still queued: every change acknowledged more
than `backlog_s` (the age of the oldest unsaved change; a metric) before the crash survives it. Under
`EngineConfig.durable_turns` a turn's finish is sent only once the turn is saved, so no acknowledged turn
is ever lost (an append is durable with the turn that follows it).

Saves are incremental by construction: a page is named by the SHA-256 of its bytes and written only if
the store lacks it, so a turn writes its new full pages, its partial last page and a manifest. A live
session's capture does not even copy the full pages it saved before (`known`): their digests ride along.
If the store lost such a blob (gc, a hand-deleted file), the capture cannot rewrite it: the saver forgets
those pages and asks for a fresh capture (`stale_sessions`); a complete capture is retried once at once.
Hashing and encoding run on a small thread pool, outside every lock. Pages are stored raw unless
compressing this engine's KV encoding pays (blobs.choose_codec; decided once, recorded in each manifest).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kiln.engine.engine import Engine
from kiln.errors import FailedPreconditionError, KilnError, LeaseLostError, NotFoundError, UnavailableError
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
from kiln.snapshots.ownership import Ownership
from kiln.snapshots.restore import engine_shape, fetch
from kiln.snapshots.store import Lease, SaveReport, SnapshotStore

logger = logging.getLogger(__name__)
HASH_THREADS = 2  # hashing and zstd release the GIL: pages of one save are encoded in parallel
CLOSED_REMEMBERED = 10_000  # ids of closed sessions whose late captures are ignored
Observer = Callable[[str, float], None]  # ("save" | "restore", seconds)
Waiter = Callable[[Exception | None], None]  # told once: None when saved, else the save's error
T = TypeVar("T")
R = TypeVar("R")


class MissingPagesError(FailedPreconditionError):
    """A capture names pages by digest only (saved before) and the store no longer holds them: a fresh
    capture of the session, which copies those pages, is needed."""


@dataclass(frozen=True)
class Known:
    """Full pages of a live session that an earlier save stored: a capture need not copy them again.
    `epoch` tells the saver whether the session may have left memory since (then nothing is memoised)."""

    pages: dict[PageKey, int]  # (group, index) -> pool page, as KVCache.capture takes it
    digests: dict[PageKey, str]
    epoch: int | None

    @classmethod
    def nothing(cls) -> Known:
        """Copy every page and memoise nothing (a session leaving memory, a tokens-only image)."""
        return cls({}, {}, None)


@dataclass(frozen=True)
class SessionCapture:
    """A session's state as a snapshot holds it: who owns it, how it lives, its history and K/V.
    `image.blocks` holds every held page except those in `known.digests`."""

    session_id: str
    owner: str | None
    ttl_s: float
    created_at: float
    image: KVImage
    known: Known = field(default_factory=Known.nothing)

    @property
    def complete(self) -> bool:
        """Whether every page it references is in `image.blocks` (it can be loaded as it is)."""
        return all(page is None or (g, i) in self.image.blocks
                   for g, pages in enumerate(self.image.pages) for i, page in enumerate(pages))


@dataclass(frozen=True)
class SaveStatus:
    """One session's persistence as `info()` reports it."""

    unsaved_changes: bool  # a change is queued or being written
    last_saved_at: float | None  # unix seconds of its last successful save in this process (or the snapshot's)
    save_failures: int  # failed attempts since its last successful save


@dataclass(frozen=True)
class Backoff:
    """Delay before retrying a failed save: doubling from `first_s`, at most `max_s`."""

    first_s: float = 0.5
    max_s: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, failures - 1))


@dataclass
class SnapshotStats:
    """Counters of one Persistence, updated under its lock (exported as metrics)."""

    saves: Counter[str] = field(default_factory=Counter)  # by kind
    save_failures: Counter[str] = field(default_factory=Counter)  # by error code
    restores: Counter[str] = field(default_factory=Counter)  # by source: checkpoint | session
    verification_failures: int = 0
    bytes_written: int = 0  # stored blobs and manifests
    dedup_bytes: int = 0  # raw page bytes not written because the store already held them
    blobs_written: int = 0


@dataclass
class _Job:
    """A session's newest capture waiting for the saver."""

    capture: SessionCapture
    changed_at: float  # monotonic time of the oldest change it holds that no save has written
    final: bool = False  # the session left memory with this capture: its lease goes once it is saved
    claim: int = 0  # the lease claim a final save hands off (Ownership.release)
    waiters: list[Waiter] = field(default_factory=list)
    due: float = 0.0  # monotonic time before which it is not tried (backoff after a failure)
    failures: int = 0
    stale: bool = False  # names pages the store lost: only a newer capture can be saved
    attempted: int = -1  # the saver's attempt count when it last tried this job (`flush`)

    @property
    def session_id(self) -> str:
        return self.capture.session_id


@dataclass(frozen=True)
class StoredSession:
    """A session as its newest save (or its capture still queued for one) describes it: what a listing
    reports of a session that is not in memory, read without its K/V."""

    session_id: str
    history_tokens: int
    created_at: float  # unix seconds
    ttl_s: float
    policy: str  # KVPolicy key
    idle_s: float  # since its newest state was saved, or queued
    last_saved_at: float | None  # None: its newest state is queued, not yet saved


@dataclass(frozen=True)
class SavedSnapshot:
    """A stored snapshot as described without its blobs: what the dashboard lists (a session not in
    memory, a session's checkpoints). `stored_bytes` is what the snapshot occupies in the store if it
    stood alone: its manifest plus every page blob it references, compressed as stored; a blob shared
    with other snapshots (a common prefix, an earlier turn) is counted in each of them."""

    snapshot_id: str
    kind: str  # KIND_SESSION | KIND_CHECKPOINT
    owner: str  # owner_digest of the creator
    session_id: str
    history_tokens: int
    policy: str  # KVPolicy key
    ttl_s: float
    saved_at: float  # unix seconds
    stored_bytes: int


@dataclass
class _Record:
    last_saved_at: float | None = None
    failures: int = 0


class Persistence:
    def __init__(self, store: SnapshotStore, engine: Engine, ownership: Ownership | None = None,
                 backoff: Backoff | None = None, close_timeout_s: float = 30.0) -> None:
        self.store = store
        self.engine = engine
        self.ownership = ownership or Ownership(store)  # the leases that fence this process's session saves
        self.backoff = backoff or Backoff()
        self.close_timeout_s = close_timeout_s  # how long `close` keeps retrying saves that fail
        self.stats = SnapshotStats()
        self._chosen_codec: str | None = None  # how new pages are stored (`_codec`), once a save chose it
        self._observers: list[Observer] = []
        self._memo: dict[str, dict[PageKey, tuple[int, str]]] = {}  # session -> full page -> (pool page, digest)
        # bumped whenever a session leaves memory or its memo is forgotten: a capture's digests are
        # memoised only if its epoch is still current (else its pool pages may since hold other K/V)
        self._epoch = 0
        self._jobs: dict[str, _Job] = {}
        self._inflight: _Job | None = None
        self._records: dict[str, _Record] = {}
        self._deleting: set[str] = set()  # sessions being closed: the saver leaves them alone
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._saved: dict[str, SavedSnapshot] = {}  # snapshot id -> its newest save this process knows
        self._seeded = False  # whether the store's snapshots from before this process were read (`saved`)
        self._gone_while_seeding: set[str] | None = None
        self._seed_lock = threading.Lock()
        self._stale = threading.Event()  # set when a queued capture goes stale (the keeper recaptures)
        self._attempts = 0  # saves the saver has tried (`flush` waits for each queued job's next try)
        self._calls = 0  # explicit saves running in callers' threads (they use the encoding pool)
        self._closing = False
        self._stopping = False
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kiln-snapshot-encode")
        self._worker = threading.Thread(target=self._run, name="kiln-snapshots", daemon=True)
        self._worker.start()

    def add_observer(self, observe: Observer) -> None:
        """Called with ("save" | "restore", seconds) after each successful one (metrics)."""
        self._observers.append(observe)

    # ---- explicit snapshots -------------------------------------------------------------------------

    def checkpoint(self, capture: SessionCapture) -> str:
        """Save a capture as a checkpoint; returns its id once it is durable."""
        snapshot_id = "snap-" + secrets.token_urlsafe(16)
        with self._explicit_call():
            self._save(capture, snapshot_id, KIND_CHECKPOINT)
        return snapshot_id

    def open_checkpoint(self, snapshot_id: str, owner: str | None) -> SessionCapture:
        """A checkpoint's history and K/V, verified completely (nothing is loaded on a mismatch)."""
        capture = self._fetch(self._manifest(snapshot_id, owner), owner)
        with self._cond:
            self.stats.restores[KIND_CHECKPOINT] += 1
        return capture

    def info(self, snapshot_id: str, owner: str | None) -> SnapshotInfo:
        return _info(self._manifest(snapshot_id, owner))

    def list(self, owner: str | None) -> list[SnapshotInfo]:
        """The owner's checkpoints, oldest first."""
        found = [m for m in self.store.manifests(owner_digest(owner)) if m.kind == KIND_CHECKPOINT]
        return [_info(m) for m in sorted(found, key=lambda m: m.created_at)]

    def delete(self, snapshot_id: str, owner: str | None) -> None:
        manifest = self._manifest(snapshot_id, owner)
        self.store.delete_manifest(manifest.snapshot_id)
        with self._cond:
            self._unsave(manifest.snapshot_id)

    def saved(self) -> list[SavedSnapshot]:
        """Every snapshot this process knows of, read without blobs: what the store held the first time
        this was asked (manifests and blob sizes, read once), then every save and delete made here since
        (snapshots other servers write to a shared store later are not seen). Cheap after the first call."""
        if not self._seeded:
            self._seed()
        with self._cond:
            return list(self._saved.values())

    def _seed(self) -> None:
        with self._seed_lock:
            if self._seeded:
                return
            with self._cond:
                self._gone_while_seeding = set()
            try:
                manifests = self.store.manifests()
                sizes = self.store.blob_sizes({d for m in manifests for d in m.digests()})
            except UnavailableError as error:
                logger.warning("the snapshot store's earlier snapshots are not listed yet: %s", error)
                manifests = None
            with self._cond:
                gone, self._gone_while_seeding = self._gone_while_seeding or set(), None
                if manifests is None:
                    return
                found = {m.snapshot_id: _saved(m, sizes) for m in manifests if m.snapshot_id not in gone}
                self._saved = {**found, **self._saved}  # a save made meanwhile is newer than the store's read
                self._seeded = True

    def _unsave(self, snapshot_id: str) -> None:
        """Forget a deleted snapshot (under the condition)."""
        self._saved.pop(snapshot_id, None)
        if self._gone_while_seeding is not None:
            self._gone_while_seeding.add(snapshot_id)

    def _manifest(self, snapshot_id: str, owner: str | None) -> Manifest:
        manifest = self.store.get_manifest(check_snapshot_id(snapshot_id))
        if manifest is None or manifest.owner != owner_digest(owner):  # another key's: does not exist
            raise NotFoundError(f"snapshot {snapshot_id} does not exist")
        return manifest

    # ---- sessions (called by the SessionStore, never calling it) ------------------------------------

    def known(self, session_id: str) -> Known:
        """What a capture of this live session need not copy: its full pages saved before."""
        with self._cond:
            memo = self._memo.get(session_id, {})
            return Known({k: page for k, (page, _) in memo.items()}, {k: d for k, (_, d) in memo.items()}, self._epoch)

    def submit(self, capture: SessionCapture, *, final: bool = False, on_saved: Waiter | None = None) -> None:
        """Queue the session's newest state for its own snapshot (replacing an older queued one). `final`:
        the session leaves memory, its pages go back to the pool (the capture must be complete).
        `on_saved` is told once: None when a save holding this capture is durable, or the error of the
        first failed attempt (the capture stays queued and is retried)."""
        waiters = [on_saved] if on_saved is not None else []
        session_id = capture.session_id
        with self._cond:
            if final:
                self._drop_memo(session_id)
            refused = session_id in self._closed or self._stopping
            if not refused:
                older = self._jobs.get(session_id)
                job = _Job(capture, older.changed_at if older else time.monotonic(), final,
                           self.ownership.claim(session_id) if final else 0, waiters)
                if older is not None:
                    job.waiters[:0] = older.waiters
                self._jobs[session_id] = job
                self._records.setdefault(session_id, _Record())
                self._cond.notify_all()
        if refused:
            self._refuse(capture, waiters)

    def sessions(self, owner: str | None) -> list[StoredSession]:
        """The owner's sessions the store or the saver's queue holds (closed ones excepted), oldest created
        first, whether or not they are in memory too. Reads manifests only; while the store is unreachable,
        only the queue's (a listing still answers during an outage, as the sessions in memory do)."""
        now, wall = time.monotonic(), time.time()
        with self._cond:
            queued = {job.session_id: job for job in self._jobs.values() if job.capture.owner == owner}
            closed = set(self._closed) | self._deleting
        found = {
            sid: StoredSession(sid, len(job.capture.image.tokens), job.capture.created_at, job.capture.ttl_s,
                               job.capture.image.policy.key.decode(), now - job.changed_at, None)
            for sid, job in queued.items() if sid not in closed
        }
        try:
            manifests = self.store.manifests(owner_digest(owner))
        except UnavailableError as error:
            logger.warning("listing sessions without those only the snapshot store holds: %s", error)
            manifests = []
        for manifest in manifests:
            sid = manifest.session_id or ""
            if manifest.kind == KIND_SESSION and sid not in closed and sid not in found:
                found[sid] = StoredSession(sid, len(manifest.token_ids), manifest.session_created_at, manifest.ttl_s,
                                           manifest.policy, max(0.0, wall - manifest.created_at), manifest.created_at)
        return sorted(found.values(), key=lambda stored: stored.created_at)

    def _refuse(self, capture: SessionCapture, waiters: list[Waiter]) -> None:
        if capture.session_id in self._closed:  # closed meanwhile: nothing left to save
            _tell(waiters, None)
            return
        logger.error("session %s changed after persistence closed: its change is not saved", capture.session_id)
        _tell(waiters, UnavailableError("persistence is closed: the change was not saved"))

    def load(self, session_id: str, owner: str | None) -> SessionCapture | None:
        """A session that is not in memory: its newest queued capture, else its snapshot; None if it has
        none (or is another owner's, or was closed). Never waits for the saver. Raises a typed error for
        a snapshot that fails verification."""
        if not SNAPSHOT_ID.fullmatch(session_snapshot_id(session_id)):
            return None  # not an id this server issues
        with self._cond:
            if session_id in self._closed:
                return None
            job = self._jobs.get(session_id) or (self._inflight if self._inflight and self._inflight.session_id == session_id else None)
            if job is not None and job.capture.complete:
                if job.capture.owner != owner:
                    return None
                job.final = False  # back in memory: its status is reported again
                return job.capture
        manifest = self.store.get_manifest(session_snapshot_id(session_id))
        if manifest is None or manifest.owner != owner_digest(owner):
            return None
        capture = self._fetch(manifest, owner)
        with self._cond:
            self.stats.restores[KIND_SESSION] += 1
            self._records.setdefault(session_id, _Record(last_saved_at=manifest.created_at))
        return capture

    def delete_session(self, session_id: str) -> None:
        """The session is being closed: delete its snapshot, then forget it (queued captures go, later
        ones are ignored). If the delete fails, raise and change nothing: its queue stays as it was."""
        with self._cond:
            self._deleting.add(session_id)
            while self._inflight is not None and self._inflight.session_id == session_id:
                self._cond.wait()
        try:
            self.store.delete_manifest(session_snapshot_id(session_id), fence=self._fence(session_id))
        except BaseException:
            with self._cond:
                self._deleting.discard(session_id)
                self._cond.notify_all()
            raise
        with self._cond:
            self._deleting.discard(session_id)
            job = self._jobs.pop(session_id, None)
            self._drop_memo(session_id)
            self._records.pop(session_id, None)
            self._unsave(session_snapshot_id(session_id))
            self._closed[session_id] = None
            while len(self._closed) > CLOSED_REMEMBERED:
                self._closed.popitem(last=False)
            self._cond.notify_all()
        self.ownership.release(session_id)
        _tell(job.waiters if job else [], None)

    def status(self, session_id: str) -> SaveStatus:
        with self._cond:
            record = self._records.get(session_id, _Record())
            inflight = self._inflight is not None and self._inflight.session_id == session_id
            return SaveStatus(session_id in self._jobs or inflight, record.last_saved_at, record.failures)

    def stale_sessions(self) -> list[str]:
        """Sessions whose queued capture names pages the store lost: capture them again (the memo of
        those pages is forgotten, so the new capture copies them)."""
        with self._cond:
            return [sid for sid, job in self._jobs.items() if job.stale]

    def wait_for_stale(self, timeout_s: float) -> None:
        """Block until a capture goes stale, `wake()` is called, or `timeout_s` passes (the keeper's pace)."""
        self._stale.wait(timeout_s)
        self._stale.clear()

    def wake(self) -> None:
        self._stale.set()

    @property
    def backlog_s(self) -> float:
        """Age of the oldest change no save has written yet (0 when everything is saved): a crash now
        loses at most the changes of the last `backlog_s` seconds."""
        with self._cond:
            jobs = [*self._jobs.values(), *([self._inflight] if self._inflight else [])]
            return max(0.0, time.monotonic() - min(j.changed_at for j in jobs)) if jobs else 0.0

    @property
    def unsaved_sessions(self) -> int:
        """Sessions with a change queued or being written."""
        with self._cond:
            return len(self._jobs.keys() | ({self._inflight.session_id} if self._inflight else set()))

    @property
    def failing_sessions(self) -> int:
        """Sessions whose last save attempt failed (their captures are queued for a retry)."""
        with self._cond:
            return sum(record.failures > 0 for record in self._records.values())

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Try every queued save now and wait until each has been attempted (written, or failed and kept
        queued for a retry; a stale capture until a fresh one replaced it); True if nothing is left
        unsaved, False if some failed or on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            start = self._attempts
            self._retry_now()
            while self._inflight is not None or any(job.attempted <= start or job.stale for job in self._jobs.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return not self._jobs

    def close(self) -> None:
        """Finish every queued save (failed ones retried with backoff for up to `close_timeout_s`) and
        every explicit one under way, then stop the saver and release the store. New checkpoints are
        refused from here; what still could not be saved is logged by session id."""
        deadline = time.monotonic() + self.close_timeout_s
        with self._cond:
            self._closing = True
            self._retry_now()
            while (self._calls or self._jobs or self._inflight is not None) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._stopping = True
            left = sorted(self._jobs)
            self._cond.notify_all()
        self._worker.join()
        self._pool.shutdown()
        for session_id in set(self.ownership.held()) - set(left):  # saved: handed off
            self.ownership.release(session_id)
        self.ownership.close()
        self.store.close()
        if left:
            logger.error("persistence closed with %d sessions unsaved (the store kept failing): %s", len(left), ", ".join(left))

    @property
    def closing(self) -> bool:
        """Whether `close` has begun (it then waits for the saves under way)."""
        return self._closing

    @contextmanager
    def _explicit_call(self) -> Iterator[None]:
        """An explicit save in a caller's thread: refused once closing began; `close` waits for it."""
        with self._cond:
            if self._closing:
                raise UnavailableError("persistence is closing: no new snapshots")
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def _retry_now(self) -> None:
        for job in self._jobs.values():
            job.due = 0.0
        self._cond.notify_all()

    def _drop_memo(self, session_id: str) -> None:
        self._memo.pop(session_id, None)
        self._epoch += 1

    # ---- the saver ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._next()) is not None:
            error: Exception | None = None
            try:
                self._save(job.capture, session_snapshot_id(job.session_id), KIND_SESSION)
            except KilnError as failure:
                error = failure
                logger.warning("saving session %s failed (kept queued, retried): %s", job.session_id, failure)
            except Exception as failure:  # noqa: BLE001 - a bug must not stop the saver; the capture stays queued
                error = failure
                logger.exception("saving session %s failed (kept queued, retried)", job.session_id)
            self._settle(job, error)

    def _next(self) -> _Job | None:
        """The job to write next (oldest unsaved change first among those due), marked in flight; None
        once stopping."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                ready = [j for sid, j in self._jobs.items() if sid not in self._deleting and not j.stale]
                due = [j for j in ready if j.due <= now]
                if due:
                    job = min(due, key=lambda j: j.changed_at)
                    del self._jobs[job.session_id]
                    self._inflight = job
                    return job
                self._cond.wait(min(j.due for j in ready) - now if ready else None)
            return None

    def _settle(self, job: _Job, error: Exception | None) -> None:
        session_id = job.session_id
        with self._cond:
            self._inflight = None
            self._attempts += 1
            job.attempted = self._attempts
            record = self._records.setdefault(session_id, _Record())
            waiters, job.waiters = job.waiters, []
            handed_off = error is None and job.final and session_id not in self._jobs
            if error is None:
                record.last_saved_at, record.failures = time.time(), 0
                if handed_off:  # saved as it left memory: nothing to report
                    self._records.pop(session_id, None)
            else:
                record.failures += 1
                waiters += self._requeue(job, error)
            self._cond.notify_all()
        if handed_off:
            self.ownership.release(session_id, job.claim)
        _tell(waiters, error)

    def _requeue(self, job: _Job, error: Exception) -> list[Waiter]:
        """A failed job stays queued unless a newer capture of its session replaced it meanwhile (which
        then holds its changes too) or the session was closed. A refused lease drops the session's queue:
        it is owned elsewhere now and this process never writes it again. Returns waiters to tell."""
        newer = self._jobs.get(job.session_id)
        if isinstance(error, LeaseLostError):
            self._jobs.pop(job.session_id, None)
            self.ownership.mark_lost(job.session_id)
            logger.error("session %s moved to another server; its unsaved changes here are dropped", job.session_id)
            return newer.waiters if newer is not None else []
        if newer is not None:
            newer.changed_at = min(newer.changed_at, job.changed_at)
        elif job.session_id not in self._closed:
            job.failures += 1
            job.due = time.monotonic() + self.backoff.delay(job.failures)
            job.stale = isinstance(error, MissingPagesError)
            self._jobs[job.session_id] = job
            if job.stale:
                self._stale.set()
        return []

    # ---- save and fetch -----------------------------------------------------------------------------

    def _save(self, capture: SessionCapture, snapshot_id: str, kind: str) -> SaveReport:
        """Write a capture; a capture the store refuses because a blob vanished after it was checked is
        written once more at once. If the capture is still the session's current state in memory (its
        epoch), its full pages' digests are memoised so the next capture neither copies nor hashes them."""
        started = time.perf_counter()
        try:
            fence = self._fence(capture.session_id) if kind == KIND_SESSION else None
            try:
                report, digests, saved = self._write(capture, snapshot_id, kind, fence)
            except (MissingPagesError, LeaseLostError):
                raise
            except FailedPreconditionError:
                with self._cond:
                    self._forget(capture.session_id)
                report, digests, saved = self._write(capture, snapshot_id, kind, fence)
        except KilnError as error:
            with self._cond:
                self.stats.save_failures[error.code] += 1
            raise
        image = capture.image
        full = image.full_pages(self.engine.kv_layout.page_size)
        with self._cond:
            if capture.known.epoch is not None and capture.known.epoch == self._epoch:
                self._memo[capture.session_id] = {
                    key: (image.pages[key[0]][key[1]], digest) for key, digest in digests.items() if key[1] < full
                }
            self.stats.saves[kind] += 1
            if capture.session_id not in self._closed:  # a save that raced its session's close is no snapshot
                self._saved[snapshot_id] = saved
            self.stats.bytes_written += report.bytes_written
            self.stats.blobs_written += report.blobs_written
            self.stats.dedup_bytes += report.blobs_deduplicated * self.engine.kv_page_bytes
        for observe in self._observers:
            observe("save", time.perf_counter() - started)
        return report

    def _forget(self, session_id: str) -> None:
        """The store lost pages this session's memo names: copy and write them again from now on."""
        self._drop_memo(session_id)

    def _fence(self, session_id: str) -> Lease:
        """This process's lease on a session: its snapshot is written (or deleted) only under it."""
        lease = self.ownership.fence(session_id)
        if lease is None:
            raise LeaseLostError(f"session {session_id} is not leased to this server (it moved to another)")
        return lease

    def _write(self, capture: SessionCapture, snapshot_id: str, kind: str,
               fence: Lease | None) -> tuple[SaveReport, dict[PageKey, str], SavedSnapshot]:
        image = capture.image
        keys = list(image.blocks)
        digests = dict(zip(keys, self._map(lambda key: blobs.digest(_buffer(image.blocks[key])), keys), strict=True))
        for key, digest in capture.known.digests.items():
            if key not in digests and image.pages[key[0]][key[1]] == capture.known.pages[key]:
                digests[key] = digest
        missing = self.store.missing(set(digests.values()))
        lost = [key for key, digest in digests.items() if digest in missing and key not in image.blocks]
        if lost:
            with self._cond:
                self._forget(capture.session_id)
            raise MissingPagesError(f"session {capture.session_id}: {len(lost)} page blob(s) saved before are gone "
                                    "from the store; the session is captured again")
        fresh = {digest: key for key, digest in digests.items() if digest in missing}
        stored = self.store.blob_sizes(set(digests.values()) - missing)  # the snapshot's size (`saved`)
        pages = {digest: _buffer(image.blocks[key]) for digest, key in fresh.items()}
        codec = self._codec(list(pages.values()))
        encoded = pages if codec == blobs.CODEC_RAW else dict(zip(pages, self._map(lambda d: blobs.encode(pages[d], codec), list(pages)), strict=True))
        layout = self.engine.kv_layout
        groups = tuple(
            GroupPages(group.layers, group.window, tuple(None if page is None else digests[(g, i)] for i, page in enumerate(image.pages[g])))
            for g, group in enumerate(layout.groups)
        )
        manifest = Manifest(
            snapshot_id=snapshot_id, kind=kind, owner=owner_digest(capture.owner), session_id=capture.session_id,
            created_at=time.time(), ttl_s=capture.ttl_s, policy=image.policy.key.decode(), shape=engine_shape(self.engine),
            token_ids=tuple(image.tokens), num_computed=image.num_computed, groups=groups,
            session_created_at=capture.created_at, codec=codec,
        )
        report = self.store.save(manifest, encoded, fence=fence)
        written = {digest: memoryview(blob).nbytes for digest, blob in encoded.items()}
        return report, digests, _saved(manifest, {**stored, **written})

    def _codec(self, pages: list[memoryview]) -> str:
        """How new pages are stored: decided once, on the first pages this engine's KV encoding offers
        (a sample spread over them), and kept (blobs.choose_codec)."""
        if self._chosen_codec is None and pages:
            step = max(1, len(pages) // blobs.SAMPLE_PAGES)
            self._chosen_codec = blobs.choose_codec(pages[::step][: blobs.SAMPLE_PAGES])
        return self._chosen_codec or blobs.CODEC_RAW

    def _map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """fn over items on the encoding threads, in about one batch per thread (a future per page would
        cost more than hashing a small page)."""
        size = max(1, -(-len(items) // HASH_THREADS))
        batches = self._pool.map(lambda batch: [fn(item) for item in batch], [items[i : i + size] for i in range(0, len(items), size)])
        return [result for batch in batches for result in batch]

    def _fetch(self, manifest: Manifest, owner: str | None) -> SessionCapture:
        started = time.perf_counter()
        try:
            image = fetch(manifest, self.engine, self.store, self._map)
        except FailedPreconditionError:
            with self._cond:
                self.stats.verification_failures += 1
            raise
        for observe in self._observers:
            observe("restore", time.perf_counter() - started)
        return SessionCapture(manifest.session_id or "", owner, manifest.ttl_s, manifest.session_created_at, image)


def _tell(waiters: list[Waiter], error: Exception | None) -> None:
    for waiter in waiters:
        try:
            waiter(error)
        except Exception:  # noqa: BLE001 - one waiter's bug must not stop the others or the saver
            logger.exception("a save waiter failed")


def _buffer(block: torch.Tensor) -> memoryview:
    """A CPU page's bytes (uint8 [page_nbytes]) without a copy."""
    return memoryview(block.numpy())


def _saved(manifest: Manifest, blob_sizes: dict[str, int]) -> SavedSnapshot:
    """A manifest's SavedSnapshot; `blob_sizes` holds at least the sizes of the blobs it references."""
    stored = len(manifest.to_json()) + sum(blob_sizes.get(digest, 0) for digest in manifest.digests())
    return SavedSnapshot(manifest.snapshot_id, manifest.kind, manifest.owner, manifest.session_id or "",
                         len(manifest.token_ids), manifest.policy, manifest.ttl_s, manifest.created_at, stored)


def _info(manifest: Manifest) -> SnapshotInfo:
    return SnapshotInfo(manifest.snapshot_id, manifest.session_id or "", len(manifest.token_ids),
                        manifest.num_computed, manifest.page_count(), manifest.created_at)
