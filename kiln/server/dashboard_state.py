"""What the dashboard shows (kiln/server/dashboard.py serves it): one reading of the engine, the session
store and persistence, plus a short history of rates, rebuilt at most every REFRESH_S however many pages
poll. A reading takes the store lock only to copy its table and the engine lock one session at a time
(SessionStore.survey), so a flood of polls costs one survey per interval and never stalls a step.

Every caller shares the reading; `view` cuts it down to the sessions the caller may see (its own, or
all for an admin key or with auth off). Aggregates (pool, counters, latency) are shown to every
authenticated caller: they are what /metrics already publishes.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kiln.engine.sequence import Request
from kiln.llm import LLM
from kiln.results import LiveSession
from kiln.snapshots.persistence import SnapshotStats

REFRESH_S = 0.5  # a reading is reused for this long (the page polls every second)
HISTORY_STEP_S = 1.0  # one history point per second at most
HISTORY_POINTS = 600  # ten minutes of history
LATENCY_WINDOW_S = 15.0  # the percentiles of a history point cover the turns of this window


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


@dataclass(frozen=True)
class Reading:
    """One shared reading: the aggregates (JSON-ready) and every live session."""

    overview: dict
    sessions: tuple[LiveSession, ...]
    taken_at: float = field(default_factory=time.monotonic)
    _encoded: dict[tuple[str | None, bool], bytes] = field(default_factory=dict, compare=False, repr=False)

    def view(self, owner: str | None, sees_all: bool) -> dict:
        rows = [_row(s, sees_all) for s in self.sessions if sees_all or s.owner == owner]
        return {**self.overview, "sees_all": sees_all, "sessions": rows}

    def encoded(self, owner: str | None, sees_all: bool) -> bytes:
        """`view` as JSON, encoded once per caller scope and reading (many open pages, one encoding)."""
        key = (owner, sees_all)
        if key not in self._encoded:
            self._encoded[key] = json.dumps(self.view(owner, sees_all), separators=(",", ":")).encode()
        return self._encoded[key]

    def session(self, session_id: str, owner: str | None, sees_all: bool) -> dict | None:
        """A session's drill-down: its row, its turns and its pages by KV group (None: not visible)."""
        for live in self.sessions:
            if live.info.session_id == session_id and (sees_all or live.owner == owner):
                info = live.info
                global_pages = info.global_kv_bytes // self.overview["pool"]["page_bytes"]
                return {**_row(live, sees_all), "turns": [asdict(turn) for turn in live.turns],
                        "pages_by_group": {"global": global_pages, "sliding_window": info.resident_pages - global_pages}}
        return None


class DashboardState:
    def __init__(self, llm: LLM, health: Callable[[], dict], refresh_s: float = REFRESH_S) -> None:
        self.llm = llm
        self.health = health
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
        usage = engine.kv_usage_nowait()
        tiers = engine.tier_usage()
        stats = engine.stats
        with store.lock:
            outcomes, evictions = dict(store.outcomes), dict(store.evictions)
            violations = dict(store.invariant_violations)
        persistence = llm.persistence
        snapshots = persistence.stats if persistence is not None else SnapshotStats()
        kv_format = engine.kv_format
        totals = _Totals(time.monotonic(), stats.prefill_tokens + stats.reused_tokens, stats.reused_tokens,
                         stats.prefill_tokens, stats.generated_tokens, sum(snapshots.saves.values()),
                         sum(snapshots.restores.values()))
        self._sample(totals, usage)
        overview = {
            "generated_at": time.time(),
            "health": self.health(),
            "formats": {"weights": kv_format.weights, "kv_dtype": kv_format.kv_dtype, "kv_codec": kv_format.encoding,
                        "page_size": kv_format.page_size, "speculative": llm.config.speculative or "off",
                        "kv_policy": llm.config.kv_policy},
            "pool": {"used": usage.used, "cached": usage.cached, "free": usage.free, "pages": engine.kv_pages,
                     "page_bytes": engine.kv_page_bytes},
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
        return Reading(overview, sessions)

    def _sample(self, totals: _Totals, usage) -> None:  # noqa: ANN001 - PoolUsage
        """Append a history point when HISTORY_STEP_S has passed since the last one: rates over the gap,
        latency percentiles over the last LATENCY_WINDOW_S."""
        last = self._last
        if last is not None and totals.at - last.at < HISTORY_STEP_S:
            return
        self._last = totals
        if last is None:
            return
        span = totals.at - last.at
        prompt = totals.prompt - last.prompt
        recent = [f for f in list(self._finished) if f.at >= totals.at - LATENCY_WINDOW_S]
        ttfts = [f.ttft_s for f in recent if f.ttft_s is not None]
        self._history.append({
            "t": time.time(), "used": usage.used, "cached": usage.cached, "free": usage.free,
            "hit_rate": (totals.reused - last.reused) / prompt if prompt else None,
            "reused": totals.reused - last.reused, "prefilled": totals.prefilled - last.prefilled,
            "decode_tps": (totals.generated - last.generated) / span,
            "ttft_p50": _percentile(ttfts, 50), "ttft_p95": _percentile(ttfts, 95),
            "turn_p50": _percentile([f.total_s for f in recent], 50),
            "turn_p95": _percentile([f.total_s for f in recent], 95),
            "saves": totals.saves - last.saves, "restores": totals.restores - last.restores,
        })


def _percentile(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def _row(live: LiveSession, sees_all: bool) -> dict:
    info = live.info
    last = live.turns[-1] if live.turns else None
    return {
        "id": info.session_id,
        "owner": (live.owner or "")[:8] if sees_all else None,
        "history": info.history_tokens, "resident_tokens": info.computed_tokens, "pages": info.resident_pages,
        "resident_bytes": info.resident_kv_bytes, "host_bytes": info.host_tier_bytes, "disk_bytes": info.disk_tier_bytes,
        "policy": info.kv_policy, "reused": info.reused_tokens, "prefilled": info.last_prefill_tokens,
        "last_turn_s": last.total_s if last else None, "idle_s": info.idle_s, "ttl_s": info.ttl_s,
        "state": _state(live), "last_saved_at": info.last_saved_at, "unsaved": info.unsaved_changes,
        "save_failures": info.save_failures, "turns": len(live.turns),
    }


def _state(live: LiveSession) -> str:
    info = live.info
    if live.failed:
        return "failed"
    if info.generating:
        return "running"
    if info.history_tokens and info.computed_tokens == 0:
        return "dropped"  # K/V given back for room: the next turn recomputes it
    return "idle"
