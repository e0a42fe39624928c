"""Each dense family quantized as it loads (int8 and int4 blocks, `--quantization`), on both CPU paths, against
transformers on the dequantized checkpoint: every decoder projection (a fused checkpoint module whole, as its
rows quantize alike split or not) replaced by its quantized values, the lm_head by its int8 values, and the
projections' inputs rounded as the CPU product rounds them (tests/kernels/test_quantization.py's reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.kernels import cpu_native
from motet.kernels.quant import FORMATS, INT8
from motet.models.config import ModelConfig
from tests.engine.test_engine import engine_logits
from tests.kernels.test_quantization import (
    PROJECTIONS,
    assert_close_but_for_rounding_flips,
    engine,
    quantizing_inputs,
)
from tests.models.test_model_declarations import FAMILIES
from tests.models.test_moe import randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint modules
# prompts that share no prefix, so that a rounding flip in one is not counted again in the others
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 300, (n,), generator=_g).tolist() for n in (1, 5, 17, 33, 60, 24)]
PATHS = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(cpu_native.library() is None, reason="no compiler")),
]


def dequantized(model_dir, out, name: str):
    """The reference checkpoint. Where a family's constant multiplier is folded into a projection as it loads
    (Granite's, Gemma 2's query scale: ModelConfig.weight_scales), it is the folded weight that is quantized:
    the reference holds that weight's quantized values with the factor taken out again."""
    scales = ModelConfig.from_dir(model_dir).weight_scales
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for module_name, module in hf.named_modules():
            if (short := module_name.split(".")[-1]) in (*PROJECTIONS, *FUSED):
                s = scales.get(short, 1.0)
                module.weight.copy_(FORMATS[name].quantize(module.weight * s).dequantize() / s)
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(INT8.quantize(hf.lm_head.weight).dequantize())
    hf.save_pretrained(out, safe_serialization=True)
    return hf.eval()


@pytest.mark.parametrize("compiled", PATHS, ids=["eager", "native"])
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_family_matches_hf_on_the_dequantized_checkpoint(tmp_path, family, name, compiled):
    arch, overrides, _ = FAMILIES[family]
    model_dir = build_tiny_model(tmp_path / "model", arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    hf = quantizing_inputs(
        dequantized(model_dir, tmp_path / "dequantized", name), projections=(*PROJECTIONS, *FUSED)
    )
    quantized = engine(model_dir, quantization=name, compile_step=compiled)
    assert (quantized.runner.native is not None) == compiled
    assert all(lin.quantized is not None for lin in quantized.runner.model.decoder_linears()) or compiled
    got = engine_logits(quantized, PROMPTS)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_rounding_flips(got, want)
