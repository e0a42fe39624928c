"""KV tiers past the device cache (motet/engine/core/kv_connector.py, kv_tiers.py): prefixes evicted from the KV
cache come back from host RAM or local disk, outputs stay those of HF / PEFT and of the engine without tiers,
a restart keeps the disk's blocks, a damaged entry is recomputed, never served, and a tenant's or salt's
blocks stay its own."""

from __future__ import annotations

import io
import json
import threading
import time

import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from motet.engine.config import EngineConfig
from motet.engine.core.block_manager import chain_block_hashes
from motet.engine.core.kv_blocks import KVLayout, model_identity, read_blocks, write_blocks
from motet.engine.core.kv_connector import KVConnector
from motet.engine.core.kv_tiers import (
    KV_CACHE_SUBDIR,
    CorruptEntry,
    DiskTier,
    encode_entry,
    entry_name,
    read_entry_into,
)
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import JsonSchemaSpec
from tests.peft_adapters import peft_reference


def decode_entry(
    blob: bytes, identity: str, h: int, token_ids: tuple[int, ...], layout: KVLayout
) -> torch.Tensor:
    """The block's tensor from a whole entry's bytes, read as the disk tier's loader reads a file
    (motet/engine/core/kv_tiers.py read_entry_into); CorruptEntry unless it is the sound entry of (identity, h,
    tokens) in `layout`."""
    out = torch.empty(layout.block_shape, dtype=layout.dtype)
    read_entry_into(io.BytesIO(blob), identity, h, token_ids, layout, out)
    return out


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

BS = 8  # tokens per block
NUM_BLOCKS = 24  # a KV cache of 192 tokens: a few prompts evict the earlier ones
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 31 + j * 17 + seed * j) % 300 + 3 for j in range(n)]


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def small_llm(model_dir, adapters=None, **options) -> LLM:
    llm = LLM(str(model_dir), num_kv_blocks=NUM_BLOCKS, block_size=BS, max_lora_rank=32, **options)
    for name, path in (adapters or {}).items():
        llm.add_lora(name, path)
    return llm


def tier_options(tier: str, tmp_path) -> dict:
    if tier == "ram":
        return {"kv_offload_gb": 0.05}
    return {"kv_disk_gb": 0.05, "kv_disk_dir": str(tmp_path / KV_CACHE_SUBDIR)}


def tier_stats(llm: LLM, name: str):
    (tier,) = [t for t in llm.engine.stats().kv_tiers if t.tier == name]
    return tier


def evict_everything(llm: LLM, adapter=None) -> None:
    """Run other prompts until none of the earlier blocks is left in the device cache."""
    llm.generate([tokens(64, 100 + s) + [5] for s in range(4)], greedy(2), [adapter] * 4 if adapter else None)
    if llm.engine.kv_connector is not None:
        llm.engine.kv_connector.flush()  # the disk writes of their blocks and the earlier ones have landed


def on_device(llm: LLM, prompt: list[int], adapter_id: int = 0, salt: int = 0) -> int:
    hashes = chain_block_hashes(prompt, adapter_id, salt, BS, len(prompt) - 1)
    return sum(h in llm.engine.block_manager.cached for h in hashes)


def base_reference(peft, prompt: list[int], n: int = 6) -> list[int]:
    return peft_reference(peft, None, prompt, n)[0][len(prompt) :]


def test_greedy_outputs_with_tiers_are_those_without(tiny_model_dir, tiny_loras, tmp_path):
    """With mixed adapters and a JSON-schema grammar."""
    peft, paths = tiny_loras
    names = ["qv4", None, "all8", "qv4", None, "kod16", None, "all8"]
    prompts = [tokens(40 + 3 * i, i) for i in range(len(names))]
    params = [
        SamplingParams(temperature=0, max_tokens=24, grammar=JsonSchemaSpec(SCHEMA))
        if i in (1, 5)
        else greedy(8)
        for i in range(len(names))
    ]

    def run(**tiers):
        llm = small_llm(tiny_model_dir, paths, **tiers)
        first = llm.generate(prompts, params, names)
        if llm.engine.kv_connector is not None:
            llm.engine.kv_connector.flush()
        again = llm.generate(prompts, params, names)  # the earlier requests' blocks were evicted meanwhile
        return llm, [o.token_ids for o in first], [o.token_ids for o in again], first

    _, off_first, off_again, outs = run()
    assert off_again == off_first
    for p, n, sp, out in zip(prompts, names, params, outs, strict=True):
        if sp.grammar is None:  # the reference: PEFT's greedy continuation with the request's adapter
            assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :], n
        elif out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    for tier in ("ram", "disk"):
        llm, first, again, _ = run(**tier_options(tier, tmp_path))
        assert first == off_first and again == off_again, tier
        assert tier_stats(llm, tier).hit_tokens > 0, tier  # the second pass did load blocks
        llm.engine.close()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_an_evicted_prefix_is_served_from_the_tier(tiny_model_dir, tiny_loras, tmp_path, tier):
    peft, _ = tiny_loras
    llm = small_llm(tiny_model_dir, **tier_options(tier, tmp_path))
    prefix = tokens(64, 1)
    (first,) = llm.generate([prefix + [5]], greedy())
    assert first.num_cached_tokens == 0
    evict_everything(llm)
    assert on_device(llm, prefix + [7]) == 0
    before, tier_before = llm.engine.stats(), tier_stats(llm, tier)
    (out,) = llm.generate([prefix + [7]], greedy())
    after, tier_after = llm.engine.stats(), tier_stats(llm, tier)
    assert out.num_cached_tokens == 64
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert tier_after.hit_tokens - tier_before.hit_tokens == 64
    assert tier_after.loads == tier_before.loads + 1
    assert out.token_ids == base_reference(peft, prefix + [7])
    llm.engine.kv_connector.flush()  # the finished request's blocks are copied out and released
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS  # nothing held after the requests


def test_a_restart_serves_prefixes_from_disk(tiny_model_dir, tiny_loras, tmp_path):
    peft, paths = tiny_loras
    options = tier_options("disk", tmp_path)
    system = tokens(64, 2)
    llm = small_llm(tiny_model_dir, paths, **options)
    llm.generate([system + [5], system + [6]], greedy(), [None, "qv4"])
    llm.engine.close()

    again = small_llm(tiny_model_dir, paths, **options)  # a new engine, the same directory
    base, adapted = again.generate([system + [9], system + [9]], greedy(), [None, "qv4"])
    assert base.num_cached_tokens == adapted.num_cached_tokens == 64
    assert tier_stats(again, "disk").hit_tokens == 128
    assert base.token_ids == base_reference(peft, system + [9])
    assert adapted.token_ids == peft_reference(peft, "qv4", system + [9], 6)[0][65:]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_disk_entry_is_dropped_and_recomputed(tiny_model_dir, tiny_loras, tmp_path, damage):
    peft, _ = tiny_loras
    options = tier_options("disk", tmp_path)
    system = tokens(64, 3)
    llm = small_llm(tiny_model_dir, **options)
    llm.generate([system + [5]], greedy())
    llm.engine.close()
    disk = llm.engine.kv_connector.disk
    hashes = chain_block_hashes(system + [5], 0, 0, BS, 64)
    victim = disk.dir / entry_name(hashes[3])  # the fourth block: three are served, the rest recomputed
    blob = bytearray(victim.read_bytes())
    if damage == "flip":
        blob[-100] ^= 0x40  # one bit of the KV values
        victim.write_bytes(bytes(blob))
    else:
        victim.write_bytes(bytes(blob[: len(blob) // 2]))

    again = small_llm(tiny_model_dir, **options)
    (out,) = again.generate([system + [9]], greedy())
    assert out.num_cached_tokens == 3 * BS
    stats = tier_stats(again, "disk")
    assert stats.dropped_entries == 1 and stats.hit_tokens == 3 * BS
    assert out.token_ids == base_reference(peft, system + [9])
    again.engine.close()
    assert victim.exists()  # written again from the recomputed block, sound this time
    decode_entry(victim.read_bytes(), disk.identity, hashes[3], tuple(system[24:32]), disk.layout)


def test_another_model_never_reads_the_entries(tiny_model_dir, tmp_path):
    from tests.tiny_models import build_tiny_model

    options = tier_options("disk", tmp_path)
    other_dir = build_tiny_model(tmp_path / "other", seed=1)  # the same shapes, other weights
    system = tokens(64, 4)
    llm = small_llm(tiny_model_dir, **options)
    llm.generate([system + [5]], greedy())
    llm.engine.close()
    other = small_llm(other_dir, **options)
    (out,) = other.generate([system + [5]], greedy())
    assert out.num_cached_tokens == 0 and tier_stats(other, "disk").hit_tokens == 0
    assert other.engine.kv_connector.disk.identity != llm.engine.kv_connector.disk.identity
    # nor another KV dtype, on the same weights
    layout = KVLayout.of(llm.engine.runner.kv_caches)
    bf16 = KVLayout(
        layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, torch.bfloat16
    )
    assert model_identity(tiny_model_dir, None, bf16) != model_identity(tiny_model_dir, None, layout)


def test_a_salted_tenant_never_hits_another_tenants_blocks_in_the_tiers(tiny_model_dir, tmp_path):
    options = {**tier_options("ram", tmp_path), **tier_options("disk", tmp_path)}
    system = tokens(64, 5)

    def run(llm, tenant, cache_salt=None):
        params = SamplingParams(temperature=0, max_tokens=2, cache_salt=cache_salt)
        rid = llm.engine.add_request(system + [5], params, tenant=tenant)
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.request_id == rid and out.finished:
                    return out.num_cached_tokens
        raise AssertionError("the request did not finish")

    llm = small_llm(tiny_model_dir, **options)
    assert run(llm, "alice") == 0
    evict_everything(llm)
    hits = [t.hit_tokens for t in llm.engine.stats().kv_tiers]
    assert run(llm, "bob") == 0  # another tenant
    assert run(llm, "alice", cache_salt="s") == 0  # another salt of the same tenant
    assert [t.hit_tokens for t in llm.engine.stats().kv_tiers] == hits  # neither loaded anything
    assert run(llm, "alice") == 64  # alice's own blocks are there
    llm.engine.close()

    again = small_llm(tiny_model_dir, **options)  # on disk, after a restart, alike
    assert run(again, "bob", cache_salt="s") == 0
    assert tier_stats(again, "disk").hit_tokens == 0
    assert run(again, "alice") == 64


def test_a_load_never_holds_up_other_requests_and_an_abort_leaks_no_block(
    tiny_model_dir, tmp_path, monkeypatch
):
    gate = threading.Event()
    fill = KVConnector._fill
    monkeypatch.setattr(KVConnector, "_fill", lambda self, load: (gate.wait(30), fill(self, load)))
    llm = small_llm(tiny_model_dir, **tier_options("ram", tmp_path))
    engine = llm.engine
    prefix = tokens(64, 6)
    llm.generate([prefix + [5]], greedy())
    evict_everything(llm)

    loading = engine.add_request(prefix + [7], greedy())
    other = engine.add_request(tokens(20, 7), greedy(3))
    finished = set()
    for _ in range(50):  # the other request runs to its end while the load is held back
        finished |= {o.request_id for o in engine.step() if o.finished}
        if other in finished:
            break
    assert other in finished and loading not in finished
    assert engine.kv_connector.num_loading == 1
    engine.abort(loading)
    gate.set()
    deadline = time.monotonic() + 30
    while engine.kv_connector.num_loading and time.monotonic() < deadline:
        engine.step()  # hands the finished load over
        time.sleep(0.01)
    assert not engine.has_unfinished()
    engine.kv_connector.flush()
    bm = engine.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS and all(b.ref_count == 0 for b in bm.blocks)
    assert on_device(llm, prefix + [7]) == 8  # the loaded blocks joined the device cache


def test_disk_tier_bound_restart_and_leftovers(tmp_path):
    layout = KVLayout(2, 4, 2, 8, torch.float32)
    blocks = {h: (tuple(range(h, h + 4)), torch.randn(layout.block_shape)) for h in range(-3, 7)}
    size = len(encode_entry("id", 0, blocks[0][0], blocks[0][1]))
    disk = DiskTier(tmp_path, 4 * size, "id", layout)
    for h, (toks, data) in blocks.items():
        assert disk.write(h, toks, data)
    assert disk.num_entries == 4 and disk.bytes <= 4 * size
    assert len(list((tmp_path / "id").glob("*.kv"))) == 4
    assert disk.read(6, blocks[6][0]) is not None and disk.read(6, (0, 0, 0, 0)) is None  # tokens must match
    (tmp_path / "id" / "half-written.tmp").write_bytes(b"x")
    again = DiskTier(tmp_path, 4 * size, "id", layout)  # a restart
    assert again.num_entries == 4 and not list((tmp_path / "id").glob("*.tmp"))
    torch.testing.assert_close(again.read(6, blocks[6][0]), blocks[6][1], rtol=0, atol=0)
    with pytest.raises(CorruptEntry, match="another model"):
        decode_entry(encode_entry("other", 6, blocks[6][0], blocks[6][1]), "id", 6, blocks[6][0], layout)


def test_block_copies_round_trip(tiny_model_dir):
    llm = small_llm(tiny_model_dir)
    kv = llm.engine.runner.kv_caches
    data = torch.randn((3, *KVLayout.of(kv).block_shape))
    write_blocks(kv, [5, 1, 9], data)
    torch.testing.assert_close(read_blocks(kv, [5, 1, 9]), data, rtol=0, atol=0)
    torch.testing.assert_close(kv[1][1][9], data[2, 1, 1], rtol=0, atol=0)  # layer 1's v of the third


def test_tier_figures_in_metrics(tiny_model_dir, tmp_path):
    from motet.actors.system import Stats
    from motet.api.metrics import Metrics

    llm = small_llm(tiny_model_dir, **tier_options("ram", tmp_path))
    prefix = tokens(64, 8)
    llm.generate([prefix + [5]], greedy())
    evict_everything(llm)
    llm.generate([prefix + [7]], greedy())
    es = llm.engine.stats()
    metrics = Metrics("tiny")
    metrics.refresh(Stats(kv_tiers=es.kv_tiers))
    samples = {
        (s.name, s.labels.get("tier"), s.labels.get("le")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("motet_kv_tier_hit_tokens_total", "ram", None)] == 64
    assert samples[("motet_kv_tier_bytes", "ram", None)] > 0
    assert samples[("motet_kv_tier_load_seconds_count", "ram", None)] == 1
    assert samples[("motet_kv_tier_load_seconds_bucket", "ram", "+Inf")] == 1
    assert samples[("motet_kv_tier_saved_blocks_total", "ram", None)] >= 8


def test_tier_options_are_validated():
    from motet.api.cli import build_parser

    with pytest.raises(ValueError, match="kv_disk_dir"):
        EngineConfig(kv_disk_gb=1)
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(kv_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineConfig(kv_offload_gb=float("nan"))
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(kv_offload_gb=1, tensor_parallel_size=2)
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--prompt", "x", "--kv-offload-gb", bad])
    args = build_parser().parse_args(["serve", "--kv-disk-gb", "2", "--data-dir", "/srv/motet"])
    from motet.api.cli import engine_config

    config = engine_config(args)
    assert config.kv_disk_gb == 2 and config.kv_disk_dir == f"/srv/motet/{KV_CACHE_SUBDIR}"


def test_serve_keeps_prefixes_in_the_tiers_and_across_a_restart(tiny_model_dir, tmp_path):
    """`motet serve --kv-offload-gb --kv-disk-gb`: an evicted prompt prefix comes back from RAM (cached_tokens,
    /metrics), and after a restart on the same --data-dir from disk (the shutdown flushed the disk writes)."""
    import httpx

    from tests.live_server import Server

    flags = ["--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"), "--threads", "1",
             "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BS), "--kv-offload-gb", "0.05",
             "--kv-disk-gb", "0.05"]  # fmt: skip

    def cached(server: Server, prompt: list[int]) -> int:
        body = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    prefix = tokens(64, 9)
    server = Server(tmp_path, *flags, start_timeout=120)
    try:
        assert cached(server, prefix + [5]) == 0
        for s in range(4):  # evict it from the KV cache
            cached(server, tokens(64, 200 + s) + [5])
        assert cached(server, prefix + [6]) == 64
        assert server.metrics()['motet_kv_tier_hit_tokens_total{tier="ram"}'] == 64
    finally:
        server.stop()
    server = Server(tmp_path, *flags, start_timeout=120)
    try:
        assert cached(server, prefix + [7]) == 64
        assert server.metrics()['motet_kv_tier_hit_tokens_total{tier="disk"}'] == 64
    finally:
        server.stop()
