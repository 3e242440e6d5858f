"""The fleet's GET /metrics: every replica's Prometheus text merged into one exposition
(docs/architecture.md § Fleet).

Each family appears once (one HELP, one TYPE) and holds, for every series, the fleet's aggregate (the
series' own labels) and each replica's value (the same labels plus `replica`). Counters, histograms and
most gauges aggregate by sum (sessions, KV pages and bytes add up over engines); a few gauges do not:
a peak or an age aggregates by max, a creation time by min (the earliest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"
BY_MAX = frozenset({"kiln_kv_step_attention_peak_bytes", "kiln_snapshot_backlog_seconds"})  # per-engine peaks, ages


def merge_metrics(texts: Mapping[str, bytes]) -> bytes:
    """One exposition from each replica's (replica id -> its /metrics text)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, float]]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                series.setdefault((sample.name, tuple(sorted(sample.labels.items()))), {})[replica] = sample.value
    for name, family in families.items():
        combine = _combiner(name)
        for (sample_name, labels), by_replica in values[name].items():
            family.add_sample(sample_name, dict(labels), combine(by_replica.values()))
            for replica, value in by_replica.items():
                family.add_sample(sample_name, {**dict(labels), REPLICA_LABEL: replica}, value)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _combiner(name: str) -> Callable[[object], float]:
    if name in BY_MAX:
        return max
    if name.endswith("_created"):
        return min
    return sum


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        return iter(self.families)
