"""EngineStats: monotonic counters of one engine (the server exports them as metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt tokens computed
    reused_tokens: int = 0  # prompt tokens whose K/V was already in pages when a request started
    prefix_hit_tokens: int = 0  # of those, tokens found through the prefix cache (not a session's own)
    restored_tokens: int = 0  # of those, tokens whose pages came from the persistent prefix store, not recomputed
    # Fetches from the persistent prefix store (kiln/engine/stored_prefixes.py) by what became of them:
    # "started", then "restored" (pages put in a table), "unused" (the request had computed past them, or the
    # pool could not take them), "failed" (the store could not be read); "late" counts those the request
    # stopped waiting for (it recomputed; pages that land during its prefill may still be used).
    prefix_fetches: Counter[str] = field(default_factory=Counter)
    generated_tokens: int = 0
    steps: int = 0
    static_decode_steps: int = 0  # of those, decode steps over decode graphs' buffers (replayed graphs on a GPU)
    ahead_steps: int = 0  # of those, decode steps launched ahead of their predecessor's tokens (async scheduling)
    preemptions: int = 0  # running requests requeued for KV pages
    fair_share_preemptions: int = 0  # running requests requeued for a caller under its share of the slots
    spec_verify_steps: int = 0  # decode rows that carried a speculative draft
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    requests_by_outcome: Counter[str] = field(default_factory=Counter)
    pauses: int = 0  # times a request was set aside because its consumer stopped reading
    paused_now: int = 0  # requests set aside now (as of the last step)
    stall_cancels: int = 0  # requests cancelled because they stayed paused past their stall timeout
    # Tokens whose K/V was given back for room, by whose: "idle" (a parked session), "paused" (a request
    # whose consumer stopped reading), "waiting" (a queued request's sequence), "preempted" (a running
    # one). Their histories stay; the K/V is recomputed.
    kv_dropped_tokens: Counter[str] = field(default_factory=Counter)
    # Positions `sink_window` sequences' attention stopped reading as their histories grew past sink +
    # window (KVPolicy.forgotten; each sequence's Sequence.forgotten_tokens), counted once per sequence.
    kv_forgotten_tokens: int = 0
    # Per-step peak of attention's transient buffers (gathered or streamed K/V, scores, merge state), as
    # accounted by the attention paths: the last step's and the largest so far. Not the resident pool.
    last_step_attention_bytes: int = 0
    max_step_attention_bytes: int = 0

    def note_step_attention(self, nbytes: int) -> None:
        self.last_step_attention_bytes = nbytes
        self.max_step_attention_bytes = max(self.max_step_attention_bytes, nbytes)
