"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) on tiny random checkpoints, against Hugging Face transformers
(and PEFT for attention adapters), on both CPU paths: the eager model and the compiled step (the native
forward's MoE op: motet/kernels/csrc/moe.h)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker import cpu_forward
from motet.engine.worker.model import SparseMoE
from motet.kernels import cpu_native
from motet.lora.adapter import AdapterError
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.peft_adapters import peft_reference, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# Qwen-MoE layers of the tiny models: three, with top-2 of 4 experts 48 wide
TOP2_OF_4 = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
MOE_MODELS = {
    # every layer sparse, top-2 of 4 experts renormalized (Mixtral always renormalizes)
    "mixtral": ("mixtral", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert with its sigmoid gate, layer 1 dense (mlp_only_layers), top-2 of 4 not renormalized
    "qwen2_moe": (
        "qwen2_moe",
        dict(**TOP2_OF_4, shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False),
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
    # Qwen3-MoE: per-head q/k RMSNorm in the attention, no shared expert, renormalized top-2 of 4, layer 1
    # dense (mlp_only_layers), head_dim 32 set apart from hidden / heads
    "qwen3_moe": ("qwen3_moe", dict(**TOP2_OF_4, mlp_only_layers=[1], norm_topk_prob=True, head_dim=32)),
}


def randomize_norms(model_dir):
    """Every RMSNorm weight of a checkpoint drawn around 1 (tiny_models leaves them at 1: a norm weight read
    from the wrong place would go unseen)."""
    g = torch.Generator().manual_seed(1)
    weights = load_file(model_dir / "model.safetensors")
    for name, t in weights.items():
        if name.endswith("norm.weight"):
            t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_model(request, tmp_path_factory):
    arch, overrides = MOE_MODELS[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)
    if arch == "qwen3_moe":
        randomize_norms(model_dir)
    return model_dir


# both CPU paths: the eager model, and the compiled step where the native kernels build
PATHS = [
    pytest.param(False, id="eager"),
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels"),
    ),
]


def moe_engine(model_dir, compiled: bool, **options) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir), block_size=8, num_kv_blocks=128, compile_step=compiled, **options
    )
    engine = LLMEngine(cfg, model_dir=model_dir)
    model = engine.runner.model
    assert (engine.runner.native is not None) == compiled
    assert (cpu_forward.unsupported(model, engine.runner.dtype) is None) == (cpu_native.library() is not None)
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    return engine


@pytest.mark.parametrize("compiled", PATHS)
def test_moe_logits_match_hf_in_batches_and_chunks(moe_model, compiled):
    engine = moe_engine(moe_model, compiled)
    refs = [hf_logits(moe_model, p) for p in PROMPTS]
    # whole prompts in one flattened batch, then 7-token chunks (prefill chunks beside short tails)
    for chunk in (None, 7):
        for got, ref in zip(engine_logits(engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", PATHS)
def test_moe_long_prefill_matches_hf(moe_model, compiled):
    """A 400-token prompt in one step beside a short one: each expert gets more rows than the native grouped
    GEMM takes in one pass (96), so its segments run in several row chunks split over the threads."""
    engine = moe_engine(moe_model, compiled)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (400,), generator=g).tolist(), PROMPTS[1]]
    for got, prompt in zip(engine_logits(engine, prompts), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(moe_model, prompt), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", PATHS)
def test_moe_greedy_matches_hf_generate(moe_model, compiled):
    # a 48-token step budget: prompts are chunked and share steps with other requests' decodes
    llm = LLM(
        str(moe_model), num_kv_blocks=128, block_size=8, max_num_batched_tokens=48, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == compiled
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)  # HF: min_new_tokens
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]  # 5, 60, 33 and 17 tokens
    outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == hf_greedy_outputs(moe_model, prompts, 16)


def test_moe_compiled_bf16_close_to_eager_bf16_and_fp32(moe_model):
    """bf16 weights and KV: the compiled step keeps activations (and the router's softmax) in fp32 between its
    ops (where the CPU has bf16 dot products, a linear's input is rounded to bf16 for its product only), so it
    is at least as close to the fp32 model as the eager bf16 model (which rounds after every op) is."""
    if cpu_native.library() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    prompts = PROMPTS[:4]
    fp32 = engine_logits(moe_engine(moe_model, False), prompts)
    eager = engine_logits(moe_engine(moe_model, False, dtype="bfloat16"), prompts)
    compiled = engine_logits(moe_engine(moe_model, True, dtype="bfloat16"), prompts, chunk=7)
    for ref, a, b in zip(fp32, eager, compiled, strict=True):
        p_ref, p_eager, p_comp = ref.softmax(-1), a.softmax(-1), b.softmax(-1)
        assert (p_comp - p_ref).abs().max() <= max(0.01, (p_eager - p_ref).abs().max())


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


def test_moe_quantization_needs_whole_blocks(tmp_path):
    """Quantized experts (tests/models/test_moe_quantized.py) need their inputs in blocks of 32: an expert 48
    wide is refused by the field's name."""
    model_dir = build_tiny_model(tmp_path, arch="qwen3_moe", **TOP2_OF_4)
    with pytest.raises(ModelLoadError, match="int8 quantization needs .* moe_intermediate_size is 48"):
        LLMEngine(
            EngineConfig(model=str(model_dir), num_kv_blocks=16, quantization="int8"), model_dir=model_dir
        )


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def lora_base(request, mixtral_dir, tmp_path_factory):
    """Mixtral, and Qwen3-MoE (whose q/k norms come after the adapters' deltas)."""
    if request.param == "mixtral":
        return mixtral_dir
    arch, overrides = MOE_MODELS[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)
    randomize_norms(model_dir)
    return model_dir


@pytest.mark.parametrize("compiled", PATHS)
def test_attention_lora_on_moe_matches_peft_and_mlp_lora_is_refused(lora_base, tmp_path, compiled):
    specs = [("qv", 8, ["q_proj", "v_proj", "o_proj"]), ("k", 4, ["k_proj", "q_proj"])]
    peft = save_peft_adapters(lora_base, tmp_path, specs, std=0.1)
    llm = LLM(
        str(lora_base), num_kv_blocks=128, block_size=8, max_lora_rank=8, max_loras=2, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == compiled
    for name, _, _ in specs:
        llm.add_lora(name, tmp_path / name)
    # two adapters and the base model in one batch, in prefill chunks
    prompts, names = PROMPTS[:5], ["qv", None, "k", "qv", "k"]
    got = engine_logits(llm.engine, prompts, chunk=7, adapters=names)
    for p, n, g in zip(prompts, names, got, strict=True):
        torch.testing.assert_close(g, peft_reference(peft, n, p, 0)[1], atol=2e-4, rtol=1e-4)
    # greedy, the requests decoding side by side
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = llm.generate(prompts[:3], params, adapters=names[:3])
    for p, n, out in zip(prompts[:3], names[:3], outs, strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :]
    # an adapter on the MLP: refused, naming the targets
    config = (tmp_path / "qv" / "adapter_config.json").read_text()
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / "adapter_config.json").write_text(config.replace('"o_proj"', '"down_proj"'))
    (tmp_path / "mlp" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "qv" / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="mixture-of-experts model's MLP"):
        llm.add_lora("mlp", tmp_path / "mlp")


@pytest.mark.parametrize("compiled", PATHS)
def test_tied_router_scores_pick_the_experts_torch_topk_picks(mixtral_dir, tmp_path, compiled):
    """Exactly tied router probabilities (duplicate router rows in layer 0: three experts tie for every
    token; an all-zero router in layer 1: all four tie): torch.topk does not simply take the lowest index,
    and both paths choose as it does, so the logits and greedy tokens still equal Hugging Face's."""
    weights = load_file(mixtral_dir / "model.safetensors")
    gate0 = weights["model.layers.0.block_sparse_moe.gate.weight"]
    gate0[2:] = gate0[1]
    weights["model.layers.1.block_sparse_moe.gate.weight"].zero_()
    copy_all_but_weights(mixtral_dir, tmp_path)
    save_file(weights, tmp_path / "model.safetensors")
    engine = moe_engine(tmp_path, compiled)
    prompts = PROMPTS[1:4]
    for got, prompt in zip(engine_logits(engine, prompts, chunk=7), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(tmp_path, prompt), atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    ids = [engine.add_request(p, params) for p in prompts]
    done, answers = {}, RequestOutputs()
    while engine.has_unfinished():
        for out in answers.step(engine):
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == hf_greedy_outputs(tmp_path, prompts, 8)


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
