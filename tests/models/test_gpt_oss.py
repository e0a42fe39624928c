"""GPT-OSS (motet/models/gpt_oss.py) against transformers on a tiny random checkpoint: attention sinks, o_proj
biases, YaRN, sliding-window layers (served past their window), a router with a bias and experts with biases,
a clamped SwiGLU and gate/up columns interleaved in the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig, ModelConfig, ModelLoadError
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.kernels import cpu_native
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy, hf_logits
from tests.tiny_models import build_tiny_model

WINDOW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def build_gpt_oss(path):
    path = build_tiny_model(
        path,
        arch="gpt_oss",
        tied=False,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    )
    # sinks, biases and norms drawn large enough to matter (transformers initializes biases to 0)
    g = torch.Generator().manual_seed(2)
    weights = load_file(path / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(("sinks", "bias")):
            t.copy_(torch.randn(t.shape, generator=g))
        elif name.endswith("norm.weight"):
            t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_config_reads_the_declaration(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.attention_bias and cfg.output_bias and cfg.attention_sinks and cfg.expert_bias
    assert (cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_limit", 1.702, 7.0)
    assert (
        cfg.sliding_layers == (0,)
        and cfg.sliding_window == WINDOW
        and cfg.rope_scaling["rope_type"] == "yarn"
    )
    assert cfg.num_experts == 4 and cfg.sparse_layers == (0, 1) and cfg.norm_topk_prob


@pytest.mark.parametrize("compiled", [True, False], ids=["native", "eager"])
def test_logits_and_greedy_match_transformers(model_dir, compiled):
    """On the native step (sinks, o biases, expert biases and the clamped SwiGLU as its ops' options) and the
    eager decoder: logits in chunks of the window and of 7 tokens (past the window: the sliding layer keeps a
    ring, which holds a window and a chunk of at most the window), then 24 greedy tokens of four prompts at once
    equal to transformers' generate."""
    llm = LLM(str(model_dir), num_kv_blocks=128, block_size=4, max_model_len=256, compile_step=compiled)
    assert llm.engine.runner.window == WINDOW
    assert (llm.engine.runner.native is not None) == (compiled and cpu_native.library() is not None)
    refs = [hf_logits(model_dir, p) for p in PROMPTS]
    for chunk in (WINDOW, 7):
        for got, ref in zip(engine_logits(llm.engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_what_is_not_served_yet_is_refused_by_name(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 1"):
        LLMEngine(
            EngineConfig(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=2), model_dir=model_dir
        )
    raw = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="MXFP4 experts are not read yet"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "mxfp4"}})
