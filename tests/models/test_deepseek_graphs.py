"""DeepSeek's latent attention in the CUDA graphs' decode steps, on a CPU: what a capture needs of a decode step
(nothing in it waits for the host: the layer's host side run on meta tensors, with the Triton launches it makes on
CUDA stubbed), and the graphs' inputs with their replays run eagerly (tests/engine/test_cuda_graphs.py's
CpuGraphs), greedy tokens equal to transformers' and PEFT's. The graphs themselves need a GPU
(test_a_dense_latent_model_decodes_from_cuda_graphs below; tests/engine/test_cuda_graphs.py's for the others)."""

from __future__ import annotations

import json

import pytest
import torch

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker import latent_attention as la
from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.kernels import latent_decode, paged_attention, triton_support
from motet.kernels.rope_kv import RotaryAngles
from motet.models.config import ModelConfig
from tests.engine.test_cuda_graphs import use_cpu_graphs
from tests.engine.test_engine import PROMPTS, hf_greedy_outputs
from tests.models.test_deepseek import LORA_TARGETS, build_deepseek
from tests.peft_adapters import peft_reference, save_peft_adapters

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return build_deepseek(tmp_path_factory.mktemp("v2"), "v2")


class Launches:
    """A Triton kernel whose launches are counted, not run (`kernel[grid](...)`)."""

    def __init__(self):
        self.count = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.count += 1

        return launch


def test_a_decode_step_waits_for_nothing_on_the_host(v2, monkeypatch):
    """A latent layer's decode step (one token a row: a graph's step) run on meta tensors, which have no data:
    reading one on the host (.tolist(), .item(), bool()) raises. With CUDA's Triton paths (the KV write, and the
    absorbed decode in splits and their merge; the launches stubbed) it runs through, three launches; a step with
    a prompt chunk (split on the host) does not, which shows the check would see a host read."""
    cfg = ModelConfig.from_dict(json.loads((v2 / "config.json").read_text()))
    with torch.device("meta"):
        layer = la.LatentAttention(cfg)
    writes, decodes = Launches(), Launches()
    monkeypatch.setattr(triton_support.kernels(paged_attention.__name__), "_write_kv_kernel", writes)
    monkeypatch.setattr(la, "write_kv_cache", paged_attention.write_kv_cache_triton)
    monkeypatch.setattr(triton_support.kernels(latent_decode.__name__), "_latent_decode_kernel", decodes)
    monkeypatch.setattr(triton_support.kernels(latent_decode.__name__), "_merge_splits_kernel", decodes)
    monkeypatch.setattr(latent_decode, "applies", lambda x: True)
    T, width = 4, layer.rank + layer.rope
    cache = torch.empty(16, 8, 1, width, device="meta")

    def step(max_query_len: int) -> torch.Tensor:
        meta = AttentionMetadata(
            block_tables=torch.empty(T, 3, dtype=torch.int32, device="meta"),
            query_start_loc=torch.empty(T + 1, dtype=torch.int32, device="meta"),
            seq_lens=torch.empty(T, dtype=torch.int32, device="meta"),
            max_query_len=max_query_len,
            max_seq_len=4096,  # (a graph's hint: the model's length; the context in splits, merged)
            slot_mapping=torch.empty(T, dtype=torch.int64, device="meta"),
        )
        half = layer.rope // 2
        angles = RotaryAngles(
            torch.empty(T, dtype=torch.int64, device="meta"),
            torch.empty(64, half, device="meta"),
            torch.empty(64, half, device="meta"),
        )
        return layer(torch.empty(T, cfg.hidden_size, device="meta"), angles, meta, (cache,))

    out = step(1)
    assert out.shape == (T, cfg.hidden_size)
    assert (writes.count, decodes.count) == (1, 2)
    with pytest.raises((NotImplementedError, RuntimeError)):
        step(2)


def test_graph_inputs_on_cpu_match_transformers_and_peft(v2, tmp_path):
    """Decode steps through the graphs' static buffers, padded to their buckets (the runner's options for a
    latent model; verification rows of drafts eager): greedy tokens of ragged prompts, rows ending one by one, equal
    to transformers'; an adapter on
    q_a / q_b / kv_a / o replays from its own graphs, one on kv_b_proj runs the same inputs eagerly; both equal
    to PEFT's."""
    # (the eager model through the graphs, as on CUDA: the native CPU step would take its weights over)
    llm = LLM(str(v2), num_kv_blocks=128, block_size=8, max_lora_rank=8, max_loras=2, compile_step=False)
    options = la.LatentAttention.graph_options(num_drafts=3)
    assert options == dict(max_query=1, eager_targets=("kv_b_proj",))
    use_cpu_graphs(llm.engine, **options)
    graphs = llm.engine.runner.graphs
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[5], PROMPTS[0]]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, min_tokens=4 + 3 * i) for i in range(5)]
    outs = llm.generate(prompts, params)
    expected = hf_greedy_outputs(v2, prompts, 16)
    assert [o.token_ids for o in outs] == [e[: 4 + 3 * i] for i, e in enumerate(expected)]
    # the batch through the buckets; the prompt-lookup drafts' verification rows eagerly (the expanded form)
    assert len({key[0] for key in graphs.graphs}) >= 3 and graphs.replays >= 5
    assert all(key[1] == 1 for key in graphs.graphs)

    targets = LORA_TARGETS["v2"]
    specs = [("all", 8, targets), ("no_kv_b", 4, [t for t in targets if t != "kv_b_proj"])]
    peft = save_peft_adapters(v2, tmp_path, specs, std=0.1)
    for name, _, _ in specs:
        llm.add_lora(name, tmp_path / name)
    lora_params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    for names, replayed in ((["no_kv_b", None], True), (["all", None], False)):
        before, keys = graphs.replays, len(graphs.graphs)
        adapted = llm.generate(prompts[:2], lora_params, adapters=names)
        for p, n, out in zip(prompts[:2], names, adapted, strict=True):
            assert out.token_ids == peft_reference(peft, n, p, 6)[0][len(p) :], n
        assert (graphs.replays > before) == replayed and (len(graphs.graphs) > keys) == replayed


def test_a_dense_latent_model_decodes_from_cuda_graphs(tmp_path):
    """A latent model without routed experts (every layer dense: the graphs stand aside for every MoE) on this
    machine's device, in fp32: on CUDA its decode steps replay from the graphs (the Triton latent kernel inside,
    its contexts in the splits of the graphs' buckets), greedy tokens equal to the eager engine's and to
    transformers'; on a CPU the eager model's, to transformers'."""
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from tests.engine.helpers import finished_tokens
    from tests.models.test_deepseek import MODELS
    from tests.models.test_moe import randomize_norms
    from tests.tiny_models import build_tiny_model

    arch, overrides = MODELS["v3"]
    model_dir = build_tiny_model(tmp_path, arch=arch, tied=False, **dict(overrides, first_k_dense_replace=3))
    randomize_norms(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[5], PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = {}
    for graphs in (False, True) if device == "cuda" else (False,):
        config = EngineConfig(
            model=str(model_dir),
            device=device,
            dtype="float32",
            block_size=8,
            num_kv_blocks=128,
            compile_step=graphs,
        )
        engine = LLMEngine(config, model_dir=model_dir)
        assert not engine.runner.model.config.is_moe
        assert (engine.runner.graphs is not None) == graphs
        for prompt in prompts:
            engine.add_request(prompt, params)
        got = finished_tokens(engine)
        outs[graphs] = [got[tuple(p)] for p in prompts]
        if graphs:
            assert engine.runner.graphs.replays > 0
    assert outs[False] == hf_greedy_outputs(model_dir, prompts, 12)
    if True in outs:
        assert outs[True] == outs[False]
