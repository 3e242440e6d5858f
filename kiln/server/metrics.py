"""Prometheus metrics. Live state (sessions, pages, engine counters) is read at scrape time from the
engine and session store, so there is one source of truth; per-request distributions are observed as
requests finish. Each server has its own registry, so several servers can share a process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.engine.sequence import Request
from kiln.engine.stats import EngineStats
from kiln.llm import LLM
from kiln.server.auth_failures import AuthFailures
from kiln.snapshots.persistence import SnapshotStats
from kiln.snapshots.prefix_store import PrefixStoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineState(Collector):
    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        engine, store = self.llm.engine, self.llm.sessions
        usage = engine.kv_usage()
        page_bytes = engine.kv_page_bytes
        stats = engine.stats
        with store.lock:
            live, outcomes = len(store), dict(store.outcomes)
            evictions, violations = dict(store.evictions), dict(store.invariant_violations)
        yield GaugeMetricFamily("kiln_sessions_active", "Live sessions", value=live)
        yield _labelled_counter("kiln_sessions", "Sessions by outcome", "outcome", outcomes,
                                ("created", "closed", "evicted", "failed"))
        yield _labelled_counter("kiln_session_evictions", "Session evictions by reason", "reason",
                                evictions, ("ttl", "lru"))
        pages = GaugeMetricFamily("kiln_kv_pages", "KV pages by state", labels=["state"])
        for state in ("used", "cached", "free"):
            pages.add_metric([state], getattr(usage, state))
        yield pages
        kv_bytes = GaugeMetricFamily("kiln_kv_bytes", "Bytes of KV pages holding K/V by state: used (held by live "
                                     "sessions and running requests), cached (the prefix cache, evictable)",
                                     labels=["state"])
        for state in ("used", "cached"):
            kv_bytes.add_metric([state], getattr(usage, state) * page_bytes)
        yield kv_bytes
        yield GaugeMetricFamily("kiln_kv_capacity_bytes", "Bytes of the whole KV page pool",
                                value=engine.kv_pages * page_bytes)
        tiers = engine.tier_usage()
        tier_bytes = GaugeMetricFamily("kiln_kv_tier_bytes", "Bytes of evicted KV pages held by each tier (encoded)",
                                       labels=["tier"])
        tier_budget = GaugeMetricFamily("kiln_kv_tier_budget_bytes", "Byte budget of each tier", labels=["tier"])
        for tier in ("host", "disk"):
            tier_bytes.add_metric([tier], tiers.bytes[tier])
            tier_budget.add_metric([tier], tiers.budget_bytes[tier])
        yield tier_bytes
        yield tier_budget
        yield GaugeMetricFamily("kiln_kv_step_attention_peak_bytes", "Largest transient attention buffers of one "
                                "engine step so far (gathered or streamed K/V, scores)", value=stats.max_step_attention_bytes)
        yield _labelled_counter("kiln_kv_dropped_tokens", "Tokens whose K/V was given back for room, by whose "
                                "(histories stay; the K/V is recomputed when needed)", "reason",
                                stats.kv_dropped_tokens, ("idle", "paused", "waiting", "preempted"))
        yield CounterMetricFamily("kiln_kv_forgotten_tokens", "Positions sink_window sessions' attention stopped "
                                  "reading as their histories passed sink + window (their histories keep them)",
                                  value=stats.kv_forgotten_tokens)
        yield CounterMetricFamily("kiln_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=stats.prefix_hit_tokens)
        yield CounterMetricFamily("kiln_reused_tokens", "Prompt tokens whose K/V was resident (sessions and prefix cache)",
                                  value=stats.reused_tokens)
        yield CounterMetricFamily("kiln_prefill_tokens", "Prompt tokens computed", value=stats.prefill_tokens)
        yield CounterMetricFamily("kiln_generated_tokens", "Tokens generated", value=stats.generated_tokens)
        yield CounterMetricFamily("kiln_engine_steps", "Engine steps (one forward each)", value=stats.steps)
        yield _labelled_counter("kiln_generations", "Generations by finish reason", "reason",
                                stats.requests_by_outcome, ("stop", "length", "cancelled", "error"))
        yield CounterMetricFamily("kiln_preemptions", "Requests preempted for KV pages", value=stats.preemptions)
        yield CounterMetricFamily("kiln_fair_share_preemptions", "Requests requeued so that a caller under its share "
                                  "of the batch slots gets one", value=stats.fair_share_preemptions)
        yield GaugeMetricFamily("kiln_generations_paused", "Generations set aside now because their clients stopped "
                                "reading (pages kept, no steps)", value=stats.paused_now)
        yield CounterMetricFamily("kiln_generation_pauses", "Times a generation was paused because its client stopped reading",
                                  value=stats.pauses)
        yield CounterMetricFamily("kiln_generation_stall_cancels", "Generations cancelled after staying paused for "
                                  "--stall-timeout-s", value=stats.stall_cancels)
        # Speculative decoding: acceptance rate = accepted / proposed; tokens per forward of a draft-carrying
        # row = (accepted + verify_steps) / verify_steps.
        yield CounterMetricFamily("kiln_spec_proposed_tokens", "Draft tokens proposed (speculative decoding)",
                                  value=stats.spec_proposed_tokens)
        yield CounterMetricFamily("kiln_spec_accepted_tokens", "Draft tokens accepted", value=stats.spec_accepted_tokens)
        yield CounterMetricFamily("kiln_spec_verify_steps", "Decode rows that carried a draft", value=stats.spec_verify_steps)
        yield CounterMetricFamily("kiln_static_decode_steps", "Decode steps over decode graphs' static buffers (replayed "
                                  "CUDA graphs on a GPU)", value=stats.static_decode_steps)
        yield CounterMetricFamily("kiln_ahead_steps", "Decode steps launched before the previous step's tokens reached "
                                  "the host (async scheduling)", value=stats.ahead_steps)
        yield _labelled_counter("kiln_cache_invariant_violations", "Cache invariant violations by kind", "kind",
                                violations, ("inv1", "inv2"))
        yield CounterMetricFamily("kiln_kv_tier_failed_disk_writes", "Evicted pages the disk tier could not take "
                                  "(a full or failing disk): they stayed in host memory or resident", value=tiers.failed_disk_writes)
        yield from _prefix_store_metrics(self.llm, stats)
        persistence = self.llm.persistence  # zeros when persistence is off: every series always exists
        yield from _snapshot_counters(persistence.stats if persistence is not None else SnapshotStats())
        yield GaugeMetricFamily("kiln_snapshot_backlog_seconds", "Age of the oldest session change not yet saved: a crash "
                                "now loses at most the changes of this many seconds (0: everything is saved)",
                                value=persistence.backlog_s if persistence is not None else 0.0)
        yield GaugeMetricFamily("kiln_snapshot_unsaved_sessions", "Sessions with a change queued or being saved",
                                value=persistence.unsaved_sessions if persistence is not None else 0)
        yield GaugeMetricFamily("kiln_snapshot_failing_sessions", "Sessions whose last save failed (kept queued and "
                                "retried with backoff; their histories are never dropped)",
                                value=persistence.failing_sessions if persistence is not None else 0)


class _AuthFailures(Collector):
    def __init__(self, failures: AuthFailures) -> None:
        self.failures = failures

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        yield CounterMetricFamily("kiln_auth_failures", "Requests refused for a missing, malformed or unknown API key",
                                  value=self.failures.failures_total)
        yield CounterMetricFamily("kiln_auth_throttled", "Requests refused unread: their address failed to "
                                  "authenticate too often", value=self.failures.throttled_total)


def _prefix_store_metrics(llm: LLM, counts: EngineStats):  # noqa: ANN202 - metric families
    """The persistent prefix store (zeros when it is off: every series always exists)."""
    store = llm.prefix_store
    stats = store.stats if store is not None else PrefixStoreStats()
    yield CounterMetricFamily("kiln_prefix_store_restored_tokens", "Prompt tokens whose pages were fetched from the "
                              "persistent prefix store instead of recomputed (counted in kiln_reused_tokens too)",
                              value=counts.restored_tokens)
    yield _labelled_counter("kiln_prefix_store_fetches", "Fetches from the persistent prefix store by outcome: started, "
                            "then restored, unused (computed past, or no room) or failed; late: the request stopped "
                            "waiting and recomputed", "outcome", counts.prefix_fetches,
                            ("started", "restored", "unused", "failed", "late"))
    yield GaugeMetricFamily("kiln_prefix_store_pages", "KV pages the persistent prefix store holds",
                            value=store.stored_pages if store is not None else 0)
    yield GaugeMetricFamily("kiln_prefix_store_bytes", "Stored bytes of those pages (--prefix-store-mb bounds them)",
                            value=store.stored_bytes if store is not None else 0)
    for name, doc in (("pages_written", "Pages written behind to the persistent prefix store"),
                      ("bytes_written", "Blob bytes new to the snapshot store those writes added"),
                      ("write_failures", "Pages lost to failed writes (the store unreachable or full; generation goes on)"),
                      ("dropped_pages", "Pages offered while the write-behind queue was full, never written"),
                      ("evicted_pages", "Pages dropped from the persistent prefix store for its budget (LRU)"),
                      ("fetched_pages", "Pages fetched from the persistent prefix store and verified"),
                      ("failed_pages", "Pages whose blob was missing or corrupt on fetch (recomputed; record dropped)")):
        yield CounterMetricFamily(f"kiln_prefix_store_{name}", doc, value=getattr(stats, name))


def _snapshot_counters(stats: SnapshotStats):  # noqa: ANN202 - metric families
    yield CounterMetricFamily("kiln_snapshot_bytes_written", "Bytes written to the snapshot store (page blobs "
                              "and manifests)", value=stats.bytes_written)
    yield CounterMetricFamily("kiln_snapshot_dedup_bytes", "Raw page bytes a save did not write because the store "
                              "already held the page", value=stats.dedup_bytes)
    yield _labelled_counter("kiln_snapshot_saves", "Snapshots saved by kind", "kind", stats.saves, ("checkpoint", "session"))
    yield _labelled_counter("kiln_snapshot_save_failures", "Snapshot saves that failed, by error code", "code",
                            stats.save_failures, ("RESOURCE_EXHAUSTED", "UNAVAILABLE"))
    yield _labelled_counter("kiln_snapshot_restores", "Sessions restored from snapshots, by source", "source",
                            stats.restores, ("checkpoint", "session"))
    yield CounterMetricFamily("kiln_snapshot_verification_failures", "Restores refused by verification (corrupt or "
                              "missing blob, another model or format)", value=stats.verification_failures)


def _labelled_counter(name: str, doc: str, label: str, counts: dict[str, int], always: tuple[str, ...]):  # noqa: ANN202
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in sorted(set(always) | set(counts)):
        family.add_metric([key], counts.get(key, 0))
    return family


class Metrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(llm))
        self.requests = Counter("kiln_requests", "Requests by route and status", ["route", "status"], registry=self.registry)
        self.request_seconds = Histogram("kiln_request_duration_seconds", "Request handling time by route", ["route"],
                                         buckets=SECONDS_BUCKETS, registry=self.registry)
        self.prefill_tokens = Histogram("kiln_generate_prefill_tokens", "Prompt tokens each generate computed",
                                        buckets=TOKEN_BUCKETS, registry=self.registry)
        self.prefill_seconds = Histogram("kiln_generate_prefill_seconds", "Admission to first token, per generate",
                                         buckets=SECONDS_BUCKETS, registry=self.registry)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Submission to first token, per generate",
                              buckets=SECONDS_BUCKETS, registry=self.registry)
        self.history_tokens = Histogram("kiln_session_history_tokens", "A session's history length at each turn "
                                        "(Generate)", buckets=TOKEN_BUCKETS, registry=self.registry)
        llm.engine.add_finish_observer(self._observe_generate)
        self.snapshot_seconds = Histogram("kiln_snapshot_seconds", "Snapshot save (capture to durable) and restore "
                                          "(read and verify) time", ["op"], buckets=SECONDS_BUCKETS, registry=self.registry)
        for op in ("save", "restore"):
            self.snapshot_seconds.labels(op)  # the series exist (empty) before the first save
        if llm.persistence is not None:
            llm.persistence.add_observer(lambda op, seconds: self.snapshot_seconds.labels(op).observe(seconds))

    def _observe_generate(self, request: Request, reason: str) -> None:
        usage = request.usage()
        self.prefill_tokens.observe(usage.prefilled_tokens)
        if request.seq.session:
            self.history_tokens.observe(usage.prompt_tokens)
        if request.first_token_at is not None:
            self.ttft.observe(request.first_token_at - request.submitted_at)
            if request.admitted_at is not None:
                self.prefill_seconds.observe(request.first_token_at - request.admitted_at)

    def watch_auth(self, failures: AuthFailures) -> None:
        """Export the failed-authentication totals (never per address: kiln/server/auth_failures.py)."""
        self.registry.register(_AuthFailures(failures))

    def observe_request(self, route: str, status: str, seconds: float) -> None:
        """One handled call: `status` is the gRPC code name (OK, NOT_FOUND, ...) for both transports."""
        self.requests.labels(route, status).inc()
        self.request_seconds.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
