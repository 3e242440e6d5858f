"""What the dashboard shows (kiln/server/dashboard.py serves it): one reading of the engine, the session
store and persistence, plus a short history of rates, rebuilt at most every REFRESH_S however many pages
poll. A reading takes the store lock only to copy its table and the engine lock one session at a time
(SessionStore.survey), so a flood of polls costs one survey per interval and never stalls a step.

Sessions not in memory but revivable from their snapshots ("evicted to snapshot") and every row's last
snapshot come from Persistence.saved: an index kept in memory as saves happen (the store is read once,
manifests and blob sizes, never blobs), so they cost a reading a dictionary copy.

The requests the engine holds now (queued, running, paused; stateless ones included) come from
Engine.in_flight, one short engine-lock hold per reading. Latency percentiles cover the turns that
finished in the last LATENCY_WINDOW_S and the ones in flight (their TTFT once they have a first token,
their age so far as a turn time), so they fill while a long generation runs.

Stored responses of the Responses API (kiln/server/stored_responses.py ResponseBook.survey: those this
server holds in memory) are counted per session (a row's `responses`, which the page's filter finds by the
word "responses") and in all (`responses`, what the caller may see): a stored response is a point in its
session.

Every caller shares the reading; `view` cuts it down to the sessions, requests and responses the caller may
see (its own, or all for an admin key or with auth off). Aggregates (pool, counters, latency) are shown to
every authenticated caller: they are what /metrics already publishes.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kiln.engine.sequence import InFlight, Request
from kiln.llm import LLM
from kiln.results import LiveSession
from kiln.snapshots.manifest import KIND_SESSION, owner_digest, session_snapshot_id
from kiln.snapshots.persistence import SavedSnapshot, SnapshotStats

REFRESH_S = 0.5  # a reading is reused for this long (the page polls every second)
HISTORY_STEP_S = 1.0  # one history point per second at most
HISTORY_POINTS = 600  # ten minutes of history
LATENCY_WINDOW_S = 15.0  # the percentiles of a history point cover the turns of this window
EVICTION_REASONS = ("cached", "idle", "paused", "waiting", "preempted")  # see `_evicted_tokens`
EVICTED_STATE = "evicted to snapshot"


@dataclass(frozen=True)
class _Finished:
    at: float  # time.monotonic()
    ttft_s: float | None
    total_s: float


@dataclass
class _Totals:
    """The monotonic counters a history point differentiates."""

    at: float
    prompt: int
    reused: int
    prefilled: int
    generated: int
    saves: int
    restores: int
    written_bytes: int
    dedup_bytes: int
    evicted: dict[str, int]  # K/V tokens evicted by reason


@dataclass(frozen=True)
class Reading:
    """One shared reading: the aggregates (JSON-ready), every live session, every snapshot by id and the
    session snapshots of sessions not in memory."""

    overview: dict
    sessions: tuple[LiveSession, ...]
    snapshots: dict[str, SavedSnapshot] = field(default_factory=dict)
    evicted: tuple[SavedSnapshot, ...] = ()
    requests: tuple[InFlight, ...] = ()
    responses: dict[str | None, Counter[str]] = field(default_factory=dict)  # owner -> session id -> responses
    taken_at: float = field(default_factory=time.monotonic)
    _encoded: dict[tuple[str | None, bool], bytes] = field(default_factory=dict, compare=False, repr=False)

    def view(self, owner: str | None, sees_all: bool) -> dict:
        digest = owner_digest(owner)
        rows = [_row(s, self._own_snapshot(s.info.session_id), sees_all)
                for s in self.sessions if sees_all or s.owner == owner]
        rows += [_evicted_row(saved, sees_all) for saved in self.evicted if sees_all or saved.owner == digest]
        responses = self._responses(owner, sees_all)
        for row in rows:
            row["responses"] = responses[row["id"]]
        requests = [_request_row(r, sees_all) for r in self.requests if sees_all or r.owner == owner]
        return {**self.overview, "sees_all": sees_all, "sessions": rows, "requests": requests,
                "responses": {"stored": responses.total(), "sessions": len(responses)}}

    def _responses(self, owner: str | None, sees_all: bool) -> Counter[str]:
        """Stored responses per session, of the sessions the caller may see."""
        visible: Counter[str] = Counter()
        for who, sessions in self.responses.items():
            if sees_all or who == owner:
                visible.update(sessions)
        return visible

    def _own_snapshot(self, session_id: str) -> SavedSnapshot | None:
        return self.snapshots.get(session_snapshot_id(session_id))

    def encoded(self, owner: str | None, sees_all: bool) -> bytes:
        """`view` as JSON, encoded once per caller scope and reading (many open pages, one encoding)."""
        key = (owner, sees_all)
        if key not in self._encoded:
            self._encoded[key] = json.dumps(self.view(owner, sees_all), separators=(",", ":")).encode()
        return self._encoded[key]

    def session(self, session_id: str, owner: str | None, sees_all: bool) -> dict | None:
        """A session's drill-down: its row, its turns, its pages by KV group and its snapshots (its own
        and its checkpoints, newest first); None: not visible."""
        digest = owner_digest(owner)
        snapshots = sorted((_snapshot(saved) for saved in self.snapshots.values()
                            if saved.session_id == session_id and (sees_all or saved.owner == digest)),
                           key=lambda snapshot: -snapshot["saved_at"])
        responses = self._responses(owner, sees_all)[session_id]
        for live in self.sessions:
            if live.info.session_id == session_id and (sees_all or live.owner == owner):
                info = live.info
                global_pages = info.global_kv_bytes // self.overview["pool"]["page_bytes"]
                return {**_row(live, self._own_snapshot(session_id), sees_all), "snapshots": snapshots, "responses": responses,
                        "turns": [asdict(turn) for turn in live.turns],
                        "pages_by_group": {"global": global_pages, "sliding_window": info.resident_pages - global_pages}}
        for saved in self.evicted:
            if saved.session_id == session_id and (sees_all or saved.owner == digest):
                return {**_evicted_row(saved, sees_all), "snapshots": snapshots, "responses": responses, "turns": [],
                        "pages_by_group": {"global": 0, "sliding_window": 0}}
        return None


class DashboardState:
    def __init__(self, llm: LLM, health: Callable[[], dict],
                 responses: Callable[[], dict[str | None, Counter[str]]] = dict, refresh_s: float = REFRESH_S) -> None:
        self.llm = llm
        self.health = health
        self.responses = responses  # stored responses per owner and session
        self.refresh_s = refresh_s
        self._lock = threading.Lock()  # one reading at a time; callers meanwhile wait for it
        self._reading: Reading | None = None
        self._finished: deque[_Finished] = deque(maxlen=10_000)
        self._constrained = 0
        self._history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self._last: _Totals | None = None
        llm.engine.add_finish_observer(self._observe)

    def _observe(self, request: Request, reason: str) -> None:  # engine thread
        now = time.perf_counter()
        first = request.first_token_at
        self._finished.append(_Finished(time.monotonic(), None if first is None else first - request.submitted_at,
                                        now - request.submitted_at))
        if request.matcher is not None:
            self._constrained += 1

    def reading(self) -> Reading:
        """The current reading, rebuilt when older than `refresh_s` (blocking: call it off the event loop)."""
        with self._lock:
            if self._reading is None or time.monotonic() - self._reading.taken_at >= self.refresh_s:
                self._reading = self._read()
            return self._reading

    def _read(self) -> Reading:
        llm, engine, store = self.llm, self.llm.engine, self.llm.sessions
        sessions = tuple(store.survey(everyone=True))
        requests = tuple(engine.in_flight())
        persistence = llm.persistence
        saved = {snapshot.snapshot_id: snapshot for snapshot in persistence.saved()} if persistence is not None else {}
        resident = {session_snapshot_id(live.info.session_id) for live in sessions}
        evicted = tuple(snapshot for snapshot_id, snapshot in saved.items()
                        if snapshot.kind == KIND_SESSION and snapshot_id not in resident)
        usage = engine.kv_usage_nowait()
        tiers = engine.tier_usage()
        stats = engine.stats
        with store.lock:
            outcomes, evictions = dict(store.outcomes), dict(store.evictions)
            violations = dict(store.invariant_violations)
        snapshots = persistence.stats if persistence is not None else SnapshotStats()
        kv_format = engine.kv_format
        totals = _Totals(time.monotonic(), stats.prefill_tokens + stats.reused_tokens, stats.reused_tokens,
                         stats.prefill_tokens, stats.generated_tokens, sum(snapshots.saves.values()),
                         sum(snapshots.restores.values()), snapshots.bytes_written, snapshots.dedup_bytes,
                         _evicted_tokens(usage.evicted, stats.kv_dropped_tokens, kv_format.page_size))
        self._sample(totals, usage, requests)
        overview = {
            "generated_at": time.time(),
            "health": self.health(),
            "formats": {"weights": kv_format.weights, "kv_dtype": kv_format.kv_dtype, "kv_codec": kv_format.encoding,
                        "page_size": kv_format.page_size, "speculative": llm.config.speculative or "off",
                        "kv_policy": llm.config.kv_policy},
            "pool": {"used": usage.used, "cached": usage.cached, "free": usage.free, "pages": engine.kv_pages,
                     "page_bytes": engine.kv_page_bytes, "evicted_tokens": totals.evicted},
            "tiers": {"bytes": dict(tiers.bytes), "budget_bytes": dict(tiers.budget_bytes),
                      "failed_disk_writes": tiers.failed_disk_writes},
            "tokens": {"prefilled": stats.prefill_tokens, "reused": stats.reused_tokens,
                       "prefix_hits": stats.prefix_hit_tokens, "generated": stats.generated_tokens},
            "speculation": {"proposed": stats.spec_proposed_tokens, "accepted": stats.spec_accepted_tokens},
            "constrained_requests": self._constrained,
            "generations": dict(stats.requests_by_outcome),
            "preemptions": stats.preemptions,
            "kv_dropped_tokens": dict(stats.kv_dropped_tokens),
            "session_outcomes": outcomes,
            "evictions": {"ttl": 0, "lru": 0, **evictions},
            "invariant_violations": {"inv1": 0, "inv2": 0, **violations},
            "snapshots": {
                "store": type(persistence.store).__name__ if persistence is not None else "off",
                "saves": dict(snapshots.saves), "restores": dict(snapshots.restores),
                "save_failures": dict(snapshots.save_failures),
                "verification_failures": snapshots.verification_failures,
                "bytes_written": snapshots.bytes_written, "dedup_bytes": snapshots.dedup_bytes,
                "backlog_s": persistence.backlog_s if persistence is not None else 0.0,
                "failing_sessions": persistence.failing_sessions if persistence is not None else 0,
            },
            "history": list(self._history),
        }
        return Reading(overview, sessions, saved, evicted, requests, self.responses())

    def _sample(self, totals: _Totals, usage, requests: tuple[InFlight, ...]) -> None:  # noqa: ANN001 - PoolUsage
        """Append a history point when HISTORY_STEP_S has passed since the last one: rates over the gap,
        latency percentiles over the turns of the last LATENCY_WINDOW_S and those in flight."""
        last = self._last
        if last is not None and totals.at - last.at < HISTORY_STEP_S:
            return
        self._last = totals
        if last is None:
            return
        span = totals.at - last.at
        prompt = totals.prompt - last.prompt
        recent = [f for f in list(self._finished) if f.at >= totals.at - LATENCY_WINDOW_S]
        ttfts = [f.ttft_s for f in recent if f.ttft_s is not None] + [r.ttft_s for r in requests if r.ttft_s is not None]
        turns = [f.total_s for f in recent] + [r.age_s for r in requests]
        self._history.append({
            "t": time.time(), "used": usage.used, "cached": usage.cached, "free": usage.free,
            "hit_rate": (totals.reused - last.reused) / prompt if prompt else None,
            "reused": totals.reused - last.reused, "prefilled": totals.prefilled - last.prefilled,
            "decode_tps": (totals.generated - last.generated) / span,
            "ttft_p50": _percentile(ttfts, 50), "ttft_p95": _percentile(ttfts, 95),
            "turn_p50": _percentile(turns, 50), "turn_p95": _percentile(turns, 95),
            "saves": totals.saves - last.saves, "restores": totals.restores - last.restores,
            "written_bps": (totals.written_bytes - last.written_bytes) / span,
            "dedup_bps": (totals.dedup_bytes - last.dedup_bytes) / span,
            **{f"evicted_{reason}": (totals.evicted[reason] - last.evicted[reason]) / span for reason in EVICTION_REASONS},
        })


def _percentile(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def _evicted_tokens(cached_pages: int, dropped: dict[str, int], page_size: int) -> dict[str, int]:
    """K/V tokens evicted since the start, by reason: "cached", the prefix cache's least recently used
    pages taken for new content (full pages, so pages × page size); the others, a sequence's K/V given
    back for room (EngineStats.kv_dropped_tokens: an idle session, a paused or waiting request, a
    preempted one). Its history stays; the K/V is recomputed when needed."""
    return {"cached": cached_pages * page_size, **{reason: dropped.get(reason, 0) for reason in EVICTION_REASONS[1:]}}


def _request_row(request: InFlight, sees_all: bool) -> dict:
    """A request in flight: whose session (None: stateless), its state, age and tokens so far."""
    return {
        "id": request.request_id, "session": request.session_id, "owner": _owner(owner_digest(request.owner), sees_all),
        "state": request.state, "age_s": request.age_s, "ttft_s": request.ttft_s, "prompt": request.prompt_tokens,
        "computed": request.computed_tokens, "generated": request.generated_tokens, "max_tokens": request.max_tokens,
    }


def _owner(digest: str, sees_all: bool) -> str | None:
    """The owner column (admin views only): a prefix of the owner's digest, which resident and evicted
    sessions both know."""
    return digest.removeprefix("sha256:")[:8] if sees_all else None


def _snapshot(saved: SavedSnapshot) -> dict:
    return {"id": saved.snapshot_id, "kind": saved.kind, "saved_at": saved.saved_at,
            "history": saved.history_tokens, "bytes": saved.stored_bytes}


def _evicted_row(saved: SavedSnapshot, sees_all: bool) -> dict:
    """A session not in memory: what its snapshot says (its next call revives it)."""
    return {
        "id": saved.session_id, "owner": _owner(saved.owner, sees_all),
        "history": saved.history_tokens, "resident_tokens": 0, "pages": 0,
        "resident_bytes": 0, "host_bytes": 0, "disk_bytes": 0,
        "policy": saved.policy.partition(":")[0], "reused": None, "prefilled": None,
        "last_turn_s": None, "idle_s": max(0.0, time.time() - saved.saved_at), "ttl_s": saved.ttl_s,
        "state": EVICTED_STATE, "last_saved_at": saved.saved_at, "snapshot_bytes": saved.stored_bytes,
        "unsaved": False, "save_failures": 0, "turns": 0, "forgotten": None, "violations": 0,
    }


def _row(live: LiveSession, saved: SavedSnapshot | None, sees_all: bool) -> dict:
    info = live.info
    last = live.turns[-1] if live.turns else None
    return {
        "id": info.session_id,
        "owner": _owner(owner_digest(live.owner), sees_all),
        "history": info.history_tokens, "resident_tokens": info.computed_tokens, "pages": info.resident_pages,
        "resident_bytes": info.resident_kv_bytes, "host_bytes": info.host_tier_bytes, "disk_bytes": info.disk_tier_bytes,
        "policy": info.kv_policy, "reused": info.reused_tokens, "prefilled": info.last_prefill_tokens,
        "last_turn_s": last.total_s if last else None, "idle_s": info.idle_s, "ttl_s": info.ttl_s,
        "state": _state(live), "last_saved_at": info.last_saved_at,
        "snapshot_bytes": saved.stored_bytes if saved is not None else None, "unsaved": info.unsaved_changes,
        "save_failures": info.save_failures, "turns": len(live.turns),
        "forgotten": info.forgotten_tokens, "violations": info.invariant_violations,
    }


def _state(live: LiveSession) -> str:
    info = live.info
    if live.failed:
        return "failed"
    if info.generating:
        return "running"
    if live.turns and info.history_tokens and info.computed_tokens == 0:
        return "dropped"  # K/V given back for room: the next turn recomputes it (a new session has none yet)
    return "idle"
