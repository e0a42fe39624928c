"""GPT-OSS (motet/models/gpt_oss.py) against transformers on a tiny random checkpoint: attention sinks, o_proj
biases, YaRN, sliding-window layers (served past their window), a router with a bias and experts with biases,
a clamped SwiGLU and gate/up columns interleaved in the checkpoint; the experts in MXFP4 as OpenAI's checkpoints
hold them (quantized here by the OCP microscaling spec, against transformers' own dequantization)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.memory import quantized_weights
from motet.kernels import cpu_native
from motet.kernels.quant import MXFP4, quantize_activations
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.mxfp4_checkpoint import dequantize_mxfp4, quantize_mxfp4, save_mxfp4
from tests.tiny_models import build_tiny_model

WINDOW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def build_gpt_oss(path, intermediate_size: int = 48):
    path = build_tiny_model(
        path,
        arch="gpt_oss",
        tied=False,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=intermediate_size,
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
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == hf_greedy_outputs(model_dir, prompts, 24)


def test_a_quantization_other_than_mxfp4_is_refused_by_name(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(
        ModelLoadError, match="quantization_config 'gptq': GPT-OSS checkpoints are read in floats"
    ):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "gptq"}})


# -- MXFP4 experts -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss_float"), intermediate_size=64)  # 2 blocks a row


@pytest.fixture(scope="module")
def mxfp4_dir(float_dir, tmp_path_factory):
    return save_mxfp4(float_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m")


def test_transformers_reads_the_mxfp4_layout_as_written(float_dir, mxfp4_dir):
    """The reference the engine is held to: transformers' CPU load of the MXFP4 checkpoint dequantizes each
    expert to this test's reading of the blocks (and near the float weights they were quantized from)."""
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32).state_dict()
    stored = load_file(mxfp4_dir / "model.safetensors")
    floats = load_file(float_dir / "model.safetensors")
    for i in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            ours = dequantize_mxfp4(stored[f"{name}_blocks"], stored[f"{name}_scales"]).transpose(1, 2)
            assert torch.equal(hf[name], ours)
            assert (ours - floats[name]).abs().max() <= floats[name].abs().max() / 4


def mxfp4_reference(model_dir) -> torch.nn.Module:
    """transformers on the MXFP4 checkpoint (its experts dequantized as it loads them) with each expert
    product's input rounded as the CPU's quantized product rounds it (Q8_0 blocks, as llama.cpp multiplies MXFP4
    too): the experts' input rows, and the gated activation before the down projection."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    for module in hf.modules():
        if type(module).__name__ == "GptOssExperts":
            module.register_forward_pre_hook(
                lambda _, args, kwargs: ((quantize_activations(args[0]), *args[1:]), kwargs), with_kwargs=True
            )
            gate = module._apply_gate
            module._apply_gate = lambda x, gate=gate: quantize_activations(gate(x))
    return hf.eval()


@pytest.mark.parametrize("compiled", [True, False], ids=["default", "eager"])
def test_mxfp4_experts_served_in_their_blocks_match_transformers(mxfp4_dir, compiled):
    """The experts stay in their MXFP4 blocks (a quarter of bf16's bytes, about), multiplied by the quantized
    product (the native step's MXFP4 GEMM, or its torch reference)."""
    from tests.kernels.test_quantization import assert_close_but_for_rounding_flips

    llm = LLM(str(mxfp4_dir), num_kv_blocks=128, block_size=4, max_model_len=256, compile_step=compiled)
    if not compiled:  # (the native step packs them into its arena)
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert {k: q.weight.format for k, q in experts.quantized.items()} == {
            "gate_up_proj": MXFP4,
            "down_proj": MXFP4,
        }
        assert experts.gate_up_proj.numel() == 0
        # resident: 4.25 bits a weight (4-bit codes, a scale byte per 32), every expert's gate/up and down
        blocks = quantized_weights(llm.engine.runner.model)
        weights = sum(q.shape[0] * q.shape[1] for q in blocks)
        assert weights == 2 * 4 * (
            2 * 64 * 64 + 64 * 64
        )  # layers x experts x (gate/up [2I, H] + down [H, I])
        assert sum(q.nbytes for q in blocks) == weights * 17 // 32
    hf = mxfp4_reference(mxfp4_dir)
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
    assert_close_but_for_rounding_flips(engine_logits(llm.engine, PROMPTS, chunk=7), want)


def test_mxfp4_experts_are_read_one_at_a_time_into_blocks(mxfp4_dir, monkeypatch):
    """Loading never dequantizes an expert: each is read as blocks, one at a time, into its layer's format."""
    from motet.engine.weights import mxfp4

    monkeypatch.setattr(mxfp4, "dequantize", None)  # (calling it fails the load)
    read = []
    expert = mxfp4.Mxfp4Tensor.expert

    def recording(self, e):
        q = expert(self, e)
        read.append(q.shape)
        return q

    monkeypatch.setattr(mxfp4.Mxfp4Tensor, "expert", recording)
    LLMEngine(EngineConfig(model=str(mxfp4_dir), num_kv_blocks=64, compile_step=False), model_dir=mxfp4_dir)
    # 2 layers x 4 experts x (gate_up [2I, H], down [H, I])
    assert sorted(read) == sorted([(128, 64)] * 8 + [(64, 64)] * 8)


def test_malformed_mxfp4_is_refused_naming_the_tensor(float_dir, mxfp4_dir, tmp_path):
    floats = float_dir
    name = "model.layers.1.mlp.experts.down_proj"
    blocks, scales = quantize_mxfp4(
        load_file(floats / "model.safetensors")[name].transpose(1, 2).contiguous()
    )
    cases = {
        "missing": ({"drop": f"{name}_scales"}, f"{name}_blocks has no {name}_scales tensor"),
        "nibbles": (
            {"change": {f"{name}_blocks": blocks.view(4, 64, 4, 8)}},
            rf"{name}_blocks has shape \(4, 64, 4, 8\)",
        ),
        "scales": (
            {"change": {f"{name}_scales": scales[:, :32]}},
            rf"{name}_scales \(4, 32, 2\): one scale a block",
        ),
        "dtype": ({"change": {f"{name}_scales": scales.float()}}, f"{name}_blocks and _scales must be uint8"),
        "experts": (
            {"change": {f"{name}_blocks": blocks[:3], f"{name}_scales": scales[:3]}},
            rf"'{name}_blocks' \(MXFP4\) has shape \(3, 64, 64\), the model expects \(4, 64, 64\)",
        ),
    }
    for case, (edit, message) in cases.items():
        bad = save_mxfp4(floats, tmp_path / case, **edit)
        with pytest.raises(ModelLoadError, match=message):
            LLMEngine(EngineConfig(model=str(bad), num_kv_blocks=64), model_dir=bad)
    with pytest.raises(ModelLoadError, match="is an MXFP4 checkpoint.*drop --quantization"):
        LLMEngine(
            EngineConfig(model=str(mxfp4_dir), num_kv_blocks=64, quantization="int8"), model_dir=mxfp4_dir
        )


# -- two ranks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "checkpoint, expert_parallel",
    [("float", False), ("mxfp4", True)],
    ids=["tensor-parallel", "mxfp4-expert-parallel"],
)
def test_two_ranks_match_transformers(model_dir, mxfp4_dir, checkpoint, expert_parallel):
    """Over two gloo ranks: each rank's heads with their sinks, o_proj's bias and the experts' down bias added
    once (rank 0's), the experts' gate/up biases split with their columns (or with expert parallelism whole
    experts, an MXFP4 checkpoint's read only where they are held), the router whole; logits in chunks of the
    window and of 7 tokens, then greedy tokens, against transformers."""
    from tests.engine.test_tensor_parallel import tp_workers

    path = {"float": model_dir, "mxfp4": mxfp4_dir}[checkpoint]
    config = EngineConfig(
        model=str(path),
        block_size=4,
        num_kv_blocks=128,
        max_model_len=256,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )
    engine = LLMEngine(config, model_dir=path)
    try:
        assert engine.runner.workers is not None and len(tp_workers()) == 1
        layer = engine.runner.model.layers[0]
        assert layer.self_attn.num_heads == 2 and layer.self_attn.sinks.shape == (2,)
        experts = layer.mlp.experts
        assert (experts.num_local, experts.intermediate) == ((2, 64) if expert_parallel else (4, 24))
        if checkpoint == "mxfp4":  # its experts in their blocks: the reference rounds their inputs alike
            from tests.kernels.test_quantization import assert_close_but_for_rounding_flips

            hf = mxfp4_reference(path)
            with torch.no_grad():
                refs = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
            for chunk in (WINDOW, 7):
                assert_close_but_for_rounding_flips(engine_logits(engine, PROMPTS, chunk=chunk), refs)
        else:
            refs = [hf_logits(path, p) for p in PROMPTS]
            for chunk in (WINDOW, 7):
                for got, ref in zip(engine_logits(engine, PROMPTS, chunk=chunk), refs, strict=True):
                    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    finally:
        engine.close()
    assert tp_workers() == []
    if checkpoint == "mxfp4":  # (greedy tokens against the float reference: the float checkpoint's case)
        return
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[2]]
    with LLM(
        str(path),
        num_kv_blocks=128,
        block_size=4,
        max_model_len=256,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    ) as llm:
        outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == hf_greedy_outputs(path, prompts, 16)
