"""The routing policies the simulation compares, over simulated replicas (benchmarks/sim_replica.py).

`motet` is motet/cluster/routing_policy.py as the Ray Serve router runs it: its index of replicas' caches is fed by
their periodic reports and by its own routing since; `oracle` is the same policy seeing every cache as it is.
The baselines: round robin, least loaded, prompt-text prefix affinity as Ray Serve's PrefixCacheAffinityRouter
does it, and adapter affinity alone (as the Kubernetes inference gateways route LoRA requests).
"""

from __future__ import annotations

import random
from itertools import count

from benchmarks.routing_trace import TraceConfig, TraceRequest
from benchmarks.sim_replica import SimReplica
from motet.cluster.prefix_index import PrefixIndex
from motet.cluster.routing_policy import LoadTracker, ReplicaLoad, RouteRequest, RoutingCosts, RoutingPolicy


class Policy:
    name = ""
    reports = False  # wants the replicas' periodic reports

    def __init__(self, replicas: list[SimReplica], seed: int = 0):
        self.replicas = replicas
        self.ids = list(range(len(replicas)))
        self.rng = random.Random(seed)

    def choose(self, req: TraceRequest, now: float) -> int:
        raise NotImplementedError

    def routed(self, replica: int, req: TraceRequest, now: float) -> None:
        pass

    def report(self, replica: int, changes) -> None:
        pass

    def completed(self, replica: int, key) -> None:
        pass

    def least_loaded(self, among: list[int]) -> int:
        low = min(self.replicas[i].outstanding for i in among)
        return self.rng.choice([i for i in among if self.replicas[i].outstanding == low])


class RoundRobin(Policy):
    name = "round robin"

    def __init__(self, replicas, seed=0):
        super().__init__(replicas, seed)
        self.next = count()

    def choose(self, req, now):
        return next(self.next) % len(self.replicas)


class LeastLoaded(Policy):
    name = "least loaded"

    def choose(self, req, now):
        return self.least_loaded(self.ids)


class TextPrefix(Policy):
    """Ray Serve's PrefixCacheAffinityRouter: a tree of the prompt texts routed to each replica (no eviction,
    its default; no adapter in the key); when queue lengths differ by more than `imbalanced_threshold`,
    power of two choices; else the replicas with the longest match if it covers >= 10% of the prompt, else
    those whose trees are smallest; the shortest queue among them."""

    name = "text prefix (Ray)"

    def __init__(self, replicas, seed=0, imbalanced_threshold: float = 10):
        super().__init__(replicas, seed)
        self.threshold = imbalanced_threshold
        self.tree = PrefixIndex(routed_ttl_s=float("inf"))
        self.tree_size = [0] * len(replicas)

    def choose(self, req, now):
        loads = [r.outstanding for r in self.replicas]
        if max(loads) - min(loads) > self.threshold:
            return self.least_loaded(self.rng.sample(self.ids, 2))
        matched = self.tree.cached_blocks(req.text_hashes)
        best = max(matched.values(), default=0)
        if req.text_hashes and best / len(req.text_hashes) >= 0.1:
            return self.least_loaded([r for r, n in matched.items() if n == best])
        low = min(self.tree_size)
        return self.least_loaded([i for i in self.ids if self.tree_size[i] == low])

    def routed(self, replica, req, now):
        known = self.tree.reported_blocks.setdefault(replica, set())
        new = [h for h in req.text_hashes if h not in known]
        self.tree_size[replica] += len(new)
        self.tree.report_changes(replica, new, ())


class AdapterAffinity(Policy):
    """Replicas where the adapter is resident (as reported, or just routed there), the least loaded of them
    unless its load exceeds the mean by the same bound as motet's; else the least loaded replica."""

    name = "adapter affinity"
    reports = True

    def __init__(self, replicas, seed=0, policy: RoutingPolicy | None = None):
        super().__init__(replicas, seed)
        self.bound = policy or RoutingPolicy()
        self.index = PrefixIndex()

    def choose(self, req, now):
        self.index.expire(now)
        resident = sorted(self.index.holders_of_adapter(req.adapter))
        if resident:
            best = self.least_loaded(resident)
            loads = [r.outstanding for r in self.replicas]
            if not self.bound.overloaded(self.replicas[best].outstanding, loads):
                return best
        return self.least_loaded(self.ids)

    def routed(self, replica, req, now):
        self.index.routed(replica, (), req.adapter, now)

    def report(self, replica, changes):
        _, _, loaded, dropped = changes
        self.index.report_changes(replica, (), (), loaded, dropped)


class Motet(Policy):
    """motet/cluster/routing_policy.py over an index fed by reports and routing guesses (as in motet/cluster/router.py)."""

    name = "motet"
    reports = True

    def __init__(self, replicas, seed=0, policy: RoutingPolicy | None = None, routed_ttl_s: float = 5.0):
        super().__init__(replicas, seed)
        self.policy = policy or RoutingPolicy()
        self.index = PrefixIndex(routed_ttl_s)
        self.tracker = LoadTracker()

    def loads(self):
        held = self.index.reported_adapters
        return {
            i: ReplicaLoad(self.tracker.load(i), adapter_slots_free=r.adapter_slots - len(held.get(i, ())))
            for i, r in enumerate(self.replicas)
        }

    def track(self, replica, req) -> None:
        cached = self.index.cached_blocks(req.block_hashes).get(replica, 0)
        load = self.policy.request_load(RouteRequest(req.block_hashes, req.adapter), cached)
        self.tracker.routed(replica, (req.conversation, req.turn), load)

    def completed(self, replica, key):
        self.tracker.completed(key)

    def choose(self, req, now):
        self.index.expire(now)
        route = RouteRequest(req.block_hashes, req.adapter)
        return self.policy.rank(route, self.ids, self.index, self.loads(), self.rng)[0]

    def routed(self, replica, req, now):
        self.track(replica, req)
        self.index.routed(replica, req.block_hashes, req.adapter, now)

    def report(self, replica, changes):
        self.index.report_changes(replica, *changes)


class Oracle(Motet):
    """The same policy, seeing every replica's cache and adapters exactly as they are."""

    name = "oracle"
    reports = False

    def routed(self, replica, req, now):
        self.track(replica, req)
        self.index.report_changes(replica, *self.replicas[replica].take_changes())


POLICIES = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "text_prefix": TextPrefix,
    "adapter_affinity": AdapterAffinity,
    "motet": Motet,
    "oracle": Oracle,
}


def costs_for(model) -> RoutingCosts:
    """The policy's costs from the service model: a block's prefill, an adapter load, and the first-token
    delay one more outstanding request adds (its share of decode steps plus a typical prefill)."""
    mean_output = sum(TraceConfig.output_tokens) / 2
    return RoutingCosts(
        block_prefill_s=model.token_s * model.block_size,
        adapter_load_s=model.adapter_load_s,
        request_s=model.row_s + model.token_s,
        request_work_s=mean_output * (model.step_s(16, 16) / 16),
    )
