"""benchmarks/served_flops.py: a request's served work counted as torch's FLOP counter counts transformers' own
forward, and the benchmark run end to end on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.served_flops import attended, main, served_flops


@pytest.fixture(scope="module")
def eager_hf_model(tiny_model_dir):
    """transformers' model of the tiny checkpoint with its eager attention: its products are matmuls, which torch's
    FLOP counter counts (the fused CPU SDPA kernel it does not)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_one_more_output_token_costs_what_transformers_decode_step_counts(tiny_model_dir, eager_hf_model):
    """The work one more output token adds (its decode step: the projections, attention over every cached
    position and its own, one logit row) equals torch's FLOP count of transformers' forward of that token over a
    cache of the same length: decoding has no masked-out products, so the counter's full products are the
    served ones."""
    from motet.engine.weights.model_config import load_model_config

    cfg = load_model_config(tiny_model_dir)
    # a 6th output: its step runs the 5th output at position 7 + 5 - 1 = 11, attending 12 positions
    prompt, outputs = 7, 5
    ids = torch.arange(3, 3 + prompt + outputs).unsqueeze(0)
    with torch.inference_mode():
        past = eager_hf_model(ids[:, :-1], use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            eager_hf_model(ids[:, -1:], past_key_values=past, use_cache=True)
    assert (
        served_flops(cfg, prompt, outputs + 1) - served_flops(cfg, prompt, outputs)
        == counter.get_total_flops()
    )


def test_a_prompt_costs_its_projections_and_causal_attention(tiny_model_dir, eager_hf_model):
    """A prompt's forward as transformers counts it (its attention products full, P x P, as the kernels compute
    them before the causal mask), less the masked-out half: what served_flops counts for a one-token answer."""
    from motet.engine.weights.model_config import load_model_config

    cfg = load_model_config(tiny_model_dir)
    prompt = 9
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        eager_hf_model(torch.arange(3, 3 + prompt).unsqueeze(0), logits_to_keep=1)
    masked = prompt * (prompt - 1) // 2  # (query i, key j > i) pairs per head and layer
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    assert served_flops(cfg, prompt, 1) == counter.get_total_flops() - per_pair * masked


@pytest.mark.parametrize("window", [None, 1, 3, 8, 50])
def test_attended_positions_are_those_of_the_mask(window):
    """Key positions attended by a sequence's first 20 queries: the causal (sliding-window) mask's entries."""
    i, j = torch.arange(20).unsqueeze(1), torch.arange(20).unsqueeze(0)
    mask = (j <= i) & ((i - j < window) if window else True)
    assert attended(20, window) == int(mask.sum())


@pytest.mark.smoke
def test_served_flops_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    main(["--model", str(tiny_model_dir), "--dtype", "float32", "--clients", "2", "--rounds", "1", "--max-tokens",
          "4", "--peak-rows", "8", "--peak-seconds", "0.01", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    (level,) = report["levels"]
    assert level["completed"] == level["requests"] == 2 and level["served_gflops"] > 0
    assert report["peak"]["decoder"] > 0 and set(report["peak"]["shapes"]) >= {"q", "down", "lm_head"}
    assert report["peak"]["fma"] is None or report["peak"]["fma"] > 0  # (None: no C++ compiler)
    assert "of the forward's peak | of the FMA peak" in (tmp_path / "summary.md").read_text()
