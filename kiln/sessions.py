"""SessionStore: server-issued sessions over append-only token histories whose K/V stays in pages.

Each session owns one Sequence. Appends add tokens only; a generate prefills just the tokens whose K/V
is missing and its output joins the history. Sessions are visible only to the owner that created them
(an API key, or None in process): to anyone else a session does not exist. A session ends only by
close, its idle TTL or the `max_sessions` cap (least recently used first), each counted by reason.
Memory pressure never ends one: the engine may drop an idle session's K/V, never its history, and the
next turn recomputes what is missing. Invariants are checked after every mutation; a violation fails
that session only. With persistence (kiln/snapshots) every change is saved in the background, eviction
saves the session before freeing it, and a call on an evicted (or, after a restart, unknown) id
restores it from its snapshot: only close ends a persisted session for good.

The store has its own lock, held for session bookkeeping only; pages belong to the engine, reached
through its session-facing operations (lock order: store, then engine).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.engine import Engine
from kiln.engine.sampler import SamplingParams
from kiln.engine.sequence import Event, FinishEvent, Request, Sequence
from kiln.engine.stream import BaseStream, GenerationStream
from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolation,
    KilnError,
    NotFoundError,
    ResourceExhaustedError,
)
from kiln.kv.image import PageKey
from kiln.results import SessionInfo, Usage
from kiln.snapshots.persistence import Persistence, SessionCapture

logger = logging.getLogger(__name__)

MIN_TTL_S = 1.0  # shorter, a session could expire before its creator's next call
MAX_TTL_S = 30 * 86400.0
TOMBSTONES = 10_000  # ids of ended sessions remembered to explain a NOT_FOUND


@dataclass
class _Session:
    session_id: str
    owner: str | None
    seq: Sequence
    ttl_s: float
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    active: Request | None = None
    closed: bool = False
    failure: InvariantViolation | None = None
    last_usage: Usage | None = None
    history_mark: int = 0  # INV-2: the history never gets shorter


class SessionStore:
    def __init__(self, engine: Engine, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, tuple[str | None, str]] = OrderedDict()  # id -> (owner, why it ended)
        self.evictions: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()  # created / closed / evicted / failed
        self.invariant_violations: Counter[str] = Counter()
        self.lock = threading.RLock()
        self.persistence: Persistence | None = None  # set by the LLM when snapshots are on

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
        with self.lock:
            self.expire()
            self._make_room()
            return self._add(self.engine.new_sequence(ids, session=True, policy=policy), ttl, owner).session_id

    def fork(self, session_id: str, at: int | None = None, owner: str | None = None) -> str:
        """A new session whose history is the first `at` tokens (default: all) of this one; it shares
        the pages of those tokens (copy-on-write: shared pages are full and never written)."""
        with self.lock:
            parent = self._get(session_id, owner, idle=True)
            length = len(parent.seq.tokens)
            at = length if at is None else at
            if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= length:
                raise InvalidArgumentError(f"fork position must be in [0, {length}], got {at!r}")
            self._make_room(keep=parent)
            self._touch(parent)
            return self._add(self.engine.fork_sequence(parent.seq, at), parent.ttl_s, owner).session_id

    def close(self, session_id: str, owner: str | None = None) -> None:
        with self.lock:
            session = self._get(session_id, owner)
            self._end(session, "closed")
            self.outcomes["closed"] += 1
            if self.persistence is not None:
                self.persistence.forget(session_id)

    # ---- history and generation -------------------------------------------------------------------

    def append(self, session_id: str, token_ids: list[int], owner: str | None = None) -> int:
        """Add tokens to the history (no compute yet: the next generate prefills them). Returns the new
        history length."""
        ids = list(token_ids)
        if not ids:
            raise InvalidArgumentError("append needs at least one token id")
        self._check_length(len(ids))  # before looking at each id: a huge request is refused cheaply
        ids = self.engine.validate_tokens(ids)
        with self.lock:
            session = self._get(session_id, owner, idle=True)
            self._check_length(len(session.seq.tokens) + len(ids))
            self.engine.append(session.seq, ids)
            self._touch(session)
            self._check(session)
            return len(session.seq.tokens)

    def generate(
        self, session_id: str, params: SamplingParams, owner: str | None = None, stream: BaseStream | None = None
    ) -> BaseStream:
        """Start a generation that continues the history; its tokens join the history as they commit.
        Events go to `stream` (an AsyncGenerationStream for asyncio callers), by default a new
        GenerationStream."""
        with self.lock:
            session = self._get(session_id, owner, idle=True)
            stream = stream or GenerationStream(self.engine.cancel)
            stream.request = self.engine.submit(session.seq, params, self._on_event(session, stream.emit))
            session.active = stream.request
            self._touch(session)
            return stream

    def _on_event(self, session: _Session, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:  # engine thread, engine lock not held
            if isinstance(event, FinishEvent):
                with self.lock:
                    session.active = None
                    session.last_usage = event.usage
                    self._touch(session)
                    if not session.closed:
                        try:
                            self._check(session)
                        except InvariantViolation as violation:
                            event = FinishEvent("error", event.usage, error=violation)
            emit(event)

        return on_event

    def tokens(self, session_id: str, owner: str | None = None) -> list[int]:
        with self.lock:
            return list(self._get(session_id, owner).seq.tokens)

    def info(self, session_id: str, owner: str | None = None) -> SessionInfo:
        with self.lock:
            return self._info(self._get(session_id, owner))

    def list(self, owner: str | None = None) -> list[SessionInfo]:
        with self.lock:
            self.expire()
            return [self._info(s) for s in self._sessions.values() if s.owner == owner]

    def close_all(self) -> None:
        """Release every session (server shutdown); each counts as closed. With persistence, each idle
        session is saved first, to come back after the restart (after the background saves queued so far,
        so an older capture of a session never lands after its final one)."""
        if self.persistence is not None:
            self.persistence.flush()  # without the store lock: the saver takes it to capture
        with self.lock:
            for session in list(self._sessions.values()):
                if self.persistence is not None and session.active is None and session.failure is None:
                    try:
                        self.persistence.save_now(self._capture(session, self.persistence.known(session.session_id)))
                    except KilnError as error:
                        logger.warning("saving session %s at shutdown failed: %s", session.session_id, error)
                self._end(session, "closed (server shutdown)")
                self.outcomes["closed"] += 1

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- eviction ---------------------------------------------------------------------------------

    def expire(self) -> int:
        """Evict idle sessions past their TTL; returns how many."""
        now = self._clock()
        expired = [s for s in self._sessions.values() if s.active is None and now - s.last_used > s.ttl_s]
        for session in expired:
            self._keep(session)
            self._end(session, "evicted (idle ttl)")
            self.evictions["ttl"] += 1
            self.outcomes["evicted"] += 1
        return len(expired)

    def _evict_lru(self, reason: str, keep: _Session | None = None) -> bool:
        for session in self._sessions.values():
            if session.active is None and session is not keep:
                self._keep(session)
                self._end(session, f"evicted ({reason})")
                self.evictions[reason] += 1
                self.outcomes["evicted"] += 1
                return True
        return False

    # ---- persistence (kiln/snapshots) -------------------------------------------------------------

    def capture(self, session_id: str, owner: str | None, known: dict[PageKey, int]) -> SessionCapture:
        """A copy of an idle session's history and K/V (for an explicit snapshot)."""
        with self.lock:
            return self._capture(self._get(session_id, owner, idle=True), known)

    def capture_idle(self, session_id: str, known: dict[PageKey, int]) -> SessionCapture | None:
        """The same for the background saver: None if the session is gone, failed or generating (its
        turn's end marks it again)."""
        with self.lock:
            session = self._sessions.get(session_id)
            if session is None or session.active is not None or session.failure is not None:
                return None
            return self._capture(session, known)

    def adopt(self, capture: SessionCapture) -> str:
        """A new session (new id, the capture's owner) holding a restored capture; returns its id."""
        with self.lock:
            self.expire()
            self._make_room()
            return self._add(self.engine.load_sequence(capture.image), capture.ttl_s, capture.owner).session_id

    def _capture(self, session: _Session, known: dict[PageKey, int]) -> SessionCapture:
        image = self.engine.capture_sequence(session.seq, known)
        return SessionCapture(session.session_id, session.owner, session.ttl_s, session.created_at, image)

    def _keep(self, session: _Session) -> None:
        """A session leaving memory by eviction: queue its save (a failed session is not kept)."""
        if self.persistence is not None and session.failure is None:
            self.persistence.keep(self._capture(session, {}))

    def _revive(self, session_id: str, owner: str | None) -> _Session | None:
        """An evicted or pre-restart session back from its snapshot, under its own id; None if it has
        none (or is another owner's, or was closed)."""
        ended = self._ended.get(session_id)
        if self.persistence is None or (ended is not None and ended[1] == "closed"):
            return None
        capture = self.persistence.load(session_id, owner)
        if capture is None:
            return None
        self._make_room()
        seq = self.engine.load_sequence(capture.image)
        self._ended.pop(session_id, None)
        return self._add(seq, capture.ttl_s, owner, session_id, capture.created_at)

    # ---- internals --------------------------------------------------------------------------------

    def _make_room(self, keep: _Session | None = None) -> None:
        while len(self._sessions) >= self.max_sessions:
            if not self._evict_lru("lru", keep=keep):
                raise ResourceExhaustedError(f"{self.max_sessions} sessions are live and none is idle")

    def _add(self, seq: Sequence, ttl_s: float, owner: str | None, session_id: str | None = None,
             created_at: float | None = None) -> _Session:
        session = _Session(session_id or secrets.token_urlsafe(16), owner, seq, ttl_s, last_used=self._clock())
        if created_at is not None:
            session.created_at = created_at
        session.history_mark = len(seq.tokens)
        self._sessions[session.session_id] = session
        self.outcomes["created"] += 1
        self._check(session)
        return session

    def _get(self, session_id: str, owner: str | None, idle: bool = False) -> _Session:
        self.expire()
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None and isinstance(session_id, str):
            session = self._revive(session_id, owner)
        if session is None or session.owner != owner:
            ended = self._ended.get(session_id) if session is None and isinstance(session_id, str) else None
            why = ended[1] if ended is not None and ended[0] == owner else "does not exist"  # others learn nothing
            raise NotFoundError(f"session {_shown(session_id)} {why}")
        if session.failure is not None:
            raise FailedPreconditionError(f"session {session_id} failed: {session.failure}")
        if idle and session.active is not None:
            raise FailedPreconditionError(f"session {session_id} already has a generate in flight")
        return session

    def _end(self, session: _Session, why: str) -> None:
        session.closed = True
        del self._sessions[session.session_id]
        self._ended[session.session_id] = (session.owner, why)
        while len(self._ended) > TOMBSTONES:
            self._ended.popitem(last=False)
        self.engine.release_sequence(session.seq)  # at once, or when its request ends
        if session.active is not None:
            self.engine.cancel(session.active)

    def _touch(self, session: _Session) -> None:
        session.last_used = self._clock()
        if session.session_id in self._sessions:
            self._sessions.move_to_end(session.session_id)

    def _check(self, session: _Session) -> None:
        """INV-1 (tokens and K/V agree) and INV-2 (the history only grows); a violation fails the
        session, is counted by kind and propagates as a typed error."""
        try:
            if len(session.seq.tokens) < session.history_mark:
                raise InvariantViolation("inv2", f"history shrank from {session.history_mark} to {len(session.seq.tokens)}")
            self.engine.check_sequence(session.seq)
        except InvariantViolation as violation:
            self.invariant_violations[violation.kind] += 1
            self.outcomes["failed"] += 1
            session.failure = violation
            raise
        session.history_mark = len(session.seq.tokens)
        if self.persistence is not None and session.active is None:
            self.persistence.mark(session.session_id)

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
            kv_bytes_per_token=float(self.engine.kv_bytes_per_token),
            tier_bytes_per_token=self.engine.tier_bytes_per_token,
            host_tier_bytes=kv.tier_bytes["host"],
            disk_tier_bytes=kv.tier_bytes["disk"],
        )


def _shown(session_id: object, limit: int = 64) -> str:
    """A session id as error messages quote it: never echo kilobytes of a malformed id back."""
    text = repr(session_id)
    return text if len(text) <= limit else text[: limit - 3] + "..."
