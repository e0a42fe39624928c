"""Mixture-of-experts models (Mixtral, Qwen2-MoE) on tiny random checkpoints, against Hugging Face transformers
(and PEFT for an attention adapter): the eager model serves them, the compiled CPU step stands aside."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from motet.engine import cpu_forward
from motet.engine.config import EngineConfig, ModelLoadError
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.model import SparseMoE
from motet.engine.sampling_params import SamplingParams
from motet.lora.adapter import AdapterError
from tests.test_engine import PROMPTS, engine_logits, hf_logits
from tests.test_lora_engine import peft_reference, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

MOE_MODELS = {
    # every layer sparse, top-2 of 4 experts renormalized (Mixtral always renormalizes)
    "mixtral": ("mixtral", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert with its sigmoid gate, layer 1 dense (mlp_only_layers), top-2 of 4 not renormalized
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    # renormalized top-3, every second layer sparse (decoder_sparse_step), untied lm_head
    "qwen2_moe_step2": (
        "qwen2_moe",
        dict(
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_model(request, tmp_path_factory):
    arch, overrides = MOE_MODELS[request.param]
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)


def test_moe_logits_match_hf_in_batches_and_chunks(moe_model):
    engine = LLMEngine(
        EngineConfig(model=str(moe_model), block_size=8, num_kv_blocks=128), model_dir=moe_model
    )
    model = engine.runner.model
    assert engine.runner.native is None and not cpu_forward.supported(model, engine.runner.dtype)
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    refs = [hf_logits(moe_model, p) for p in PROMPTS]
    # whole prompts in one flattened batch, then 7-token chunks (prefill chunks beside short tails)
    for chunk in (None, 7):
        for got, ref in zip(engine_logits(engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_moe_greedy_matches_hf_generate(moe_model):
    # a 48-token step budget: prompts are chunked and share steps with other requests' decodes
    llm = LLM(str(moe_model), num_kv_blocks=128, block_size=8, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)  # HF: min_new_tokens
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]  # 5, 60, 33 and 17 tokens
    outs = llm.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    arch, overrides = MOE_MODELS["mixtral"]
    return build_tiny_model(tmp_path_factory.mktemp("mixtral"), arch=arch, **overrides)


def copy_all_but_weights(src, dst):
    """The model directory's config and tokenizer files into `dst` (the test writes its own weights)."""
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())


def test_a_missing_expert_tensor_is_refused_by_name(mixtral_dir, tmp_path):
    weights = load_file(mixtral_dir / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    copy_all_but_weights(mixtral_dir, tmp_path)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"layers\.1\.mlp\.experts\.gate_up_proj\[5\] \(expert 2's up_proj / w3\)"
    ):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=16), model_dir=tmp_path)
    # an expert the config does not have has no place either
    weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = torch.zeros(96, 64)
    weights["model.layers.1.block_sparse_moe.experts.4.w3.weight"] = torch.zeros(96, 64)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"experts\.4\.w3\.weight' has no place in MixtralForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=16), model_dir=tmp_path)


def test_moe_quantization_is_refused(mixtral_dir):
    with pytest.raises(ModelLoadError, match="int8 quantization of a mixture-of-experts model"):
        LLMEngine(
            EngineConfig(model=str(mixtral_dir), num_kv_blocks=16, quantization="int8"), model_dir=mixtral_dir
        )


def test_attention_lora_on_moe_matches_peft_and_mlp_lora_is_refused(mixtral_dir, tmp_path):
    peft = save_peft_adapters(mixtral_dir, tmp_path, [("qv", 8, ["q_proj", "v_proj", "o_proj"])], std=0.1)
    llm = LLM(str(mixtral_dir), num_kv_blocks=128, block_size=8, max_lora_rank=8)
    llm.add_lora("qv", tmp_path / "qv")
    prompts, names = PROMPTS[:4], ["qv", None, "qv", None]
    got = engine_logits(llm.engine, prompts, chunk=7, adapters=names)
    for p, n, g in zip(prompts, names, got, strict=True):
        torch.testing.assert_close(g, peft_reference(peft, n, p, 0)[1], atol=2e-4, rtol=1e-4)
    # an adapter on the MLP: refused, naming the targets
    config = (tmp_path / "qv" / "adapter_config.json").read_text()
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / "adapter_config.json").write_text(config.replace('"o_proj"', '"down_proj"'))
    (tmp_path / "mlp" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "qv" / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="mixture-of-experts model's MLP"):
        llm.add_lora("mlp", tmp_path / "mlp")


def test_transformers_5_stacked_expert_layout_loads(mixtral_dir, tmp_path):
    """A checkpoint holding the experts stacked as transformers >= 5 keeps them in memory
    (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I], mlp.gate) loads the same."""
    hf = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    state = {n: t.contiguous() for n, t in hf.state_dict().items() if n != "lm_head.weight"}  # tied
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    copy_all_but_weights(mixtral_dir, tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, num_kv_blocks=64), model_dir=tmp_path)
    prompts = PROMPTS[1:3]
    for got, prompt in zip(engine_logits(engine, prompts), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(mixtral_dir, prompt), atol=2e-4, rtol=1e-4)
