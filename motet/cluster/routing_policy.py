"""motet's routing policy: which replica should serve a request, scored by what it would save there.

A replica's score is the first-token time a request would save or lose there, in seconds:

    + the prompt's leading KV blocks it already holds (keyed by adapter: the engine's own chained hashes)
      x the prefill time of a block, or only the load time of a block for those the shared KV tier holds
      (RouteRequest.shared_blocks: any replica would load them rather than compute them)
    + the adapter load it avoids, when the request's adapter is resident there; where it is not, a load that
      would evict another adapter (no free slot) costs twice: the evicted one may have to come back
    - its load x the first-token delay one more request adds

A replica's load is its outstanding requests (sent and not finished), each weighted by the work it brings:
one request's decode share plus the prefill of the blocks it does not find cached (LoadTracker): a replica
taking cold prompts fills up sooner than one taking warm ones, so the bound balances work, not counts.

The best score wins, within a bound on imbalance: a replica whose load exceeds the mean load by
`imbalance_factor` (plus `imbalance_slack` requests, so that small loads never count) is passed over for the
best of the others. Bounded-load affinity: the fallback keeps preferring cached prefixes and resident adapters
among replicas with room, where power-of-two-choices would pick blindly. A replica holding the request's
adapter may run `adapter_slack` more requests before it is passed over: spilling an adapter's traffic onto
a replica without it costs a load there (and, with its slots full, an eviction), and the simulation shows
that this small allowance saves a third of the adapter loads (at 64 replicas, 7.7 instead of 12.1 per 1,000
requests) at the same imbalance. Plain synchronous code, used by the Ray Serve router (motet/cluster/router.py)
and by the simulation (benchmarks/routing_sim.py).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from motet.cluster.prefix_index import PrefixIndex


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request: its prompt's leading full blocks, hashed as the engine hashes them
    (motet/cluster/prompt_blocks.py), and its adapter's uid (0: the base model)."""

    block_hashes: tuple[int, ...]
    adapter: int = 0
    avoid: frozenset = frozenset()  # replicas that already failed this request
    # Leading blocks known to be in the shared KV tier (a prefill replica just wrote them: disaggregation.py):
    # a replica without them on its device loads them, a prefill of theirs costs no replica anything.
    shared_blocks: int = 0


@dataclass(frozen=True)
class RoutingCosts:
    """Seconds, from step times measured on SmolLM2-135M-Instruct, one thread per replica, fp32, 16-token
    blocks (`python -m benchmarks.routing_fit`, then benchmarks/routing_policies.py: costs_for); only their ratios
    matter to the ranking."""

    block_prefill_s: float = 0.073  # prefill of one 16-token block
    adapter_load_s: float = 0.057  # reading and validating a rank-8 adapter
    request_s: float = 0.0062  # the first-token delay one more outstanding request adds (a decode row)
    request_work_s: float = 1.24  # a request's work apart from its prefill: its share of decode steps
    # Loading one block from the shared KV tier into the cache (a file: read, CRC-32, copy), ~3% of its
    # prefill: benchmarks/reports/kv_tiers has 4,000 tokens (250 blocks) from a cold disk in a 0.64 s TTFT.
    block_load_s: float = 0.002


@dataclass(frozen=True)
class ReplicaLoad:
    outstanding: float  # requests sent there and not finished (queued, waiting or running), by their work
    kv_free_fraction: float = 1.0  # free KV blocks (cached ones included) / all
    adapter_slots_free: int = 1  # adapters it may load without evicting one


@dataclass(frozen=True)
class RoutingPolicy:
    costs: RoutingCosts = RoutingCosts()
    imbalance_factor: float = 1.25
    imbalance_slack: float = 2.0
    adapter_slack: float = 2.0
    kv_pressure_s: float = 1.0  # a replica out of free KV blocks preempts: at most this much worse

    def scores(
        self, request: RouteRequest, replicas: Sequence[Hashable], index: PrefixIndex, loads
    ) -> dict[Hashable, float]:
        c = self.costs
        cached = index.cached_blocks(request.block_hashes)
        resident = index.holders_of_adapter(request.adapter)
        out = {}
        for r in replicas:
            load = loads[r]
            score = (
                self.prefix_saving(cached.get(r, 0), request.shared_blocks) - load.outstanding * c.request_s
            )
            if request.adapter and r not in resident:
                score -= c.adapter_load_s * (1 if load.adapter_slots_free > 0 else 2)
            score -= self.kv_pressure_s * max(0.0, 0.1 - load.kv_free_fraction) * 10
            out[r] = score
        return out

    def rank(
        self,
        request: RouteRequest,
        replicas: Sequence[Hashable],
        index: PrefixIndex,
        loads: Mapping[Hashable, ReplicaLoad],
        rng: random.Random,
    ) -> list[Hashable]:
        """The replicas, best first (a caller falls through to the next when one is full or fails)."""
        candidates = [r for r in replicas if r not in request.avoid] or list(replicas)
        if len(candidates) <= 1:
            return candidates
        scores = self.scores(request, candidates, index, loads)
        bound = self.load_bound([loads[r].outstanding for r in candidates])
        resident = index.holders_of_adapter(request.adapter)

        def has_room(r) -> bool:
            return loads[r].outstanding <= bound + (self.adapter_slack if r in resident else 0.0)

        within = [r for r in candidates if has_room(r)]
        over = [r for r in candidates if not has_room(r)]
        within.sort(key=lambda r: (-scores[r], loads[r].outstanding, rng.random()))
        over.sort(key=lambda r: (loads[r].outstanding, -scores[r]))
        return within + over

    def prefix_saving(self, cached_blocks: int, shared_blocks: int) -> float:
        """Seconds a replica holding the prompt's first `cached_blocks` blocks saves: their prefill, but only
        their load where the shared tier holds them (any replica would load those)."""
        c = self.costs
        from_shared = min(cached_blocks, shared_blocks)
        return from_shared * c.block_load_s + (cached_blocks - from_shared) * c.block_prefill_s

    def request_load(self, request: RouteRequest, cached_blocks: int) -> float:
        """What a request adds to a replica's load, in requests: 1 for its decode share, plus its uncached
        prefill relative to that (a load, for the uncached blocks the shared tier holds)."""
        c = self.costs
        n = len(request.block_hashes)
        uncached = max(0, n - cached_blocks)
        loaded = max(0, min(n, request.shared_blocks) - cached_blocks)
        work = (uncached - loaded) * c.block_prefill_s + loaded * c.block_load_s
        return 1.0 + work / c.request_work_s

    def load_bound(self, all_loads: Sequence[float]) -> float:
        """The most load a replica may have and still be preferred."""
        return self.imbalance_factor * sum(all_loads) / len(all_loads) + self.imbalance_slack

    def overloaded(self, load: float, all_loads: Sequence[float]) -> bool:
        return load > self.load_bound(all_loads)


class LoadTracker:
    """The load a router has sent to each replica and not seen finish, by request (RoutingPolicy.request_load)."""

    def __init__(self):
        self.loads: dict[Hashable, float] = {}
        self.requests: dict[Hashable, tuple[Hashable, float]] = {}  # request key -> (replica, its load)

    def routed(self, replica: Hashable, key: Hashable, load: float) -> None:
        self.requests[key] = (replica, load)
        self.loads[replica] = self.loads.get(replica, 0.0) + load

    def completed(self, key: Hashable) -> None:
        replica, load = self.requests.pop(key, (None, 0.0))
        if replica in self.loads:
            self.loads[replica] = max(0.0, self.loads[replica] - load)

    def load(self, replica: Hashable) -> float:
        return self.loads.get(replica, 0.0)

    def remove_replica(self, replica: Hashable) -> None:
        self.loads.pop(replica, None)
        self.requests = {k: v for k, v in self.requests.items() if v[0] != replica}
