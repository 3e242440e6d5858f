"""Prometheus metrics (kiln/server/metrics.py) in process: the ADR 0008 §2.9 session metrics and the
K/V bytes by state. Every metric's presence on a real server is tests/server/test_http.py's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.sampler import SamplingParams
from kiln.server.metrics import Metrics

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples}


def test_session_history_tokens_is_observed_at_each_turn(tiny_llm):
    """A session's history length when each generate starts (10, then 10 + 4 generated + 6 appended);
    stateless requests are not sessions."""
    llm = tiny_llm("llama", speculative=None)
    metrics = Metrics(llm)
    session = llm.create_session(list(range(1, 11)))
    session.generate(GREEDY).result()
    session.append([5] * 6)
    session.generate(GREEDY).result()
    llm.generate([[1, 2, 3]], GREEDY)
    seen = samples(metrics)
    assert seen[("kiln_session_history_tokens_count", ())] == 2
    assert seen[("kiln_session_history_tokens_sum", ())] == 10 + 20
    assert seen[("kiln_session_history_tokens_bucket", (("le", "16.0"),))] == 1
    assert seen[("kiln_session_history_tokens_bucket", (("le", "64.0"),))] == 2


def test_kv_bytes_are_split_into_live_and_prefix_cached(tiny_llm):
    """A live session's pages count as used; a finished stateless request's full pages stay in the prefix
    cache as cached; each part is its pages' bytes, so they add up to every page holding K/V."""
    llm = tiny_llm("llama", page_size=4, speculative=None)
    metrics = Metrics(llm)
    llm.generate([list(range(40, 80))], GREEDY)  # its pages go back at the next step: the session's first
    llm.create_session(list(range(1, 30))).generate(GREEDY).result()
    seen = samples(metrics)
    usage, page_bytes = llm.engine.kv_usage(), llm.engine.kv_page_bytes
    used, cached = seen[("kiln_kv_bytes", (("state", "used"),))], seen[("kiln_kv_bytes", (("state", "cached"),))]
    assert used == usage.used * page_bytes and cached == usage.cached * page_bytes
    assert used >= 8 * page_bytes and cached >= 10 * page_bytes  # the session's 33 tokens; the request's 40
