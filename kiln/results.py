"""What a generation and a session report: plain records shared by the engine, the servers and the
SDK. Kept free of torch so that `import kiln.client` stays light."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # history length when the request started
    reused_tokens: int  # of those, tokens whose K/V was already in pages (session or prefix cache)
    prefilled_tokens: int  # of those, tokens this request computed
    generated_tokens: int


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    usage: Usage
    stop_string: str | None
    time_to_first_token_s: float | None
    total_s: float
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # per token, its likeliest alternatives (id, logprob)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    history_tokens: int
    computed_tokens: int  # history tokens whose K/V is resident
    resident_pages: int
    resident_kv_bytes: int
    reused_tokens: int  # last generate: history tokens it did not have to compute
    last_prefill_tokens: int  # last generate: history tokens it computed
    generating: bool
    created_at: float  # unix seconds
    idle_s: float
    ttl_s: float
    # Which K/V stays resident (kiln/kv/policy.py) and what the rest costs where it lives.
    kv_policy: str = "full"
    kv_sink_tokens: int = 0
    kv_window_tokens: int = 0
    global_kv_bytes: int = 0  # of resident_kv_bytes, the global-attention layers' (what kv_policy bounds)
    kv_bytes_per_token: float = 0.0  # resident (pool) bytes one token costs, every layer
    tier_bytes_per_token: float = 0.0  # the same token encoded by the engine's kv_codec in a tier
    host_tier_bytes: int = 0  # this session's evicted pages in host memory / on disk (shared pages count
    disk_tier_bytes: int = 0  # for each holder)
    # Persistence (kiln/snapshots/persistence.py): whether a change is not yet in the store, when it last
    # was saved (unix seconds; None: not yet, or persistence off), failed saves since the last good one.
    unsaved_changes: bool = False
    last_saved_at: float | None = None
    save_failures: int = 0
    # False for a session listed from the snapshot store, not in memory (evicted, or saved before a
    # restart): none of its K/V is resident; its next use brings it back.
    resident: bool = True
    # Positions its attention no longer reads: under sink_window, those between the sink and the
    # window once the history passes sink + window (whole pages; it grows, never shrinks); else 0.
    forgotten_tokens: int = 0
    # INV-1/INV-2 violations found on it (docs/architecture.md § Sessions): the first fails the session;
    # info() still describes it, every other call is refused.
    invariant_violations: int = 0


@dataclass(frozen=True)
class SessionTurn:
    """One finished generate of a session, as the dashboard's drill-down plots it."""

    finished_at: float  # unix seconds
    prefilled_tokens: int
    reused_tokens: int
    generated_tokens: int
    time_to_first_token_s: float | None
    total_s: float


@dataclass(frozen=True)
class LiveSession:
    """A session in memory with its owner and its last turns (SessionStore.survey, for the dashboard)."""

    owner: str | None
    info: SessionInfo
    turns: tuple[SessionTurn, ...]
    failed: bool


@dataclass(frozen=True)
class SnapshotInfo:
    """A checkpoint of a session (Session.snapshot)."""

    snapshot_id: str
    session_id: str  # the session it was taken of
    history_tokens: int
    kv_tokens: int  # history tokens whose K/V it holds
    pages: int  # KV pages it references
    created_at: float  # unix seconds


@dataclass(frozen=True)
class OwnerUsage:
    """What one owner (API key identity) holds now: live sessions and their resident K/V bytes."""

    sessions: int
    resident_kv_bytes: int
