"""Mixture-of-experts models quantized as they load (`--quantization int8 / int4`: the experts' stacked weights in
blocks like every projection), on both CPU paths, against transformers on the dequantized checkpoint: each
expert's weights (and the shared expert's, the attention's, the lm_head's in int8) replaced by their quantized
values, and every quantized product's input rounded as the CPU product rounds it (Q8_0 blocks)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.engine.worker.model import Experts
from motet.kernels.quant import FORMATS, INT8, quantize_activations
from tests.engine.test_engine import engine_logits
from tests.kernels.test_quantization import (
    PROJECTIONS,
    assert_close_but_for_rounding_flips,
    quantizing_inputs,
)
from tests.models.test_moe import MOE_MODELS, PATHS, moe_engine, randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

_g = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(3, 300, (n,), generator=_g).tolist() for n in (1, 5, 17, 40)]
STACKED = ("gate_up_proj", "down_proj")


def dequantized_reference(
    model_dir, out, name: str, projections: tuple[str, ...] = PROJECTIONS
) -> torch.nn.Module:
    """transformers' model of `model_dir` with the quantized values of every weight motet quantizes (the
    `projections`, the experts, the lm_head; an expert's rows quantize on their own, so the stacked [E, N, K]
    weight quantizes as its E * N rows), its quantized products' inputs rounded to Q8_0 blocks (the experts call
    F.linear directly: rounded inside their forward)."""
    fmt = FORMATS[name]
    # the eager experts (a loop of F.linear per expert), not transformers' grouped-GEMM kernels
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    linear = torch.nn.functional.linear
    with torch.no_grad():
        for module_name, module in hf.named_modules():
            if module_name.split(".")[-1] in projections and isinstance(module, torch.nn.Linear):
                module.weight.copy_(fmt.quantize(module.weight).dequantize())
            if type(module).__name__.endswith("Experts"):
                for key in STACKED:
                    w = getattr(module, key)
                    w.copy_(fmt.quantize(w.reshape(-1, w.shape[-1])).dequantize().view(w.shape))
                module.forward = rounding_experts(module.forward, linear)
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(INT8.quantize(hf.lm_head.weight).dequantize())
    hf.save_pretrained(out, safe_serialization=True)
    return quantizing_inputs(hf.eval(), projections=projections)


def rounding_experts(forward, linear):
    """An experts module's forward with every F.linear's input rounded to Q8_0 blocks (the CPU's quantized product)."""

    def rounded(*args, **kwargs):
        def product(x, w, b=None):
            return linear(quantize_activations(x), w, b)

        with mock.patch.object(torch.nn.functional, "linear", product):
            return forward(*args, **kwargs)

    return rounded


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantized_experts_match_hf_on_the_dequantized_checkpoint(tmp_path, family, name, compiled):
    arch, overrides = MOE_MODELS[family]
    if arch != "mixtral":  # every projection's inputs in whole blocks of 32
        overrides = {**overrides, "moe_intermediate_size": 64}
        if "shared_expert_intermediate_size" in overrides:
            overrides["shared_expert_intermediate_size"] = 96
    model_dir = build_tiny_model(tmp_path / "model", arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    hf = dequantized_reference(model_dir, tmp_path / "dequantized", name)
    engine = moe_engine(model_dir, compiled, quantization=name)
    if not compiled:  # (the native step packs them into its arena and releases the module's copies)
        experts = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(sorted(e.quantized) == sorted(STACKED) for e in experts)
        assert all(e.gate_up_proj.numel() == 0 and e.down_proj.numel() == 0 for e in experts)
    got = engine_logits(engine, PROMPTS)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_rounding_flips(got, want)
