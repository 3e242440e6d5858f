"""The fleet's merged /metrics (kiln/fleet/metrics.py), without Ray: each family once, the aggregate of
every series beside each replica's, summed or (peaks, ages, creation times) taken by max or min."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kiln.fleet.metrics import merge_metrics

REPLICA_TEXT = """# HELP kiln_sessions_active Live sessions
# TYPE kiln_sessions_active gauge
kiln_sessions_active {sessions}
# HELP kiln_requests_total Requests by route and status
# TYPE kiln_requests_total counter
kiln_requests_total{{route="grpc/Generate",status="OK"}} {requests}
# HELP kiln_requests_created Requests by route and status
# TYPE kiln_requests_created gauge
kiln_requests_created{{route="grpc/Generate",status="OK"}} {created}
# HELP kiln_snapshot_backlog_seconds Age of the oldest unsaved change
# TYPE kiln_snapshot_backlog_seconds gauge
kiln_snapshot_backlog_seconds {backlog}
# HELP kiln_ttft_seconds Time to first token
# TYPE kiln_ttft_seconds histogram
kiln_ttft_seconds_bucket{{le="0.1"}} {fast}
kiln_ttft_seconds_bucket{{le="+Inf"}} {requests}
kiln_ttft_seconds_count {requests}
kiln_ttft_seconds_sum 1.5
"""


def samples(text: bytes) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text.decode()) for sample in family.samples}


def test_each_family_once_with_the_aggregate_and_each_replicas_series():
    merged = merge_metrics({
        "r1": REPLICA_TEXT.format(sessions=2, requests=3, created=50, backlog=1.5, fast=1).encode(),
        "r2": REPLICA_TEXT.format(sessions=4, requests=7, created=40, backlog=0.5, fast=6).encode(),
    })
    text = merged.decode()
    for family in ("kiln_sessions_active", "kiln_requests_total", "kiln_snapshot_backlog_seconds", "kiln_ttft_seconds"):
        assert text.count(f"# TYPE {family} ") == 1 and text.count(f"# HELP {family} ") == 1
    values = samples(merged)
    generate = {("route", "grpc/Generate"), ("status", "OK")}
    assert values[("kiln_sessions_active", frozenset())] == 6
    assert values[("kiln_sessions_active", frozenset({("replica", "r1")}))] == 2
    assert values[("kiln_requests_total", frozenset(generate))] == 10
    assert values[("kiln_requests_total", frozenset(generate | {("replica", "r2")}))] == 7
    assert values[("kiln_requests_created", frozenset(generate))] == 40  # the earliest
    assert values[("kiln_snapshot_backlog_seconds", frozenset())] == 1.5  # the oldest backlog, not a sum
    assert values[("kiln_ttft_seconds_bucket", frozenset({("le", "0.1")}))] == 7
    assert values[("kiln_ttft_seconds_sum", frozenset())] == 3.0
    assert values[("kiln_ttft_seconds_count", frozenset({("replica", "r1")}))] == 3

