"""motet's Ray Serve request router: motet/cluster/routing_policy.py over the replicas' reports.

Ray Serve builds one per deployment handle, in the ingress process, and calls `choose_replicas` for every
request with the request's arguments, of which the first is its RouteRequest (motet/cluster/cluster_system.py). The
router returns the replicas ranked one per rank, best first; Serve sends the request to the first whose
queue has room (it checks `max_ongoing_requests`), so a full replica falls through to the next.

Its view: the replicas' reports (`RunningReplica.routing_stats`, motet/cluster/reports.py), applied to a
PrefixIndex when a replica's report changes; what it routed since (`on_request_routed`), as guesses that
expire; and the load it sent each replica and has not seen complete (`on_request_completed`). The latest
reports are also published in motet/cluster/reports.py's LATEST for the ingress's /metrics, in this same process.

Ray Serve pickles this module by value (its RequestRouterConfig registers it so): a module-level object here
would be a copy in the handle's router, so shared state lives in other modules, reached as their attributes.
"""

from __future__ import annotations

import logging
import random
import time

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from motet.cluster import reports
from motet.cluster.prefix_index import PrefixIndex
from motet.cluster.reports import ReplicaReport
from motet.cluster.routing_policy import LoadTracker, ReplicaLoad, RouteRequest, RoutingPolicy

log = logging.getLogger("motet.router")


def publish(replicas: list[RunningReplica], pool: str) -> dict[str, ReplicaReport | None]:
    """Each replica's current report, also published for the ingress's /metrics. `pool`: the deployment whose
    replicas these are (under disaggregation two routers publish, each its own replicas)."""
    latest = {r.replica_id.unique_id: ReplicaReport.from_dict(r.routing_stats or {}) for r in replicas}
    for rid, report in latest.items():
        if report is not None:
            reports.LATEST[rid] = report
    mine = reports.POOLS.setdefault(pool, set())
    for rid in mine - set(latest):
        reports.LATEST.pop(rid, None)
    mine.clear()
    mine.update(latest)
    return latest


class ReportingPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default routing (power of two choices), unchanged; it only publishes the replicas' reports
    for /metrics, as motet's router does (`--router pow2`)."""

    def update_replicas(self, replicas: list[RunningReplica]):
        publish(replicas, str(self._deployment_id))
        return super().update_replicas(replicas)


class MotetRouter(RequestRouter):
    def initialize_state(self, **policy_kwargs):
        self.policy = RoutingPolicy(**policy_kwargs)
        self.index = PrefixIndex()
        self.tracker = LoadTracker()
        self.rng = random.Random()
        self.seen: dict[str, int] = {}  # replica id -> seq of the report applied

    # -- the view -------------------------------------------------------------------------------------
    def _refresh(self, replicas: list[RunningReplica]) -> dict[str, ReplicaReport | None]:
        """Apply every replica's report that changed; the current report of each."""
        latest = {r.replica_id.unique_id: ReplicaReport.from_dict(r.routing_stats or {}) for r in replicas}
        for rid, report in latest.items():
            if report is not None and self.seen.get(rid) != report.seq:
                self.seen[rid] = report.seq
                self.index.report_snapshot(rid, report.block_hashes(), report.adapters)
        return latest

    def _forget(self, rid: str) -> None:
        self.index.remove_replica(rid)
        self.tracker.remove_replica(rid)
        self.seen.pop(rid, None)
        reports.LATEST.pop(rid, None)

    def update_replicas(self, replicas: list[RunningReplica]):
        """Serve's broadcast: the replicas, with their latest reports."""
        gone = set(self.seen) - {r.replica_id.unique_id for r in replicas}
        for rid in gone:
            self._forget(rid)
        publish(replicas, str(self._deployment_id))
        self._refresh(replicas)
        return super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    # -- routing --------------------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        route = _route_of(pending_request)
        if route is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]  # Serve picks the shortest queue among them
        latest = self._refresh(candidate_replicas)
        self.index.expire(time.monotonic())
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self._load(rid, latest.get(rid)) for rid in by_id}
        ranked = self.policy.rank(route, list(by_id), self.index, loads, self.rng)
        return [[by_id[rid]] for rid in ranked]

    def _load(self, rid: str, report: ReplicaReport | None) -> ReplicaLoad:
        sent = self.tracker.load(rid)
        if report is None:
            return ReplicaLoad(sent)
        return ReplicaLoad(
            max(sent, report.outstanding),  # another ingress's requests show in the report only
            kv_free_fraction=report.kv_free_fraction,
            adapter_slots_free=report.adapter_slots - len(report.adapters),
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        route = _route_of(pending_request)
        if route is None:
            return
        rid = replica_id.unique_id
        cached = self.index.cached_blocks(route.block_hashes).get(rid, 0)
        key = pending_request.metadata.internal_request_id
        self.tracker.routed(rid, key, self.policy.request_load(route, cached))
        self.index.routed(rid, route.block_hashes, route.adapter, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.tracker.completed(internal_request_id)


def _route_of(pending_request: PendingRequest | None) -> RouteRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    route = pending_request.args[0]
    return route if isinstance(route, RouteRequest) else None
