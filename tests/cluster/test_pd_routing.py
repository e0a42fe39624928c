"""Prefill/decode disaggregation's plain parts: the prefill request keys its blocks exactly as the client's
request (so the decode replica finds them), which requests take the prefill pool, the flags, the routing policy
treating blocks in the shared tier as a load rather than a prefill, and the two pools' routers publishing their
own replicas' reports without dropping the other's."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest

from motet.actors.messages import GenerateSpec
from motet.cluster.disaggregation import MIN_PREFILL_BLOCKS, prefill_spec, wants_prefill
from motet.cluster.prefix_index import PrefixIndex
from motet.cluster.prompt_blocks import route_hashes
from motet.cluster.routing_policy import ReplicaLoad, RouteRequest, RoutingPolicy
from motet.cluster.serve_flags import DEFAULT_KV_SHARED_DIR, kv_shared_dir, pools
from motet.engine.sampling_params import SamplingParams
from motet.engine.tokenizer import Tokenizer
from motet.grammar.specs import JsonSchemaSpec
from motet.lora.manager import AdapterRef


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))


def spec(**kw) -> GenerateSpec:
    params = SamplingParams(
        temperature=0.7, max_tokens=200, cache_salt=kw.pop("cache_salt", None), grammar=JsonSchemaSpec({})
    )
    base = dict(request_ids=["r1", "r2"], params=[params, params], tenant="alice", prompt_param="messages")
    return GenerateSpec(**{**base, "messages": [{"role": "user", "content": "w " * 200}], **kw})


@pytest.mark.parametrize("shared", [False, True])
def test_the_prefill_request_is_keyed_as_the_clients(tokenizer, tmp_path, shared):
    adapter = AdapterRef("alice/a", tmp_path, "v1")
    for s in (spec(), spec(cache_salt="s"), spec(adapter=adapter), spec(add_special_tokens=True)):
        p = prefill_spec(s)
        assert route_hashes(tokenizer, p, 16, shared) == route_hashes(tokenizer, s, 16, shared)
        assert len(route_hashes(tokenizer, s, 16, shared)) >= MIN_PREFILL_BLOCKS
        assert p.request_ids == ["r1-prefill"] and len(p.params) == 1
        assert p.params[0].max_tokens == 1 and p.max_tokens == 1 and p.params[0].temperature == 0
        assert p.params[0].grammar is None and p.tenant == s.tenant and p.adapter == s.adapter
    assert route_hashes(tokenizer, spec(cache_salt="s"), 16, shared) != route_hashes(
        tokenizer, spec(), 16, shared
    )


def test_which_requests_take_the_prefill_pool():
    hashes = tuple(range(MIN_PREFILL_BLOCKS))
    assert wants_prefill([spec()], hashes)
    assert not wants_prefill([spec()], hashes[:-1])  # too short to gain
    assert not wants_prefill([spec(), spec()], hashes)  # several prompts
    logprobs = SamplingParams(prompt_logprobs=1)
    assert not wants_prefill([spec(params=[logprobs])], hashes)  # no prefix hit allowed


def args(**kw) -> argparse.Namespace:
    base = dict(
        replicas=None, min_replicas=None, prefill_replicas=None, decode_replicas=None, ray_address=None,
        kv_shared_dir=None,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_pool_flags():
    assert pools(args(replicas=3)) == (0, 3)
    assert pools(args(prefill_replicas=1, decode_replicas=2)) == (1, 2)
    assert pools(args(prefill_replicas=2)) == (2, 1)
    assert pools(args(prefill_replicas=2, replicas=3)) == (2, 3)
    with pytest.raises(ValueError, match="--decode-replicas goes with --prefill-replicas"):
        pools(args(decode_replicas=2))
    with pytest.raises(ValueError, match="disagree"):
        pools(args(prefill_replicas=1, decode_replicas=2, replicas=3))
    assert kv_shared_dir(args(), 0) is None
    assert kv_shared_dir(args(), 1) == DEFAULT_KV_SHARED_DIR
    assert kv_shared_dir(args(kv_shared_dir="s3://b/kv"), 0) == "s3://b/kv"
    with pytest.raises(ValueError, match="--kv-shared-dir"):
        kv_shared_dir(args(ray_address="h:6379"), 1)


def test_the_serve_parser_has_the_flags():
    from motet.api.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    ns = sub.choices["serve"].parse_args(
        ["--prefill-replicas", "1", "--decode-replicas", "2", "--kv-shared-gb", "2"]
    )
    assert (ns.prefill_replicas, ns.decode_replicas, ns.kv_shared_gb, ns.kv_shared_dir) == (1, 2, 2.0, None)
    for bad in (["--prefill-replicas", "0"], ["--kv-shared-gb", "0"], ["--kv-shared-gb", "nan"]):
        with pytest.raises(SystemExit):
            sub.choices["serve"].parse_args(bad)


def test_shared_blocks_make_a_decode_replica_chosen_by_load():
    """Replica "warm" holds the prompt's 10 blocks on its device and has 6 requests; "cold" has none and 2.
    Colocated, the prefix is worth its prefill (10 x 73 ms) and warm wins; once the shared tier holds the blocks,
    holding them saves only their load (10 x 2 ms), less than 4 more requests' delay (4 x 6.2 ms): cold wins."""
    policy = RoutingPolicy()
    index = PrefixIndex()
    blocks = tuple(range(1000, 1010))
    index.report_snapshot("warm", blocks, ())
    loads = {"warm": ReplicaLoad(6), "cold": ReplicaLoad(2)}
    rng = random.Random(0)
    assert policy.rank(RouteRequest(blocks), ["warm", "cold"], index, loads, rng)[0] == "warm"
    assert (
        policy.rank(RouteRequest(blocks, shared_blocks=10), ["warm", "cold"], index, loads, rng)[0] == "cold"
    )
    # and a request whose blocks are in the shared tier weighs on a replica as a decode, not a prefill
    assert policy.request_load(RouteRequest(blocks, shared_blocks=10), 0) < policy.request_load(
        RouteRequest(blocks), 0
    )
    assert policy.request_load(RouteRequest(blocks, shared_blocks=10), 10) == policy.request_load(
        RouteRequest(blocks), 20
    )


def test_each_pool_publishes_its_own_reports():
    pytest.importorskip("ray")
    from motet.cluster import reports
    from motet.cluster.reports import ReplicaReport
    from motet.cluster.router import publish

    def replica(rid):
        report = ReplicaReport.from_dict({})  # None: not reported yet
        assert report is None
        stats = {"stats": {}, "replica": rid}
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)

    reports.LATEST.clear()
    reports.POOLS.clear()
    sentinel = object()
    publish([replica("p1")], "prefill")
    publish([replica("d1"), replica("d2")], "decode")
    reports.LATEST.update({"p1": sentinel, "d1": sentinel, "d2": sentinel})
    publish([replica("d1")], "decode")  # d2 gone from the decode pool: only it is dropped
    assert set(reports.LATEST) == {"p1", "d1"}
    publish([], "prefill")
    assert set(reports.LATEST) == {"d1"}
    reports.LATEST.clear()
    reports.POOLS.clear()
