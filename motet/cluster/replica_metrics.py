"""Per-replica figures on the ingress's /metrics, from the replicas' latest reports (labelled by replica id),
beside the app's own metrics, which sum them."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from motet.cluster.reports import ReplicaReport

GAUGES = {
    "motet_replica_requests_queued": ("requests in the replica's adapter queues", lambda r: r.stats.queued),
    "motet_replica_requests_waiting": ("requests admitted, waiting to run", lambda r: r.stats.num_waiting),
    "motet_replica_requests_running": (
        "sequences running in the replica's engine",
        lambda r: r.stats.num_running,
    ),
    "motet_replica_kv_blocks_free": (
        "free KV blocks (cached prefixes included)",
        lambda r: r.stats.kv_blocks_free,
    ),
    "motet_replica_kv_blocks_used": (
        "KV blocks held by requests (or by the KV tiers' copies under way)",
        lambda r: r.stats.kv_blocks_used,
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


PD_COUNTERS = {  # prefill/decode disaggregation at the ingress (ingress.PDCounters)
    "motet_pd_prefills": ("prompts prefilled on a prefill replica", "prefills"),
    "motet_pd_prefill_fallbacks": (
        "prefills that failed or were refused: the decode replica computed the prompt",
        "fallbacks",
    ),
    "motet_pd_handed_blocks": ("KV blocks prefill replicas left in the shared tier", "handed_blocks"),
    "motet_pd_prefill_seconds": (
        "time on the prefill replicas, admission to the blocks in the shared tier",
        "prefill_seconds",
    ),
}


class ReplicaMetrics(Collector):
    def __init__(self, reports: dict[str, ReplicaReport], pd=None):
        self.reports = reports  # replica id -> latest report (motet/cluster/router.py keeps it)
        self.pd = pd  # the ingress's PDCounters under disaggregation, else None

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
        if self.pd is not None:
            for name, (help_, field) in PD_COUNTERS.items():
                yield CounterMetricFamily(name, help_, value=getattr(self.pd, field))
