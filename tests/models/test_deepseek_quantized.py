"""DeepSeek-V2 and V3 quantized as they load (`--quantization int8 / int4`): the latent attention's projections
(q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, o_proj), the dense and shared MLPs and the routed experts in
blocks, kv_b_proj in the checkpoint's precision (the absorbed form reads it as each head's W_UK / W_UV), against
transformers on the dequantized checkpoint with every quantized product's input rounded alike
(tests/models/test_moe_quantized.py), in both forms (whole prompts expanded, one token a step absorbed), and
greedy tokens equal to its `generate`."""

from __future__ import annotations

import pytest
import torch

from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.latent_attention import LatentAttention
from motet.engine.worker.model import Experts
from motet.kernels.quant import FORMATS
from tests.engine.helpers import finished_tokens
from tests.engine.test_engine import engine_logits, hf_greedy
from tests.kernels.test_quantization import assert_close_but_for_rounding_flips
from tests.models.test_deepseek import MODELS, PATHS, deepseek_engine, randomize_biases
from tests.models.test_moe import randomize_norms
from tests.models.test_moe_quantized import PROMPTS, dequantized_reference
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# the latent attention's quantized projections and the MLPs', by transformers' names (kv_b_proj: not quantized)
PROJECTIONS = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def build_quantizable(path, name: str):
    """test_deepseek's checkpoint `name` with every quantized projection's inputs in whole blocks of 32: q_lora_rank
    32 (q_b_proj's), v_head_dim 16 (o_proj's 4 heads x 16); kv_b_proj's 16 stay as they are (not quantized)."""
    arch, overrides = MODELS[name]
    overrides = dict(overrides, v_head_dim=16)
    if overrides["q_lora_rank"] is not None:
        overrides["q_lora_rank"] = 32
    model_dir = build_tiny_model(path, arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    randomize_biases(model_dir)
    return model_dir


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", ["v2_lite", "v2", "v3"])
def test_quantized_latent_model_matches_hf_on_the_dequantized_checkpoint(tmp_path, name, fmt, compiled):
    model_dir = build_quantizable(tmp_path / "model", name)
    hf = dequantized_reference(model_dir, tmp_path / "dequantized", fmt, PROJECTIONS)
    engine = deepseek_engine(model_dir, compiled, quantization=fmt)
    model = engine.runner.model
    if not compiled:  # (the native step packs the blocks into its arena and releases the module's copies)
        for layer in model.layers:
            attn: LatentAttention = layer.self_attn
            assert all(lin.quantized is not None for lin in attn.projections() if lin is not attn.kv_b_proj)
            assert attn.kv_b_proj.quantized is None and attn.kv_b_proj.weight.dtype == torch.float32
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        assert experts and all(sorted(e.quantized) == ["down_proj", "gate_up_proj"] for e in experts)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    for chunk in (None, 1):  # whole prompts (expanded), then one token a step (absorbed)
        assert_close_but_for_rounding_flips(engine_logits(engine, PROMPTS, chunk=chunk), want)
    if name == "v3":  # greedy continuations, in one batch
        prompts = PROMPTS[1:]
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
        got = finished_tokens(engine)
        assert [got[tuple(p)] for p in prompts] == [hf_greedy(hf, p, 8) for p in prompts]
