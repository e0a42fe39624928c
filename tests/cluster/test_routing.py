"""The routing policy and what feeds it, without Ray: the router's index of replicas' caches, the policy's
ranking and load bound, the ingress's block hashes (checked against the engine's own prefix cache, and
across processes), replicas' reports, the shared adapter store, and the routing simulation."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from motet.cluster.prefix_index import PrefixIndex
from motet.cluster.reports import ReplicaReport, total_stats
from motet.cluster.routing_policy import LoadTracker, ReplicaLoad, RouteRequest, RoutingPolicy
from tests.live_server import ROOT


# -- the index ------------------------------------------------------------------------------------------------
def test_index_counts_leading_blocks_held_in_a_row():
    index = PrefixIndex()
    index.report_snapshot("a", [1, 2, 3], [])
    index.report_snapshot("b", [1, 3, 4], [])  # holds 3 but not 2: a run of 1
    assert index.cached_blocks((1, 2, 3, 4)) == {"a": 3, "b": 1}
    assert index.cached_blocks((9, 1)) == {}
    index.report_snapshot("a", [1], [])  # evicted 2 and 3
    assert index.cached_blocks((1, 2, 3)) == {"a": 1, "b": 1}
    index.report_changes("b", cached=[2], evicted=[1])
    assert index.cached_blocks((1, 2)) == {"a": 1}
    index.remove_replica("a")
    assert index.cached_blocks((1, 2)) == {}


def test_routing_guesses_count_until_they_expire_and_reports_outlive_them():
    index = PrefixIndex(routed_ttl_s=5)
    index.routed("a", (1, 2), adapter=7, now=0.0)
    index.routed("a", (1, 2, 3), adapter=7, now=3.0)  # the same prefix, routed again
    assert index.cached_blocks((1, 2, 3)) == {"a": 3} and index.holders_of_adapter(7) == {"a"}
    index.expire(6.0)  # the first guess expires; the second still holds 1 and 2
    assert index.cached_blocks((1, 2, 3)) == {"a": 3}
    index.report_snapshot("a", [1], [7])
    index.expire(9.0)  # both guesses gone: what the report says remains
    assert index.cached_blocks((1, 2, 3)) == {"a": 1} and index.holders_of_adapter(7) == {"a"}


# -- the policy -----------------------------------------------------------------------------------------------
def loads(**outstanding):
    return {r: ReplicaLoad(v) for r, v in outstanding.items()}


def test_policy_prefers_the_longest_cached_prefix_then_the_resident_adapter():
    policy, rng = RoutingPolicy(), random.Random(0)
    index = PrefixIndex()
    index.report_snapshot("a", [1, 2], [])
    index.report_snapshot("b", [1, 2, 3, 4], [])
    index.report_snapshot("c", [], [5])
    request = RouteRequest((1, 2, 3, 4), adapter=5)
    assert policy.rank(request, ["a", "b", "c"], index, loads(a=0, b=0, c=0), rng)[0] == "b"
    cold = RouteRequest((8, 9), adapter=5)  # no prefix anywhere: where the adapter is
    assert policy.rank(cold, ["a", "b", "c"], index, loads(a=0, b=0, c=0), rng)[0] == "c"
    base = RouteRequest((8, 9))  # nothing to gain anywhere: the least loaded
    assert policy.rank(base, ["a", "b", "c"], index, loads(a=3, b=1, c=2), rng)[0] == "b"


def test_policy_passes_over_a_replica_beyond_the_load_bound():
    policy = RoutingPolicy(imbalance_factor=1.25, imbalance_slack=2, adapter_slack=2)
    index = PrefixIndex()
    index.report_snapshot("a", [1, 2, 3], [5])
    index.report_snapshot("b", [1], [])
    request = RouteRequest((1, 2, 3), adapter=5)
    # mean load 4: the bound is 1.25 * 4 + 2 = 7, and 9 for "a", which holds the adapter
    assert policy.rank(request, ["a", "b"], index, loads(a=8, b=0), random.Random(0))[0] == "a"
    # mean load 6: the bound is 9.5, and 11.5 for "a"
    assert policy.rank(request, ["a", "b"], index, loads(a=12, b=0), random.Random(0)) == ["b", "a"]
    no_adapter = RouteRequest((1, 2, 3))  # then "a" has no allowance beyond the bound
    assert policy.rank(no_adapter, ["a", "b"], index, loads(a=8, b=0), random.Random(0))[0] == "b"


def test_policy_avoids_replicas_that_failed_the_request():
    index = PrefixIndex()
    index.report_snapshot("a", [1, 2], [])
    request = RouteRequest((1, 2), avoid=frozenset({"a"}))
    assert RoutingPolicy().rank(request, ["a", "b"], index, loads(a=0, b=0), random.Random(0)) == ["b"]


def test_load_weighs_a_request_by_the_prefill_it_brings():
    policy = RoutingPolicy()
    request = RouteRequest(tuple(range(10)))
    warm, cold = policy.request_load(request, 10), policy.request_load(request, 0)
    assert warm == 1.0 and cold == pytest.approx(
        1 + 10 * policy.costs.block_prefill_s / policy.costs.request_work_s
    )
    tracker = LoadTracker()
    tracker.routed("a", "r1", cold)
    tracker.routed("a", "r2", warm)
    tracker.completed("r1")
    tracker.completed("r1")  # twice: counted once
    assert tracker.load("a") == pytest.approx(warm)


# -- the ingress's hashes are the engine's ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, num_threads=1, block_size=4))


def test_route_hashes_are_the_blocks_the_engine_caches(tiny_engine):
    from motet.actors.messages import GenerateSpec
    from motet.cluster.prompt_blocks import route_hashes
    from motet.engine.sampling_params import SamplingParams

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
    spec = GenerateSpec(["r"], [SamplingParams(max_tokens=1)], messages=messages)
    hashes = route_hashes(tiny_engine.tokenizer, spec, tiny_engine.config.block_size, False)
    prompt = tiny_engine.tokenizer.encode_chat(messages)
    assert len(hashes) == (len(prompt) - 1) // 4 > 2
    tiny_engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), tenant=spec.tenant)
    while tiny_engine.has_unfinished():
        tiny_engine.step()
    assert set(hashes) <= set(tiny_engine.block_manager.cached)  # what a second request would hit
    again = tiny_engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), tenant=spec.tenant)
    outs = []
    while tiny_engine.has_unfinished():  # (an overlapping engine gives a step's outputs with the next call)
        outs += tiny_engine.step()
    (out,) = outs
    assert out.request_id == again and out.num_cached_tokens == len(hashes) * 4


def test_the_engines_stats_tell_a_router_what_its_caches_hold(tiny_engine, tiny_model_dir, tmp_path):
    """Issue 60: a replica's report read the engine's live dicts (its prefix cache, its adapters) from the event
    loop while the engine's thread wrote them. The engine now makes that part of its stats on its own thread, only
    when asked: the blocks of a prompt as the ingress hashes its route, and the adapters loaded, those requests
    named by reference (which a replica sweeps when deleted) apart from those registered by name."""
    import array

    from motet.actors.messages import GenerateSpec
    from motet.cluster.prompt_blocks import route_hashes
    from motet.engine.sampling_params import SamplingParams
    from motet.lora.manager import AdapterRef
    from tests.peft_adapters import make_adapter

    assert tiny_engine.stats().cache is None  # a copy of the prefix cache's hashes: not made unless asked
    messages = [{"role": "user", "content": "Name a badger, a stoat and a weasel."}]
    spec = GenerateSpec(["r"], [SamplingParams(max_tokens=1)], messages=messages)
    hashes = route_hashes(tiny_engine.tokenizer, spec, tiny_engine.config.block_size, False)
    shared = tiny_engine.add_lora("shared", make_adapter(tiny_model_dir, tmp_path / "shared", seed=0))
    own = AdapterRef.of("alice/own", make_adapter(tiny_model_dir, tmp_path / "own", seed=1))
    greedy = SamplingParams(temperature=0, max_tokens=1)
    tiny_engine.add_request(tiny_engine.tokenizer.encode_chat(messages), greedy, tenant=spec.tenant)
    tiny_engine.add_request([5, 6, 7], greedy, adapter=own)
    while tiny_engine.has_unfinished():
        tiny_engine.step()
    cache = tiny_engine.stats(cache=True).cache
    blocks = array.array("q")
    blocks.frombytes(cache.blocks)
    assert len(hashes) > 2 and set(hashes) <= set(blocks)
    assert set(cache.adapters) == {shared.uid, own.uid} and cache.adapter_slots >= 2
    assert cache.referenced == (own,)


def test_a_replicas_stats_carry_a_copy_of_the_caches_made_at_most_once_a_period():
    """The copy costs the engine's thread a pass over its prefix cache: made at most once a report period while
    requests run (the latest one carried meanwhile), and as soon as the engine has nothing left to run (its last
    state, which no later step would report)."""
    from motet.actors.executor import ExecutorActor
    from motet.engine.llm_engine import EngineStats
    from tests.clock import Clock

    class Engine:  # what the executor asks of an engine for its stats
        busy, copies = True, 0

        def has_unfinished(self) -> bool:
            return self.busy

        def stats(self, cache: bool = False) -> EngineStats:
            self.copies += cache
            return EngineStats(cache=f"copy {self.copies}" if cache else None)

    clock = Clock()
    executor = ExecutorActor(Engine, cache_period_s=0.5, clock=clock)
    executor.engine = engine = Engine()
    made = []
    for now, busy in [(0.0, True), (0.2, True), (0.4, True), (0.5, True), (0.6, True), (0.7, False)]:
        clock.now, engine.busy = now, busy
        made.append(executor._stats().cache)
    assert made == ["copy 1", "copy 1", "copy 1", "copy 2", "copy 2", "copy 3"]
    local = ExecutorActor(Engine)  # a server in one process: no router asks
    local.engine = Engine()
    assert local._stats().cache is None and local.engine.copies == 0


def test_block_hashes_agree_across_processes():
    code = (
        "from motet.cluster.prompt_blocks import block_hashes; print(block_hashes(list(range(40)), 7, 5, 16))"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
        for _ in range(2)
    }
    from motet.cluster.prompt_blocks import block_hashes

    assert runs == {f"{block_hashes(list(range(40)), 7, 5, 16)}\n"}


# -- reports ----------------------------------------------------------------------------------------------------
def test_report_round_trip_and_sum():
    from motet.actors.system import Stats
    from motet.engine.speculative.proposer import SpeculativeStats

    def report(replica, running, hits, waiting=(), queued=()):
        spec = SpeculativeStats(drafted_tokens=10 * running, accepted_tokens=7 * running)
        stats = Stats(
            num_running=running,
            kv_blocks_used=10,
            kv_blocks_free=90,
            prefix_cache_queries=100,
            prefix_cache_hits=hits,
            steps=5,
            adapters_pinned=1,
            running_adapters=("t/a",),
            waiting_adapters=waiting,
            speculative=spec,
            queued=1,
            queued_adapters=queued,
        )
        return ReplicaReport(replica, 3, stats, ReplicaReport.pack([5, -7]), (11,), 32)

    a, b = report("a", 2, 40, queued=("t/q",)), report("b", 3, 10, waiting=("t/a", "t/w"), queued=("t/a",))
    back = ReplicaReport.from_dict(a.to_dict())
    assert back == a and list(back.block_hashes()) == [5, -7] and back.kv_free_fraction == 0.9
    assert ReplicaReport.from_dict({}) is None
    total = total_stats([a, b])
    assert (total.num_running, total.prefix_cache_hits, total.queued, total.running_adapters) == (
        5,
        50,
        2,
        ("t/a",),
    )
    # adapters waiting or queued on one replica and running on another count as running (as vLLM's
    # lora_requests_info names them)
    assert (total.waiting_adapters, total.queued_adapters) == (("t/w",), ("t/q",))
    # speculation's counters survive the round trip (a dataclass inside, not a dict) and add up
    assert (total.speculative.drafted_tokens, total.speculative.accepted_tokens) == (50, 35)


# -- the shared adapter store -------------------------------------------------------------------------------------
def test_store_copies_keep_the_uid_and_deletion_shows(tmp_path):
    from motet.cluster.shared_adapter_store import SharedAdapterStore
    from motet.lora.manager import AdapterRef, files_version

    source = tmp_path / "upload"
    source.mkdir()
    (source / "adapter_config.json").write_text('{"r": 8}')
    (source / "adapter_model.safetensors").write_bytes(b"weights")
    ref = AdapterRef.of("alice/a", source)
    ingress = SharedAdapterStore(f"file://{tmp_path / 'store'}")
    replica = SharedAdapterStore(f"file://{tmp_path / 'store'}", cache_dir=tmp_path / "cache")
    ingress.publish(ref)
    local = replica.local(ref)
    assert local.path != ref.path and local.uid == ref.uid and files_version(local.path) == ref.version
    assert (local.path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert replica.local(ref) == local  # copied once
    assert not replica.deleted(local)
    ingress.unpublish("alice/a")
    assert replica.deleted(local)
    with pytest.raises(FileNotFoundError):
        SharedAdapterStore(f"file://{tmp_path / 'store'}", cache_dir=tmp_path / "other").local(ref)
    direct = SharedAdapterStore()  # no URL: the files where the ref points
    assert direct.local(ref) == ref and not direct.deleted(ref)


def test_store_publishes_and_fetches_once_under_concurrent_first_uses(tmp_path):
    """Concurrent requests that are an adapter's first use each publish (at the ingress) and fetch (at a
    replica) it: every one succeeds and sees the same files."""
    from concurrent.futures import ThreadPoolExecutor

    from motet.cluster.shared_adapter_store import SharedAdapterStore
    from motet.lora.manager import AdapterRef

    source = tmp_path / "upload"
    source.mkdir()
    (source / "adapter_config.json").write_text('{"r": 8}')
    (source / "adapter_model.safetensors").write_bytes(b"weights" * 100_000)
    ref = AdapterRef.of("alice/a", source)
    ingress = SharedAdapterStore(f"file://{tmp_path / 'store'}")
    replica = SharedAdapterStore(f"file://{tmp_path / 'store'}", cache_dir=tmp_path / "cache")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: ingress.publish(ref), range(8)))
        locals_ = list(pool.map(lambda _: replica.local(ref), range(8)))
    assert len(set(locals_)) == 1 and locals_[0].uid == ref.uid
    assert (locals_[0].path / "adapter_model.safetensors").read_bytes() == b"weights" * 100_000
    assert len(list((tmp_path / "store" / "alice" / "a").iterdir())) == 1  # one version, no staging left


# -- the simulation ----------------------------------------------------------------------------------------------
def test_simulation_ranks_the_policies_as_their_design_says():
    from benchmarks import routing_sim

    args = routing_sim.build_parser().parse_args(
        ["--replicas", "8", "--duration", "240", "--policies", "round_robin", "motet", "oracle"]
    )
    row = routing_sim.run(args)["by_replicas"]["8"]
    rr, motet, oracle = row["round_robin"], row["motet"], row["oracle"]
    assert motet["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.2
    assert motet["prefix_hit_rate"] >= 0.9 * oracle["prefix_hit_rate"]
    assert motet["adapter_loads_per_1000"] < rr["adapter_loads_per_1000"] / 2


# -- the scale-out flags ------------------------------------------------------------------------------------------
def test_scale_out_flags_are_checked_and_shape_the_deployment():
    from motet.api.cli import build_parser
    from motet.cluster.launch import Cluster, ClusterSettings
    from motet.cluster.serve_flags import wants_cluster

    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    assert not wants_cluster(parse())
    assert wants_cluster(parse("--replicas", "2")) and wants_cluster(parse("--max-replicas", "4"))
    for bad, what in [
        (dict(min_replicas=1), "go together"),
        (dict(min_replicas=3, max_replicas=2), "--min-replicas <= --max-replicas"),
        (dict(replicas=0), "--replicas must be at least 1"),
        (dict(router="random"), "--router must be one of"),
    ]:
        with pytest.raises(ValueError, match=what):
            ClusterSettings(**bad)
    pytest.importorskip("ray")
    fixed = Cluster(ClusterSettings(replicas=3, drain_timeout_s=7), None).deployment_options()
    assert fixed["num_replicas"] == 3 and fixed["graceful_shutdown_timeout_s"] == 7
    scaled = Cluster(ClusterSettings(replicas=1, min_replicas=1, max_replicas=4), None).deployment_options()
    auto = scaled["autoscaling_config"]
    assert "num_replicas" not in scaled and (auto["min_replicas"], auto["max_replicas"]) == (1, 4)
