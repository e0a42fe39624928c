"""What a replica reports to the routers, through Ray Serve's routing-stats channel (its
`record_routing_stats`, polled by the controller every REPORT_PERIOD_S and broadcast to every handle).

A report is a snapshot: the replica's load (the numbers of actors.system.Stats), the hashes of the KV
blocks its prefix cache holds (packed as int64s), and the adapters in its host memory. The router turns
consecutive snapshots into what was cached and evicted since (motet/cluster/prefix_index.py), so its view stays
fresh without asking anything per request. Plain data: no Ray here.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from motet.actors.front import Stats
from motet.engine.core.kv_connector import KVTierStats, sum_tier_stats
from motet.engine.speculative.proposer import SpeculativeStats
from motet.engine.structured_output import GrammarStats
from motet.lora.manager import AdapterStats

REPORT_PERIOD_S = 0.5

# replica id -> its latest report, as the ingress's router received it (motet/cluster/router.py writes it, the
# ingress's /metrics reads it; one router per process: the ingress's handle).
LATEST: dict[str, ReplicaReport] = {}
POOLS: dict[str, set[str]] = {}  # deployment -> the replica ids its router published in LATEST


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # the replica's id (Ray Serve's unique_id)
    seq: int  # reports of this replica so far: a new one differs from the last
    stats: Stats
    blocks: bytes  # the cached blocks' chained hashes, int64
    adapters: tuple[int, ...]  # uids of the adapters it has loaded (its adapter pool and host cache)
    adapter_slots: int  # how many it keeps loaded (the pool's capacity by bytes: an estimate)

    @staticmethod
    def pack(hashes: Iterable[int]) -> bytes:
        return array.array("q", hashes).tobytes()

    def block_hashes(self) -> array.array:
        out = array.array("q")
        out.frombytes(self.blocks)
        return out

    @property
    def kv_free_fraction(self) -> float:
        total = self.stats.kv_blocks_used + self.stats.kv_blocks_free
        return self.stats.kv_blocks_free / total if total else 1.0

    @property
    def outstanding(self) -> int:
        return self.stats.queued + self.stats.num_waiting + self.stats.num_running

    def to_dict(self) -> dict:
        """For `record_routing_stats`: plain values the controller can compare and broadcast."""
        return {**asdict(self), "stats": asdict(self.stats)}

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaReport | None:
        """None for an empty or foreign dict (a replica that has not reported yet)."""
        try:
            given = d["stats"]
            stats = Stats(
                **{
                    **given,
                    "speculative": SpeculativeStats(**given.get("speculative", {})),
                    "grammar": GrammarStats(**given.get("grammar", {})),
                    "kv_tiers": tuple(KVTierStats(**t) for t in given.get("kv_tiers", ())),
                    "adapters": AdapterStats(**given["adapters"]) if given.get("adapters") else None,
                }
            )
            kwargs = {f.name: d[f.name] for f in fields(cls) if f.name != "stats"}
            return cls(stats=stats, **kwargs)
        except (KeyError, TypeError):
            return None


def total_stats(reports: Iterable[ReplicaReport]) -> Stats | None:
    """The replicas' stats summed (for the ingress's /metrics); None before any report."""
    reports = list(reports)
    if not reports:
        return None
    numbers = [f.name for f in fields(Stats) if f.type in ("int", int)]
    sums = {name: sum(getattr(r.stats, name) for r in reports) for name in numbers}
    running = tuple(sorted({a for r in reports for a in r.stats.running_adapters}))
    waiting = tuple(sorted({a for r in reports for a in r.stats.waiting_adapters} - set(running)))
    queued = tuple(sorted({a for r in reports for a in r.stats.queued_adapters} - set(running)))
    memory = [r.stats.adapters for r in reports if r.stats.adapters is not None]
    return Stats(
        **sums,
        adapters=_summed(AdapterStats, memory) if memory else None,
        running_adapters=running,
        waiting_adapters=waiting,
        queued_adapters=queued,
        grammar=_summed(GrammarStats, [r.stats.grammar for r in reports]),
        speculative=_summed(SpeculativeStats, [r.stats.speculative for r in reports]),
        kv_tiers=sum_tier_stats(r.stats.kv_tiers for r in reports),
        token_s=max(r.stats.token_s for r in reports),  # the slowest replica's pace: an estimate errs long
    )


def _summed(cls, items: list):
    """Dataclass instances of `cls` summed field by field."""
    return cls(**{f.name: sum(getattr(x, f.name) for x in items) for f in fields(cls)})
