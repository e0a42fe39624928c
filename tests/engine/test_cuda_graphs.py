"""Decode from CUDA graphs (motet/engine/worker/cuda_graphs.py) and the sync-free KV write it needs.

The write kernel runs under TRITON_INTERPRET=1 on CPU machines; the graph-vs-eager check needs CUDA."""

from __future__ import annotations

import pytest
import torch

from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.cuda_graphs import DecodeGraphs, bucket_for, buckets
from motet.kernels import paged_attention as pa
from motet.kernels import triton_support
from tests.engine.helpers import mixed_adapter_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = buckets(48)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 48, 49)] == [1, 4, 8, 16, 48, 48, None]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_triton_skips_negative_slots(dtype):
    """The Triton write (the CUDA path of write_kv_cache: no host sync) equals the torch path, strided
    inputs and skipped slots included."""
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 3, 24  # head_dim not a power of two
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(6, 4 * num_kv_heads, head_dim, generator=g).to(dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 3 * num_kv_heads :]  # views of a fused projection
    slots = torch.tensor([13, -1, 0, 7, -1, 19])
    expected_k, expected_v = cache[0].clone(), cache[1].clone()
    pa.write_kv_cache(k, v, expected_k, expected_v, slots)  # CPU tensors: the torch path
    got_k, got_v = cache[0].clone().to(DEVICE), cache[1].clone().to(DEVICE)
    pa.write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), expected_k) and torch.equal(got_v.cpu(), expected_v)
    pa.write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), got_k, got_v, torch.full((6,), -1, device=DEVICE))
    assert torch.equal(got_k.cpu(), expected_k)


def test_runner_ignores_graphs_on_cpu(tiny_model_dir):
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=64), model_dir=tiny_model_dir
    )
    assert engine.runner.graphs is None


def test_lora_graph_signature_is_the_groups_launched_and_the_rank_tile(tmp_path):
    """A captured graph launches one shrink and one expand per module group some adapter targets, with a rank tile;
    the kernels read each adapter's slot, rank, targets and weights from the pool at the replay. So steps share a
    graph whatever their slots, ranks within the tile and modules within the groups; another group or a wider
    tile takes another graph."""
    from motet.lora.manager import AdapterManager, AdapterRef
    from tests.lora.test_lora_pool import BASE, write_adapter

    specs = {  # uid: (rank, modules)
        1: (4, ["q_proj", "v_proj"]),
        2: (4, ["q_proj", "v_proj"]),  # as 1, in another slot
        3: (4, ["q_proj", "k_proj", "v_proj"]),  # one more module of the same group
        4: (8, ["q_proj", "v_proj"]),  # a higher rank within the tile
        5: (4, ["up_proj"]),  # another group
        6: (16, ["v_proj"]),  # a wider tile
    }
    paths = {uid: write_adapter(tmp_path / f"a{uid}", r, mods, seed=uid) for uid, (r, mods) in specs.items()}
    m = AdapterManager(BASE, memory_bytes=1 << 20, host_bytes=1 << 20, max_lora_rank=16, background=False)
    uids = {i: m.acquire(AdapterRef.of(f"a{i}", p)) for i, p in paths.items()}
    m.prefetch(list(uids.values()), set())
    graphs = DecodeGraphs(lambda *a: None, max_batch=4, max_blocks_per_seq=2, max_seq_len=16, device="cpu")

    def signature(*ids):
        return graphs._signature(m.batch([uids[i] for i in ids], [1] * len(ids)))

    assert signature(1) == signature(2) == signature(3) == signature(4) == signature(1, 4)
    assert len({signature(1), signature(5), signature(1, 5), signature(6)}) == 4


@needs_cuda
@pytest.mark.parametrize("adapters", [0, 2], ids=["base", "2-adapters"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_equals_eager(tiny_model_dir, tmp_path, dtype, adapters):
    """Greedy decode of ragged prompts, batch sizes between buckets, graphs vs eager: the same tokens; with
    adapters, a mixed batch (two adapters and the base model)."""
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.engine.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 33, 60, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        cfg = EngineConfig(
            model=str(tiny_model_dir),
            dtype=dtype,
            device="cuda",
            block_size=8,
            num_kv_blocks=256,
            compile_step=graphs,
        )
        engine = LLMEngine(cfg, model_dir=tiny_model_dir)
        assert (engine.runner.graphs is not None) == graphs
        outs[graphs] = mixed_adapter_tokens(engine, prompts, params, adapters, tmp_path)
        if graphs:
            assert engine.runner.graphs.replays > 0
            assert engine.runner.graphs.graphs  # at least one bucket captured
    assert outs[True] == outs[False]


class EagerReplay:
    """A recorded step replayed by running it again over the same static buffers, writing the same output
    tensor: what a captured graph does, on any device."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


class PlannedEachStep(AttentionMetadata):
    """(the CPU attention's host-side plan is made from the tables of each replay, not kept from the first)"""

    cpu_plan = property(lambda self: None, lambda self, plan: None)


class CpuGraphs(DecodeGraphs):
    """DecodeGraphs whose replays run their step again eagerly (`EagerReplay`): its inputs on a CPU."""

    def _meta(self, b, q=1):
        return PlannedEachStep(**{**vars(super()._meta(b, q)), "cpu_plan": None})

    def _record(self, step):
        out = step()
        return EagerReplay(step, out), out


def use_cpu_graphs(engine, **options) -> None:
    """`engine`'s decode steps through CpuGraphs, as the runner makes its DecodeGraphs on CUDA (`options`: theirs)."""
    runner = engine.runner
    runner.use_graphs(
        CpuGraphs(
            lambda ids, pos, meta, lora, r=runner: r.model(ids, pos, meta, r.kv_caches, lora),
            max_batch=engine.config.max_num_seqs,
            max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
            max_seq_len=runner.max_model_len,
            device=runner.device,
            **options,
        )
    )


@pytest.mark.parametrize("speculative", ["off", "ngram", "async"])
@pytest.mark.parametrize("adapters", [0, 2], ids=["base", "2-adapters"])
def test_graph_inputs_on_cpu(tiny_model_dir, tmp_path, adapters, speculative):
    """DecodeGraphs' inputs (buckets, padding rows, the packed transfers, per-token LoRA segments; with
    speculation, verification rows of 1 + drafts tokens padded to the bucket's; with async scheduling, the
    pending tokens fed into the static buffer from the step before's) with its replays run eagerly on CPU:
    greedy decode of ragged prompts equals the eager model's, which the engine tests check against Hugging
    Face."""
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.engine.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 33, 60, 2, 9)]
    if speculative != "off":  # prompts that repeat themselves: prompt lookup drafts from them
        prompts = [p * 4 for p in prompts[:4]] + [[5, 6, 7, 8] * 6, [9, 10] * 9, [11] * 20]
    outs = {}
    for graphs in (False, True):
        cfg = EngineConfig(
            model=str(tiny_model_dir),
            device="cpu",
            block_size=8,
            num_kv_blocks=256,
            compile_step=False,
            speculative="ngram" if speculative == "ngram" else "off",
            overlap_output="on" if speculative == "async" and graphs else "off",  # (the reference: in order)
        )
        engine = LLMEngine(cfg, model_dir=tiny_model_dir)
        runner = engine.runner
        if graphs:
            use_cpu_graphs(engine, max_query=1 + cfg.num_speculative_tokens if speculative == "ngram" else 1)
        # rows ending one by one: the batch goes through the buckets
        params = [
            SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))
        ]
        outs[graphs] = mixed_adapter_tokens(engine, prompts, params, adapters, tmp_path)
        if graphs:
            keys = runner.graphs.graphs.keys()
            if speculative == "async":
                assert engine.num_steps_ahead > 0 and {key[0] for key in keys} >= {1, 2, 4, 8}
            elif speculative == "off":
                assert {key[0] for key in keys} == {1, 2, 4, 8}
            else:  # verification steps replayed too, in several buckets
                assert any(key[1] > 1 for key in keys) and len({key[0] for key in keys}) > 1, keys
    assert outs[True] == outs[False]
