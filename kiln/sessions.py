"""SessionStore: server-issued sessions over append-only token histories whose K/V stays in pages.

Each session owns one Sequence. Appends add tokens only; a generate prefills just the tokens whose K/V
is missing and its output joins the history. Sessions are visible only to the owner that created them
(an API key, or None in process): to anyone else a session does not exist. A session ends only by
close, its idle TTL or the `max_sessions` cap (least recently used first), each counted by reason.
Memory pressure never ends one: the engine may drop an idle session's K/V, never its history, and the
next turn recomputes what is missing. Invariants are checked after every mutation; a violation fails
that session only (its history is still saved, without K/V, so the next process gets it back).

With persistence (kiln/snapshots/persistence.py) the store owns live state and hands Persistence
captures; Persistence never calls back. Every change (creation, append, fork, a turn's end) is captured
by the thread that made it and queued before the change is acknowledged (see Persistence's durability
rule); eviction captures the session whole and queues it before its pages go; a call on an evicted (or,
after a restart, unknown) id brings it back from its queued capture or snapshot; close deletes the
snapshot first and ends the session only if that worked (else UnavailableError, nothing changed).
A session live here is leased to this process in the store (kiln/snapshots/ownership.py), taken before it
comes to life (create, fork, restore, revive; FailedPreconditionError if another server holds it) and
handed off after its last save; a session whose lease was lost is dropped here at its next call
(FailedPreconditionError: it moved to another server).

Locks (docs/architecture.md § Locks): the store lock guards the session table and is held for
bookkeeping only; the lock order is store, then engine. Whatever is slow happens outside it on a session
its thread has claimed (`busy`): copying pages out (capture), loading a revived session, deleting a
snapshot, compiling a grammar, an eviction's capture. Another call on that same session waits for it;
calls on other sessions never do. Ids being revived or evicted are in transit: callers of that id wait,
so two callers never both revive it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kiln.config import EngineConfig
from kiln.engine.engine import Engine
from kiln.engine.sampler import SamplingParams
from kiln.engine.sequence import Event, FinishEvent, Request, Sequence
from kiln.engine.stream import BaseStream, GenerationStream
from kiln.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolation,
    KilnError,
    LeaseLostError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.kv.image import KVImage
from kiln.kv.policy import KVPolicy
from kiln.results import LiveSession, OwnerUsage, SessionInfo, SessionTurn, Usage
from kiln.snapshots.manifest import SNAPSHOT_ID
from kiln.snapshots.persistence import Known, MissingPagesError, Persistence, SessionCapture, StoredSession

logger = logging.getLogger(__name__)

MIN_TTL_S = 1.0  # shorter, a session could expire before its creator's next call
MAX_TTL_S = 30 * 86400.0
TOMBSTONES = 10_000  # ids of ended sessions remembered to explain a NOT_FOUND
STOP_WAIT_S = 30.0  # how long close waits for the session's cancelled generate to end
KEEPER_PERIOD_S = 5.0  # the keeper's pace when nothing wakes it
TURNS_KEPT = 64  # a session's last turns, for the dashboard's drill-down
TURN_CHECK_S = 0.05  # how often a generate waiting for its turn checks that its caller is still there


@dataclass
class _Session:
    session_id: str
    owner: str | None
    seq: Sequence
    ttl_s: float
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    active: Request | None = None
    busy: bool = False  # a thread works on it outside the store lock; other calls on it wait
    waiting: deque[BaseStream] = field(default_factory=deque)  # generates waiting for their turn, first first
    closed: bool = False
    failure: InvariantViolation | None = None
    last_usage: Usage | None = None
    history_mark: int = 0  # INV-2: the history never gets shorter
    violations: int = 0  # INV-1/INV-2 violations found on it (SessionInfo.invariant_violations)
    turns: deque[SessionTurn] = field(default_factory=lambda: deque(maxlen=TURNS_KEPT))


class SessionStore:
    def __init__(self, engine: Engine, max_sessions: int, ttl_s: float, persistence: Persistence | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.persistence = persistence
        self.durable_turns = bool(getattr(engine.config, "durable_turns", False))
        self.generate_wait_s = float(getattr(engine.config, "generate_wait_s", EngineConfig.generate_wait_s))
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, tuple[str | None, str]] = OrderedDict()  # id -> (owner, why it ended)
        self._transit: set[str] = set()  # ids being revived or leaving memory
        self.evictions: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()  # created / closed / evicted / failed
        self.invariant_violations: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)  # a session went idle, unbusy or out of transit
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None
        if persistence is not None:
            self._keeper = threading.Thread(target=self._keep_up, name="kiln-session-keeper", daemon=True)
            self._keeper.start()

    # ---- lifecycle --------------------------------------------------------------------------------

    def create(
        self, tokens: list[int] | None = None, ttl_s: float | None = None, owner: str | None = None,
        kv_policy: str | None = None, kv_sink_tokens: int | None = None, kv_window_tokens: int | None = None,
    ) -> str:
        """A new session. The kv_* options override the engine's KV policy for this session's whole life
        (None: the engine's setting); there is no call that switches a live session's policy, since its
        K/V depends on it: a forked session inherits its parent's."""
        ids = list(tokens) if tokens is not None else []
        self._check_length(len(ids))  # before looking at each id: a huge request is refused cheaply
        ids = self.engine.validate_tokens(ids)
        ttl = self._check_ttl(ttl_s)
        policy = self.engine.policy(kv_policy, kv_sink_tokens, kv_window_tokens)
        with self._owned_new() as session_id, self._locked() as leaving:
            self._make_room(leaving)
            session = self._add(self.engine.new_sequence(ids, session=True, policy=policy), ttl, owner, session_id)
        return self._persisted(session)

    def fork(self, session_id: str, at: int | None = None, owner: str | None = None) -> str:
        """A new session whose history is the first `at` tokens (default: all) of this one; it shares
        the pages of those tokens (copy-on-write: shared pages are full and never written)."""
        with self._owned_new() as child_id, self._locked() as leaving:
            parent = self._session(leaving, session_id, owner, idle=True)
            length = len(parent.seq.tokens)
            at = length if at is None else at
            if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= length:
                raise InvalidArgumentError(f"fork position must be in [0, {length}], got {at!r}")
            self._make_room(leaving, keep=parent)
            self._touch(parent)
            child = self._add(self.engine.fork_sequence(parent.seq, at), parent.ttl_s, owner, child_id)
        return self._persisted(child)

    def close(self, session_id: str, owner: str | None = None) -> None:
        """End the session for good. With persistence its snapshot is deleted first: if that fails, the
        session stays as it was and UnavailableError says to retry."""
        with self._locked() as leaving:
            session = self._session(leaving, session_id, owner)
            if self.persistence is None:
                self._close(session, "closed")
                return
            session = self._claim_quiet(leaving, session, session_id, owner)
        try:
            self.persistence.delete_session(session_id)
        except BaseException as error:
            self._unclaim(session)
            if isinstance(error, LeaseLostError):
                raise FailedPreconditionError(f"session {session_id} moved to another server; close it there") from error
            if isinstance(error, KilnError):
                raise UnavailableError(f"session {session_id} was not closed, deleting its snapshot failed "
                                       f"(retry the close): {error}") from error
            raise
        with self.lock:
            session.busy = False
            if not session.closed:
                self._close(session, "closed")
            self._changed.notify_all()

    def _claim_quiet(self, leaving: list[_Session], session: _Session, session_id: str, owner: str | None) -> _Session:
        """Claim a session (returned) once its generate (cancelled here) has ended and no other call works
        on it."""
        deadline = time.monotonic() + STOP_WAIT_S
        while session.active is not None or session.busy:
            if session.active is not None:
                self.engine.cancel(session.active)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(f"session {session_id} is still busy after {STOP_WAIT_S:.0f} s; nothing was closed")
            self._changed.wait(remaining)
            session = self._session(leaving, session_id, owner)  # NotFoundError if it ended meanwhile
        session.busy = True
        return session

    def _close(self, session: _Session, why: str) -> None:
        self._end(session, why)
        self.engine.release_sequence(session.seq)  # at once, or when its request ends
        if session.active is not None:
            self.engine.cancel(session.active)
        self.outcomes["closed"] += 1

    # ---- history and generation -------------------------------------------------------------------

    def append(self, session_id: str, token_ids: list[int], owner: str | None = None) -> int:
        """Add tokens to the history (no compute yet: the next generate prefills them). Returns the new
        history length."""
        ids = list(token_ids)
        if not ids:
            raise InvalidArgumentError("append needs at least one token id")
        self._check_length(len(ids))  # before looking at each id: a huge request is refused cheaply
        ids = self.engine.validate_tokens(ids)
        with self._locked() as leaving:
            session = self._session(leaving, session_id, owner, idle=True)
            self._check_length(len(session.seq.tokens) + len(ids))
            self.engine.append(session.seq, ids)
            self._touch(session)
            self._check(session)
            session.busy = self.persistence is not None
            length = len(session.seq.tokens)
        self._persisted(session)
        return length

    def generate(
        self, session_id: str, params: SamplingParams, owner: str | None = None, stream: BaseStream | None = None,
        caller: str | None = None, *, deadline: float | None = None,
        admit: Callable[[Callable[[], BaseStream]], BaseStream] | None = None,
    ) -> BaseStream:
        """Start a generation that continues the history; its tokens join the history as they commit.
        Events go to `stream` (an AsyncGenerationStream for asyncio callers), by default a new
        GenerationStream; `caller` is whose share of the batch slots it takes (Engine.submit).

        A session runs one generate at a time, in arrival order: this one first waits for those ahead of
        it (one whose caller left is cancelled, so it ends within an engine step), until `deadline` (a
        time.monotonic() instant: the caller's) or `generate_wait_s`, whichever comes first; then
        DeadlineExceededError or FailedPreconditionError. A `stream` cancelled meanwhile (its caller
        left) leaves the queue with CancelledError. Its turn come, the session is claimed while
        `admit(start)` (default: start()) may still refuse it (per-key quotas) and a constraint is
        compiled, both outside the store lock."""
        stream = stream or GenerationStream(self.engine.cancel)
        with self._locked() as leaving:
            session = self._turn(leaving, session_id, owner, stream, deadline)
            length = len(session.seq.tokens)
            policy = self.engine.sequence_kv(session.seq).policy if params.constraint is not None else None
        try:
            if policy is not None:
                self.engine.check_request(length, params, policy)
            return (admit or _run)(lambda: self._start(session, params, stream, caller))
        finally:
            self._unclaim(session)

    def _turn(self, leaving: list[_Session], session_id: str, owner: str | None, stream: BaseStream,
              deadline: float | None) -> _Session:
        """The session, claimed, once `stream`'s generate is first in its queue and nothing else runs on
        it (see generate). Queued generates keep a session from eviction (`_idle`)."""
        limit = time.monotonic() + self.generate_wait_s
        session = self._session(leaving, session_id, owner)
        session.waiting.append(stream)
        try:
            while session.active is not None or session.busy or self._next_turn(session) is not stream:
                if stream.cancel_requested:
                    raise CancelledError("the generate's caller left while it waited for the session's turn")
                self._wait_for_turn(session, owner, limit, deadline)
            return self._session(leaving, session_id, owner, claim=True)
        finally:
            if stream in session.waiting:
                session.waiting.remove(stream)
            self._changed.notify_all()  # the next in line may go, or be refused

    def settled(self, session_id: str, owner: str | None = None, deadline: float | None = None) -> list[int]:
        """The history once no generate runs or waits on the session: a named chat session's next turn
        reads it after its previous reply ended. Waits as a generate waits for its turn (see generate)."""
        limit = time.monotonic() + self.generate_wait_s
        with self._locked() as leaving:
            session = self._session(leaving, session_id, owner)
            while session.active is not None or session.busy or session.waiting:
                self._wait_for_turn(session, owner, limit, deadline)
                session = self._session(leaving, session_id, owner)
            return list(session.seq.tokens)

    def _wait_for_turn(self, session: _Session, owner: str | None, limit: float, deadline: float | None) -> None:
        """One wait (store lock held) for a busy session, refused once `deadline` or `limit` has passed."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise DeadlineExceededError(
                f"session {session.session_id} was still busy with an earlier generate at the call's deadline")
        if now >= limit:
            raise FailedPreconditionError(f"session {session.session_id} still had a generate in flight after "
                                          f"{self.generate_wait_s:g} s (the server's generate_wait_s)")
        self._changed.wait(min(TURN_CHECK_S, limit - now, (limit if deadline is None else deadline) - now))
        if session.closed:
            raise NotFoundError(f"session {_shown(session.session_id)} "
                                f"{self._ended.get(session.session_id, (owner, 'closed'))[1]}")

    def _start(self, session: _Session, params: SamplingParams, stream: BaseStream, caller: str | None) -> BaseStream:
        """Submit the generate of a session the calling thread claimed for it."""
        with self.lock:
            if session.closed:  # closing does not wait for a claim without persistence
                raise NotFoundError(f"session {session.session_id} {self._ended.get(session.session_id, (None, 'closed'))[1]}")
            stream.request = self.engine.submit(session.seq, params, self._on_event(session, stream.emit), caller)
            session.active = stream.request
            self._touch(session)
        return stream

    def _on_event(self, session: _Session, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:  # engine thread, engine lock not held
            if isinstance(event, FinishEvent):
                self._end_turn(session, event, emit)
            else:
                emit(event)

        return on_event

    def _end_turn(self, session: _Session, event: FinishEvent, emit: Callable[[Event], None]) -> None:
        """A generate ended (engine thread): check the session, capture and queue it while its request
        still holds it (no other call can change it), then free it and send the finish (under
        durable_turns, once the turn is saved)."""
        with self.lock:
            live = not session.closed
            if live and session.failure is None and (violation := self._check(session)) is not None:
                event = FinishEvent("error", event.usage, error=violation)
        finish = _Finish(emit, event) if live and self.durable_turns and self.persistence is not None else None
        try:
            if live:
                self._persist(session, finish.saved if finish else None)
        except Exception as error:  # a bug queueing the save must not cost the caller its finish event
            logger.exception("queueing the save of session %s failed", session.session_id)
            if finish is not None:
                finish.saved(error)
        finally:
            with self.lock:
                if session.active is not None:
                    session.turns.append(_turn(session.active, event.usage))
                session.active = None
                session.last_usage = event.usage
                self._touch(session)
                self._changed.notify_all()
        if finish is not None:
            finish.idle()
        else:
            emit(event)

    def tokens(self, session_id: str, owner: str | None = None) -> list[int]:
        with self._locked() as leaving:
            return list(self._session(leaving, session_id, owner).seq.tokens)

    def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        """Its info; a failed session's too (its invariant violations), which every other call refuses."""
        with self._locked() as leaving:
            return self._info(self._session(leaving, session_id, owner, failed=True))

    def list(self, owner: str | None = None) -> list[SessionInfo]:
        """The owner's sessions in memory, then (with persistence) those that are not: evicted, or saved
        before a restart, each brought back by its next use (`resident` False, no K/V resident)."""
        with self._locked() as leaving:
            self._expire(leaving)
            live = [self._info(s) for s in self._sessions.values() if s.owner == owner]
            listed = {info.session_id for info in live}
        if self.persistence is None:
            return live
        stored = [self._stored_info(s) for s in self.persistence.sessions(owner) if s.session_id not in listed]
        return live + stored

    def survey(self, owner: str | None = None, *, everyone: bool = False) -> list[LiveSession]:
        """The sessions in memory (`owner`'s, or everyone's), with owners and last turns: the dashboard's
        table. The store lock is held only to copy the table; each session's K/V figures then take the
        engine lock briefly, one session at a time, so a survey of thousands never stalls a step."""
        with self.lock:  # the turns are copied under it: the engine thread appends to them under it
            sessions = [(s, tuple(s.turns)) for s in self._sessions.values() if everyone or s.owner == owner]
        return [LiveSession(s.owner, self._info(s), turns, s.failure is not None) for s, turns in sessions]

    def owner_usage(self, owner: str | None) -> OwnerUsage:
        """How many live sessions `owner` has and the bytes of their resident pages (per-key quotas)."""
        with self.lock:
            seqs = [s.seq for s in self._sessions.values() if s.owner == owner]
        return OwnerUsage(len(seqs), sum(self.engine.sequence_kv(seq).resident_bytes for seq in seqs))

    def close_all(self) -> None:
        """Release every session (server shutdown); each counts as closed. With persistence every change
        was queued when it was made: a session whose queued capture went stale is captured whole again,
        and every queued save is finished before this returns."""
        self._stopped.set()
        if self.persistence is not None:
            self.persistence.wake()
        with self.lock:
            deadline = time.monotonic() + STOP_WAIT_S
            while any(s.busy for s in self._sessions.values()) and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            ending = list(self._sessions.values())
            for session in ending:
                self._end(session, "closed (server shutdown)")
                self.outcomes["closed"] += 1
        stale = set(self.persistence.stale_sessions()) if self.persistence is not None else set()
        for session in ending:
            if session.session_id in stale and session.active is None:
                self._submit(session, Known.nothing(), final=True)
            self.engine.release_sequence(session.seq)
            if session.active is not None:
                self.engine.cancel(session.active)
        if self.persistence is not None:
            self.persistence.flush()

    @property
    def closing(self) -> bool:
        """Whether `close_all` has begun (it waits for calls working on a session to finish)."""
        return self._stopped.is_set()

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- checkpoints (kiln/snapshots) -------------------------------------------------------------

    def snapshot(self, session_id: str, owner: str | None = None) -> str:
        """A checkpoint of an idle session; returns its id once it is durable."""
        persistence = self._snapshots()
        with self._locked() as leaving:
            session = self._session(leaving, session_id, owner, idle=True, claim=True)
        try:
            try:
                return persistence.checkpoint(self._capture(session, persistence.known(session_id)))
            except MissingPagesError:  # the memo of the lost pages is forgotten: this capture copies them
                return persistence.checkpoint(self._capture(session, persistence.known(session_id)))
        finally:
            self._unclaim(session)

    def restore(self, snapshot_id: str, owner: str | None = None) -> str:
        """A new session (new id, this owner) with a checkpoint's history and K/V; returns its id."""
        return self.adopt(self._snapshots().open_checkpoint(snapshot_id, owner))

    def capture(self, session_id: str, owner: str | None = None, known: Known | None = None) -> SessionCapture:
        """A copy of an idle session's history and K/V, complete unless `known` (Persistence.known) names
        pages saved before (tools and benchmarks)."""
        with self._locked() as leaving:
            session = self._session(leaving, session_id, owner, idle=True, claim=True)
        try:
            capture = self._capture(session, known or Known.nothing())
        finally:
            self._unclaim(session)
        if capture is None:
            raise FailedPreconditionError(f"session {session_id} has no history to capture")
        return capture

    def adopt(self, capture: SessionCapture) -> str:
        """A new session (new id, the capture's owner) holding a capture's history and K/V."""
        seq = self.engine.load_sequence(capture.image)
        try:
            with self._owned_new() as session_id, self._locked() as leaving:
                self._make_room(leaving)
                session = self._add(seq, capture.ttl_s, capture.owner, session_id)
        except BaseException:
            self.engine.release_sequence(seq)
            raise
        return self._persisted(session)

    @contextmanager
    def _owned_new(self) -> Iterator[str]:
        """A fresh session id, leased to this process (with persistence) before the session exists; the
        lease goes back if the session is not made."""
        session_id = secrets.token_urlsafe(16)
        if self.persistence is None:
            yield session_id
            return
        self.persistence.ownership.acquire(session_id)
        try:
            yield session_id
        except BaseException:
            self.persistence.ownership.release(session_id)
            raise

    def _snapshots(self) -> Persistence:
        if self.persistence is None:
            raise FailedPreconditionError("snapshots are off: set snapshot_dir or snapshot_store")
        return self.persistence

    # ---- eviction ---------------------------------------------------------------------------------

    def expire(self) -> int:
        """Evict idle sessions past their TTL; returns how many."""
        with self._locked() as leaving:
            return self._expire(leaving)

    def _expire(self, leaving: list[_Session]) -> int:
        now = self._clock()
        expired = [s for s in self._sessions.values() if self._idle(s) and now - s.last_used > s.ttl_s]
        for session in expired:
            self._evict(session, "ttl", leaving)
        return len(expired)

    def _make_room(self, leaving: list[_Session], keep: _Session | None = None) -> None:
        self._expire(leaving)
        while len(self._sessions) >= self.max_sessions:
            victim = next((s for s in self._sessions.values() if self._idle(s) and s is not keep), None)
            if victim is None:
                raise ResourceExhaustedError(f"{self.max_sessions} sessions are live and none is idle")
            self._evict(victim, "lru", leaving)

    def _evict(self, session: _Session, reason: str, leaving: list[_Session]) -> None:
        """Select: the session leaves the table now (under the lock); its capture and the release of its
        pages happen after the lock is released (`_leave`), its id in transit meanwhile."""
        self._end(session, f"evicted ({'idle ttl' if reason == 'ttl' else reason})")
        self.evictions[reason] += 1
        self.outcomes["evicted"] += 1
        if self.persistence is not None:
            self._transit.add(session.session_id)
        leaving.append(session)

    def _leave(self, session: _Session) -> None:
        """Outside the lock: an evicted session's whole capture is queued, then its pages go back."""
        try:
            if self.persistence is not None:
                self._submit(session, Known.nothing(), final=True)
        finally:
            self.engine.release_sequence(session.seq)
            with self.lock:
                self._transit.discard(session.session_id)
                self._changed.notify_all()

    @classmethod
    def _idle(cls, session: _Session) -> bool:
        return session.active is None and not session.busy and cls._next_turn(session) is None

    @staticmethod
    def _next_turn(session: _Session) -> BaseStream | None:
        """The first generate waiting on the session whose caller is still there; those that left are
        dropped (store lock held)."""
        while session.waiting and session.waiting[0].cancel_requested:
            session.waiting.popleft()
        return session.waiting[0] if session.waiting else None

    # ---- finding a session ------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[list[_Session]]:
        """The store lock, held for bookkeeping; sessions evicted meanwhile (the list) leave memory
        once it is released."""
        leaving: list[_Session] = []
        try:
            with self.lock:
                yield leaving
        finally:
            for session in leaving:
                self._leave(session)

    def _session(self, leaving: list[_Session], session_id: str, owner: str | None, *, idle: bool = False,
                 claim: bool = False, failed: bool = False) -> _Session:
        """The live session of an id, brought back from persistence if it is not in memory. Called with
        the store lock held once; it may release it meanwhile (waiting for a session in transit or busy,
        loading a revived one). `idle`: no generate running or waiting its turn, else FailedPreconditionError,
        except one whose caller left (cancelled): that one ends within an engine step, so it is waited for,
        as are calls working on it; `claim`: mark it busy for the caller (`_unclaim` when done); `failed`:
        a session an invariant violation failed is returned too (else FailedPreconditionError)."""
        while True:
            self._expire(leaving)
            session = self._sessions.get(session_id) if isinstance(session_id, str) else None
            if session is None and isinstance(session_id, str) and session_id not in self._transit:
                session = self._revive(leaving, session_id, owner)
            if session is None and isinstance(session_id, str) and session_id in self._transit:
                if not self._leave_now(leaving, session_id):
                    self._changed.wait()
                continue
            if session is None or session.owner != owner:
                ended = self._ended.get(session_id) if session is None and isinstance(session_id, str) else None
                why = ended[1] if ended is not None and ended[0] == owner else "does not exist"  # others learn nothing
                raise NotFoundError(f"session {_shown(session_id)} {why}")
            if self.persistence is not None and self.persistence.ownership.lost(session_id) and not session.busy:
                self._end(session, "moved to another server")
                self.engine.release_sequence(session.seq)
                raise FailedPreconditionError(f"session {session_id} moved to another server (this one lost its lease)")
            if session.failure is not None and not failed:
                raise FailedPreconditionError(f"session {session_id} failed: {session.failure}")
            if idle and (self._next_turn(session) is not None
                         or (session.active is not None and not session.active.cancelled.is_set())):
                raise FailedPreconditionError(f"session {session_id} already has a generate in flight")
            if (idle or claim) and (session.busy or (idle and session.active is not None)):
                self._changed.wait()
                continue
            session.busy = session.busy or claim
            return session

    def _leave_now(self, leaving: list[_Session], session_id: str) -> bool:
        """If this very thread evicted the session (it is in `leaving`: its TTL ran out as the call came),
        it leaves memory now, the lock released meanwhile; waiting for it would wait forever for ourselves.
        False if another thread's eviction or revival has it in transit."""
        mine = next((session for session in leaving if session.session_id == session_id), None)
        if mine is None:
            return False
        leaving.remove(mine)
        self.lock.release()
        try:
            self._leave(mine)
        finally:
            self.lock.acquire()
        return True

    def _revive(self, leaving: list[_Session], session_id: str, owner: str | None) -> _Session | None:
        """An evicted or pre-restart session back from its queued capture or snapshot, under its own
        id; None if it has none (or is another owner's, or was closed). The load runs without the store
        lock, the id in transit."""
        ended = self._ended.get(session_id)
        if self.persistence is None or self._stopped.is_set() or (ended is not None and ended[1] == "closed"):
            return None
        self._transit.add(session_id)
        self.lock.release()
        try:
            capture = self._load_owned(session_id, owner)
            seq = self.engine.load_sequence(capture.image) if capture is not None else None
        finally:
            self.lock.acquire()
            self._transit.discard(session_id)
            self._changed.notify_all()
        if capture is None or seq is None:
            return None
        try:
            self._make_room(leaving)
        except BaseException:
            self.engine.release_sequence(seq)
            raise
        self._ended.pop(session_id, None)
        return self._add(seq, capture.ttl_s, owner, session_id, capture.created_at, claim=False)

    def _load_owned(self, session_id: str, owner: str | None) -> SessionCapture | None:
        """Lease the session to this process, then load it (the last owner handed it off after its final
        save, so the load is its newest state); the lease goes back if there is nothing to load."""
        assert self.persistence is not None
        if not SNAPSHOT_ID.fullmatch(session_id):
            return None
        ownership = self.persistence.ownership
        ownership.acquire(session_id)
        try:
            capture = self.persistence.load(session_id, owner)
        except BaseException:
            ownership.release(session_id)
            raise
        if capture is None:
            ownership.release(session_id)
        return capture

    def _unclaim(self, session: _Session) -> None:
        with self.lock:
            session.busy = False
            self._changed.notify_all()

    # ---- persistence (kiln/snapshots) -------------------------------------------------------------

    def _persisted(self, session: _Session) -> str:
        """A new or changed session its thread has claimed: queue its capture (outside the lock), free
        it; raise its invariant violation, if any, once its history is safe. Returns its id."""
        try:
            self._persist(session)
        finally:
            if self.persistence is not None:
                self._unclaim(session)
        if session.failure is not None:
            raise session.failure
        return session.session_id

    def _persist(self, session: _Session, on_saved: Callable[[Exception | None], None] | None = None) -> None:
        """Capture a session its thread owns and queue the capture (`on_saved` is told when it is saved)."""
        if self.persistence is None:
            if on_saved is not None:
                on_saved(None)
            return
        self._submit(session, self.persistence.known(session.session_id), on_saved=on_saved)

    def _submit(self, session: _Session, known: Known, *, final: bool = False,
                on_saved: Callable[[Exception | None], None] | None = None) -> None:
        assert self.persistence is not None
        try:
            capture = self._capture(session, known)
        except KilnError as error:  # its previous capture stays queued or saved
            logger.warning("capturing session %s failed: %s", session.session_id, error)
            capture = None
            if on_saved is not None:
                on_saved(error)
                return
        if capture is not None:
            self.persistence.submit(capture, final=final, on_saved=on_saved)
        elif on_saved is not None:
            on_saved(None)

    def _capture(self, session: _Session, known: Known) -> SessionCapture | None:
        """The session's history and K/V. A failed session's K/V is suspect: its history alone (K/V
        recomputed on restore), unless the failure is a history that shrank (then nothing: the last
        good snapshot stays)."""
        if session.failure is None:
            image = self.engine.capture_sequence(session.seq, known.pages)
        elif session.failure.kind == "inv2":
            return None
        else:
            known = Known.nothing()
            policy = self.engine.sequence_kv(session.seq).policy
            image = KVImage(list(session.seq.tokens), 0, policy, [[] for _ in self.engine.kv_layout.groups], {})
        return SessionCapture(session.session_id, session.owner, session.ttl_s, session.created_at, image, known)

    def _keep_up(self) -> None:
        """The keeper thread: captures again, whole, an idle session whose queued capture names pages
        the store lost (a missing blob), so its save goes through without waiting for its next turn."""
        assert self.persistence is not None
        while not self._stopped.is_set():
            self.persistence.wait_for_stale(KEEPER_PERIOD_S)
            for session_id in self.persistence.stale_sessions():
                with self.lock:
                    session = self._sessions.get(session_id)
                    if session is None or not self._idle(session):
                        continue  # its next change or its eviction captures it
                    session.busy = True
                try:
                    self._persist(session)
                finally:
                    self._unclaim(session)

    # ---- internals --------------------------------------------------------------------------------

    def _add(self, seq: Sequence, ttl_s: float, owner: str | None, session_id: str | None = None,
             created_at: float | None = None, claim: bool = True) -> _Session:
        """A new live session, claimed for its first capture when persistence is on (`_persisted`);
        an invariant violation is recorded on it (the caller raises it)."""
        session = _Session(session_id or secrets.token_urlsafe(16), owner, seq, ttl_s, last_used=self._clock())
        seq.owner = owner  # the scheduler's fair share of the pool is per owner
        seq.session_id = session.session_id
        if created_at is not None:
            session.created_at = created_at
        session.history_mark = len(seq.tokens)
        session.busy = claim and self.persistence is not None
        self._sessions[session.session_id] = session
        self.outcomes["created"] += 1
        self._check(session)
        return session

    def _end(self, session: _Session, why: str) -> None:
        session.closed = True
        del self._sessions[session.session_id]
        self._ended[session.session_id] = (session.owner, why)
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)

    def _touch(self, session: _Session) -> None:
        session.last_used = self._clock()
        if session.session_id in self._sessions:
            self._sessions.move_to_end(session.session_id)

    def _check(self, session: _Session) -> InvariantViolation | None:
        """INV-1 (tokens and K/V agree) and INV-2 (the history only grows); a violation fails the
        session and is counted by kind, and returned (the caller raises it once the history is safe)."""
        try:
            if len(session.seq.tokens) < session.history_mark:
                raise InvariantViolation("inv2", f"history shrank from {session.history_mark} to {len(session.seq.tokens)}")
            self.engine.check_sequence(session.seq)
        except InvariantViolation as violation:
            self.invariant_violations[violation.kind] += 1
            session.violations += 1
            self.outcomes["failed"] += 1
            session.failure = violation
            return violation
        session.history_mark = len(session.seq.tokens)
        return None

    def _check_length(self, length: int) -> None:
        if length >= self.engine.max_model_len:
            raise InvalidArgumentError(
                f"a history of {length} tokens leaves no room in the model's context of {self.engine.max_model_len}"
            )

    def _check_ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return self.ttl_s
        if not isinstance(ttl_s, int | float) or not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise InvalidArgumentError(f"ttl_s must be in [1 s, 30 days], got {ttl_s!r}", "ttl_s")
        return float(ttl_s)

    def _info(self, session: _Session) -> SessionInfo:
        usage = session.last_usage
        kv = self.engine.sequence_kv(session.seq)
        saved = self.persistence.status(session.session_id) if self.persistence is not None else None
        return SessionInfo(
            session_id=session.session_id,
            history_tokens=len(session.seq.tokens),
            computed_tokens=kv.resident_tokens,
            resident_pages=kv.resident_pages,
            resident_kv_bytes=kv.resident_bytes,
            reused_tokens=usage.reused_tokens if usage else 0,
            last_prefill_tokens=usage.prefilled_tokens if usage else 0,
            generating=session.active is not None,
            created_at=session.created_at,
            idle_s=self._clock() - session.last_used,
            ttl_s=session.ttl_s,
            kv_policy=kv.policy.name,
            kv_sink_tokens=kv.policy.sink_tokens,
            kv_window_tokens=kv.policy.window_tokens,
            global_kv_bytes=kv.global_bytes,
            forgotten_tokens=kv.forgotten_tokens,
            invariant_violations=session.violations,
            kv_bytes_per_token=float(self.engine.kv_bytes_per_token),
            tier_bytes_per_token=self.engine.tier_bytes_per_token,
            host_tier_bytes=kv.tier_bytes["host"],
            disk_tier_bytes=kv.tier_bytes["disk"],
            unsaved_changes=saved.unsaved_changes if saved else False,
            last_saved_at=saved.last_saved_at if saved else None,
            save_failures=saved.save_failures if saved else 0,
        )


    def _stored_info(self, stored: StoredSession) -> SessionInfo:
        name, _, sizes = stored.policy.partition(":")
        sink, _, window = sizes.partition(":")
        return SessionInfo(
            session_id=stored.session_id,
            history_tokens=stored.history_tokens,
            computed_tokens=0,
            resident_pages=0,
            resident_kv_bytes=0,
            reused_tokens=0,
            last_prefill_tokens=0,
            generating=False,
            created_at=stored.created_at,
            idle_s=stored.idle_s,
            ttl_s=stored.ttl_s,
            kv_policy=name,
            kv_sink_tokens=int(sink or 0),
            kv_window_tokens=int(window or 0),
            forgotten_tokens=KVPolicy(name, int(sink or 0), int(window or 0)).forgotten(
                stored.history_tokens, self.engine.kv_format.page_size),
            kv_bytes_per_token=float(self.engine.kv_bytes_per_token),
            tier_bytes_per_token=self.engine.tier_bytes_per_token,
            unsaved_changes=stored.last_saved_at is None,
            last_saved_at=stored.last_saved_at,
            resident=False,
        )


class _Finish:
    """A turn's finish under durable_turns: sent once the turn is saved and its session is free for the
    next call, whichever comes last. A failed save sends an error finish (the tokens are in the history;
    the saver keeps retrying)."""

    def __init__(self, emit: Callable[[Event], None], event: FinishEvent) -> None:
        self._emit = emit
        self._event = event
        self._lock = threading.Lock()
        self._waiting = 2

    def saved(self, error: Exception | None) -> None:
        if error is not None:
            self._event = FinishEvent("error", self._event.usage, error=UnavailableError(
                f"the turn is in the session's history but its save failed (retried in the background): {error}"))
        self._arrive()

    def idle(self) -> None:
        self._arrive()

    def _arrive(self) -> None:
        with self._lock:
            self._waiting -= 1
            ready = self._waiting == 0
        if ready:
            self._emit(self._event)


def _turn(request: Request, usage: Usage) -> SessionTurn:
    ended = time.perf_counter()
    first = request.first_token_at
    return SessionTurn(time.time(), usage.prefilled_tokens, usage.reused_tokens, usage.generated_tokens,
                       None if first is None else first - request.submitted_at, ended - request.submitted_at)


def _run(start: Callable[[], BaseStream]) -> BaseStream:
    """A generate's admission when the caller has none to add."""
    return start()


def _shown(session_id: object, limit: int = 64) -> str:
    """A session id as error messages quote it: never echo kilobytes of a malformed id back."""
    text = repr(session_id)
    return text if len(text) <= limit else text[: limit - 3] + "..."
