"""Per-replica figures on the ingress's /metrics, from the replicas' latest reports (labelled by replica id),
beside the app's own metrics, which sum them."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from motet.cluster.reports import ReplicaReport

GAUGES = {
    "motet_replica_requests_queued": ("requests in the replica's adapter queues", lambda r: r.stats.queued),
    "motet_replica_requests_waiting": ("requests admitted, waiting to run", lambda r: r.stats.waiting),
    "motet_replica_requests_running": (
        "sequences running in the replica's engine",
        lambda r: r.stats.running,
    ),
    "motet_replica_kv_blocks_free": (
        "free KV blocks (cached prefixes included)",
        lambda r: r.stats.kv_blocks_free,
    ),
    "motet_replica_cached_blocks": ("KV blocks in the prefix cache", lambda r: len(r.blocks) // 8),
    "motet_replica_adapters_loaded": ("LoRA adapters in host memory", lambda r: len(r.adapters)),
}
COUNTERS = {
    "motet_replica_prefix_cache_queries": (
        "prompt tokens looked up in the prefix cache",
        "prefix_cache_queries",
    ),
    "motet_replica_prefix_cache_hits": ("of those, tokens found", "prefix_cache_hits"),
}


class ReplicaMetrics(Collector):
    def __init__(self, reports: dict[str, ReplicaReport]):
        self.reports = reports  # replica id -> latest report (motet/cluster/router.py keeps it)

    def collect(self):
        reports = list(self.reports.values())
        for name, (help_, value) in GAUGES.items():
            g = GaugeMetricFamily(name, help_, labels=["replica"])
            for r in reports:
                g.add_metric([r.replica], value(r))
            yield g
        for name, (help_, field) in COUNTERS.items():
            c = CounterMetricFamily(name, help_, labels=["replica"])
            for r in reports:
                c.add_metric([r.replica], getattr(r.stats, field))
            yield c
