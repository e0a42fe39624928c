"""Sliding-window attention past the window (motet/engine/core/kv_window.py): Mistral's window on every layer,
Gemma 2's every other layer (with soft-capping) and Gemma 3's local layers beside a global one, on both CPU paths
(the native step and the eager decoder) and over two ranks, against transformers (its sliding-window mask and its
cache), with the KV blocks a long request holds in those layers bounded by the window."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from motet.engine.config import EngineConfig
from motet.engine.core.kv_window import ring_blocks
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.kernels import cpu_native
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import engine_logits, hf_greedy_outputs, hf_logits
from tests.models.test_moe import PATHS, randomize_norms
from tests.tiny_models import build_tiny_model

WINDOW, BLOCK = 20, 4

FAMILIES = {
    "mistral": {"sliding_window": WINDOW},  # every layer
    "gemma2": {  # every other layer, soft-capped scores and logits
        "sliding_window": WINDOW,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "pad_token_id": 0,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 4.0,
    },
    "gemma3": {  # a local layer, with its own rope base, beside a global one
        "sliding_window": WINDOW,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "pad_token_id": 0,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    },
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp(request.param), arch=request.param, **FAMILIES[request.param]
    )
    randomize_norms(path)
    return path


def engine(model_dir, compiled: bool = True, **kw) -> LLMEngine:
    """An engine past the window, on the native step (`compiled`, where the kernels build) or the eager decoder."""
    config = EngineConfig(
        model=str(model_dir), block_size=BLOCK, max_model_len=512, compile_step=compiled, **kw
    )
    eng = LLMEngine(config, model_dir=model_dir)
    assert (eng.runner.native is not None) == (compiled and cpu_native.library() is not None)
    return eng


@pytest.mark.parametrize("compiled", PATHS)
def test_logits_past_the_window_match_transformers(model_dir, compiled):
    """Every position of prompts up to 3.5 windows long, in chunks of 16 and of 7, equals transformers' forward
    under its sliding-window mask; the window layers' cache holds fewer blocks than the others'."""
    eng = engine(model_dir, compiled, num_kv_blocks=256)
    prompts = [list(range(3, 73)), [5, 9, 11, 200] * 11, list(range(40, 47))]
    for chunk in (16, 7):
        for prompt, got in zip(prompts, engine_logits(eng, prompts, chunk=chunk), strict=True):
            torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=2e-4, rtol=1e-4)
    runner = eng.runner
    assert runner.window == WINDOW and runner.window_layers
    for i, (k, _) in enumerate(runner.kv_caches):
        assert k.shape[0] == (runner.num_window_blocks if i in runner.window_layers else runner.num_blocks)


@pytest.mark.parametrize("compiled", PATHS)
def test_greedy_past_the_window_matches_transformers_generate(model_dir, compiled):
    """Nine requests at once (batched decodes among them), prompts shorter and longer than the window, 40 greedy
    tokens each: transformers' generate with its sliding-window cache, token for token."""
    llm = LLM(
        str(model_dir), block_size=BLOCK, max_model_len=512, max_num_batched_tokens=32, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == (compiled and cpu_native.library() is not None)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((1, 5, 19, 20, 21, 33, 47, 60, 8))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == hf_greedy_outputs(model_dir, prompts, 40)
    window = llm.engine.block_manager.window
    assert window.num_used_blocks == 0  # every ring given back


@pytest.mark.parametrize("compiled", PATHS)
def test_window_blocks_stay_bounded_by_the_window(model_dir, compiled):
    """A request of 300 tokens, 15 windows: the window layers' blocks it holds never pass a ring (a window plus
    one chunk), while the global layers' grow with it; the scheduler's chunks stay within the window; its
    greedy tokens are transformers' (whose sliding-window cache keeps the window alone too)."""
    eng = engine(model_dir, compiled, num_kv_blocks=256, max_num_batched_tokens=64)
    ring = ring_blocks(WINDOW, eng.runner.window_chunk, BLOCK)
    assert eng.runner.ring == ring == 12  # (20 + 20 - 2) / 4 rounded up, + 2
    prompt = list(range(3, 103))
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    window_held, global_held, chunks, computed, tokens = [], [], [], 0, None
    answers = RequestOutputs()
    while eng.has_unfinished():
        for out in answers.step(eng):
            tokens = out.token_ids if out.finished else tokens
        for seq in eng.scheduler.running:
            window_held.append(len(seq.window_blocks))
            global_held.append(len(seq.block_table))
            chunks.append(seq.num_computed_tokens - computed)
            computed = seq.num_computed_tokens
    assert max(window_held) == ring and max(global_held) == 300 // BLOCK
    assert max(chunks) == WINDOW  # the prompt of 100 went in chunks of the window, not of the 64 budget
    assert eng.block_manager.window.num_used_blocks == 0
    assert tokens == hf_greedy_outputs(model_dir, [prompt], 200)[0]


def test_a_window_pool_without_prefix_caching_and_tiers(model_dir, tmp_path):
    """Past the window a prefix hit would need the window's KV before it, which the rings do not keep: prefix
    caching is off there (on within the window), and the KV tiers that extend it are refused by name."""
    assert not engine(model_dir, num_kv_blocks=64).block_manager.enable_prefix_caching
    within = LLMEngine(
        EngineConfig(model=str(model_dir), num_kv_blocks=64, max_model_len=WINDOW), model_dir=model_dir
    )
    assert within.block_manager.enable_prefix_caching and within.runner.window is None
    with pytest.raises(ModelLoadError, match="sliding window"):
        engine(model_dir, num_kv_blocks=64, kv_offload_gb=0.01)


def test_two_ranks_past_the_window_match_transformers(model_dir):
    """Tensor parallelism: the driver sends the window layers' slots and tables with each step's plan."""
    from tests.engine.test_tensor_parallel import tp_workers

    eng = engine(model_dir, num_kv_blocks=128, tensor_parallel_size=2)  # (the native step on both ranks)
    try:
        assert eng.runner.workers is not None and eng.runner.window == WINDOW
        prompts = [list(range(3, 60)), [5, 9, 11, 200] * 8]
        for prompt, got in zip(prompts, engine_logits(eng, prompts, chunk=13), strict=True):
            torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=2e-4, rtol=1e-4)
    finally:
        eng.close()
    assert tp_workers() == []


def hub_config(model_dir) -> None:
    """config.json as the Hub's Qwen configs say it: no layer_types (transformers >= 5 writes its own), so that
    both readers compute the sliding layers from use_sliding_window and max_window_layers."""
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["layer_types"]
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_slides_the_layers_from_max_window_layers_on(arch, tmp_path):
    """Qwen2 / Qwen3 with use_sliding_window: transformers slides only the layers from max_window_layers on (the
    first of two layers attends to every position), as motet now does; it slid every layer, and its tokens
    parted from transformers' at the first token past the window. Greedy tokens past a window of 8."""
    model_dir = build_tiny_model(
        tmp_path, arch=arch, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    hub_config(model_dir)
    assert ModelConfig.from_dir(model_dir).window_layers == (1,)
    llm = LLM(str(model_dir), block_size=BLOCK, max_model_len=128, num_kv_blocks=128)
    prompts = [list(range(3, 9)), list(range(40, 70))]  # within the window and past it, then 24 tokens on
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy_outputs(model_dir, prompts, 24)


# transformers' config classes with a window of 8 over 7 layers and no layer_types, as the Hub's configs say them:
# the layers it slides, from use_sliding_window / max_window_layers / sliding_window_pattern
WINDOW_CONFIGS = [
    ("Qwen2ForCausalLM", Qwen2Config, dict(use_sliding_window=True, max_window_layers=4)),
    ("Qwen2ForCausalLM", Qwen2Config, dict(use_sliding_window=True, max_window_layers=9)),  # none slides
    ("Qwen2ForCausalLM", Qwen2Config, dict(use_sliding_window=False, max_window_layers=2)),
    ("Qwen3ForCausalLM", Qwen3Config, dict(use_sliding_window=True, max_window_layers=2)),
    ("Qwen2MoeForCausalLM", Qwen2MoeConfig, dict(use_sliding_window=True, max_window_layers=5)),
    ("Qwen3MoeForCausalLM", Qwen3MoeConfig, dict(use_sliding_window=True)),  # (every layer: no layer_types)
    ("Gemma3ForCausalLM", Gemma3TextConfig, dict(sliding_window_pattern=3)),
    ("Gemma3ForCausalLM", Gemma3TextConfig, {}),
    ("Gemma2ForCausalLM", Gemma2Config, {}),
]


@pytest.mark.parametrize("architecture, config_class, fields", WINDOW_CONFIGS)
def test_sliding_layers_are_transformers(architecture, config_class, fields):
    """The layers motet slides are those transformers does, where config.json lists no layer_types (Gemma 3's
    first configs slid every layer: five of each six slide)."""
    layers = dict(num_hidden_layers=7, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    hf = config_class(**layers, sliding_window=8, **fields)
    raw = {**hf.to_dict(), **fields, "architectures": [architecture]}
    raw.pop("layer_types", None)
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 7  # (Qwen3-MoE: its window on all)
    theirs = tuple(i for i, t in enumerate(types) if t == "sliding_attention" and hf.sliding_window)
    assert ModelConfig.from_dict(raw).window_layers == theirs
