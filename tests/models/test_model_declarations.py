"""The model declarations (motet/models/): no architecture's name is tested outside its declaration and the
registry, each declaration is short, and the families added as a declaration alone (Qwen3, dense: Llama's
layers with per-head q/k norms; Phi-3: fused qkv_proj / gate_up_proj checkpoints and adapters, and a partial
rotary; Granite 3: four constant multipliers, folded into the weights; OLMo 2: post-norms and q/k norms across
heads; Gemma 3: sandwich norms, GeGLU, sliding-window layers with their own rope base; Gemma 2: soft-capping) run
on both CPU paths (the native step's program and the eager decoder) and over two tensor-parallel ranks (OLMo 2's
norms across heads: their sums of squares all-reduced) as Hugging Face transformers does: logits in batches and
prefill chunks, greedy generation, prefix cache hits, and LoRA adapters on every projection against PEFT."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import motet
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.kernels import cpu_native
from motet.models import DECLARATIONS, SUPPORTED_ARCHITECTURES, Architecture
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.models.test_moe import PATHS, randomize_norms
from tests.peft_adapters import peft_reference, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
PACKAGE = Path(motet.__file__).parent


def test_no_architecture_name_is_tested_outside_the_declarations():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "models" and path.parent.parent == PACKAGE:
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in SUPPORTED_ARCHITECTURES if n in text]
    assert offenders == []


def test_declarations_are_short_and_names_unique():
    """A family's module (one that holds a declaration) stays short; models/'s shared modules (the declaration's
    type, its fields' readers, ModelConfig) are not families."""
    modules = [
        importlib.import_module(f"motet.models.{p.stem}") for p in (PACKAGE / "models").glob("[!_]*.py")
    ]
    declared = {m.__name__: {id(v) for v in vars(m).values() if isinstance(v, Architecture)} for m in modules}
    families = [m for m in modules if declared[m.__name__]]
    assert set().union(*declared.values()) == {id(d) for d in DECLARATIONS}
    for module in families:
        assert len(Path(module.__file__).read_text().splitlines()) < 150, module.__name__
    names = [n for d in DECLARATIONS for n in d.names]
    assert len(names) == len(set(names))


def test_an_unknown_architecture_names_the_served_ones():
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM") as e:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(e.value)


# Families added as a declaration alone: (tiny_models arch, overrides, the LoRA adapters' targets by PEFT's names)
FAMILIES = {
    # per-head q/k norms, no q/k/v biases; head_dim set apart from hidden / heads as Qwen3's configs have it
    "qwen3": (
        "qwen3",
        {"head_dim": 32},
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    ),
    # four constant scales, each far from 1 (attention_multiplier: not 1 / sqrt(16)), tied embeddings
    "granite": (
        "granite",
        {
            "embedding_multiplier": 6.0,
            "attention_multiplier": 0.11,
            "residual_multiplier": 0.3,
            "logits_scaling": 4.0,
            "tie_word_embeddings": True,
        },
        (["q_proj", "v_proj", "o_proj"], ["up_proj", "down_proj"]),
    ),  # fmt: skip
    # post-norms (no norm before a block), q / k normed across all heads: the eager decoder only
    "olmo2": (
        "olmo2",
        {"pad_token_id": 0},
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "down_proj"]),
    ),
    # sandwich norms (1 + w), GeGLU, embeddings times sqrt(hidden), a query scale apart from head_dim, a
    # sliding-window layer with its own rope base beside a global one (transformers >= 5 nests the bases)
    "gemma3": (
        "gemma3",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        },
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    ),  # fmt: skip
    # Gemma 3's norms without q/k norms, attention scores and final logits soft-capped (caps low enough to bite),
    # the first of two layers sliding
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "pad_token_id": 0,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0,
        },
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    ),
    # q/k/v in one qkv_proj and gate/up in one gate_up_proj, in the checkpoint and in its adapters
    "phi3": ("phi3", {"pad_token_id": 0}, (["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"])),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides, targets = FAMILIES[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)  # norm weights read from the wrong place would show
    return model_dir, targets


# Families whose layer the native CPU step does not run: the eager decoder serves them (on the CPU, with or
# without --no-compile): none, every family's layer is a program of the native step's ops.
EAGER_ONLY: set[str] = set()


def native_expected(model_dir, compiled: bool) -> bool:
    return compiled and ModelConfig.from_dir(model_dir).architecture not in EAGER_ONLY


def test_configs_read_their_declarations(family):
    model_dir, _ = family
    cfg = ModelConfig.from_dir(model_dir)
    assert not cfg.is_moe and not cfg.attention_bias
    if cfg.architecture == "Qwen3ForCausalLM":
        assert cfg.qk_norm and cfg.head_dim == 32
    elif cfg.architecture == "Olmo2ForCausalLM":
        assert cfg.qk_norm and cfg.qk_norm_whole and cfg.post_norms
    elif cfg.architecture == "Gemma3ForCausalLM":
        assert (
            cfg.pre_norms
            and cfg.post_norms
            and cfg.norm_weight_offset == 1.0
            and cfg.hidden_act == "gelu_tanh"
        )
        assert cfg.sliding_layers == (0,) and (cfg.rope_local_theta, cfg.rope_theta) == (500.0, 1e6)
        assert cfg.embedding_multiplier == 8.0 and cfg.attention_multiplier == 24**-0.5
        # the Hub's configs say the bases at the top level
        raw = json.loads((model_dir / "config.json").read_text())
        raw.pop("rope_parameters")
        hub = ModelConfig.from_dict({**raw, "rope_theta": 1e6, "rope_local_base_freq": 10000.0})
        assert (hub.rope_local_theta, hub.rope_theta) == (10000.0, 1e6)
        capped = ModelConfig.from_dict({**raw, "final_logit_softcapping": 30.0})
        assert (capped.logit_softcap, capped.attn_softcap) == (30.0, None)
        with pytest.raises(ModelLoadError, match="final_logit_softcapping must be a number at least 1e-06"):
            ModelConfig.from_dict({**raw, "final_logit_softcapping": -1})
    elif cfg.architecture == "Gemma2ForCausalLM":
        assert cfg.post_norms and cfg.pre_norms and not cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
        assert (cfg.attn_softcap, cfg.logit_softcap) == (3.0, 4.0)
        assert cfg.sliding_layers == (0,) and cfg.rope_local_theta is None
        assert cfg.weight_scales["q_proj"] == 24**-0.5 * 16**0.5  # the query scale, folded into q_proj
    elif cfg.architecture == "GraniteForCausalLM":
        assert (cfg.embedding_multiplier, cfg.attention_multiplier) == (6.0, 0.11)
        assert (cfg.residual_multiplier, cfg.logits_scaling) == (0.3, 4.0)
    else:
        assert cfg.architecture == "Phi3ForCausalLM" and not cfg.qk_norm
        assert set(cfg.declaration.fused_modules) == {"qkv_proj", "gate_up_proj"}


@pytest.mark.parametrize("compiled", PATHS)
def test_partial_rotary_matches_transformers(tmp_path, compiled):
    """A rotary over part of each head (Phi-4-mini's partial_rotary_factor 0.75: the first 12 of 16 dimensions
    turn, the rest pass) on both CPU paths as transformers computes it: logits in batches and chunks, greedy
    tokens; a share that turns an odd number of dimensions is refused by name."""
    model_dir = build_tiny_model(
        tmp_path, arch="phi3", tied=False, pad_token_id=0, partial_rotary_factor=0.75
    )
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.rotary_dim, cfg.head_dim) == (12, 16)
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=8, compile_step=compiled)
    assert (llm.engine.runner.native is not None) == native_expected(model_dir, compiled)
    refs = [hf_logits(model_dir, p) for p in PROMPTS]
    for chunk in (None, 7):
        for got, ref in zip(engine_logits(llm.engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [PROMPTS[1], PROMPTS[4]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == hf_greedy_outputs(model_dir, prompts, 16)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("rope_parameters")
    assert ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.5}).rotary_dim == 8
    assert ModelConfig.from_dict({**raw, "partial_rotary_factor": 1.0, "rotary_dim": 6}).rotary_dim == 6
    with pytest.raises(ModelLoadError, match="turns 11 of each head's 16 dimensions"):
        ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.7})


@pytest.mark.parametrize("compiled", PATHS)
def test_family_matches_transformers(family, compiled):
    model_dir, _ = family
    llm = LLM(
        str(model_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=48, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == native_expected(model_dir, compiled)
    refs = [hf_logits(model_dir, p) for p in PROMPTS]
    for chunk in (None, 7):  # whole prompts in one batch, then 7-token chunks
        for got, ref in zip(engine_logits(llm.engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]
    expected = hf_greedy_outputs(model_dir, prompts, 32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # again, from the prefix cache
    assert llm.engine.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("compiled", PATHS)
def test_family_lora_matches_peft(family, tmp_path, compiled):
    model_dir, (attn, mlp) = family
    specs = [("attn", 8, attn), ("mlp", 4, mlp)]
    peft = save_peft_adapters(model_dir, tmp_path, specs, std=0.1)
    llm = LLM(
        str(model_dir), num_kv_blocks=128, block_size=8, max_lora_rank=8, max_loras=2, compile_step=compiled
    )
    for name, _, _ in specs:
        llm.add_lora(name, tmp_path / name)
    prompts, names = PROMPTS[:4], ["attn", None, "mlp", "attn"]
    got = engine_logits(llm.engine, prompts, chunk=7, adapters=names)
    for p, n, g in zip(prompts, names, got, strict=True):
        torch.testing.assert_close(g, peft_reference(peft, n, p, 0)[1], atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for p, n, out in zip(prompts, names, llm.generate(prompts, params, adapters=names), strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :]


def test_family_on_two_ranks_matches_transformers_and_peft(family, tmp_path):
    """Tensor parallelism over two gloo ranks: each rank's heads, columns and vocabulary (Phi-3's fused tensors
    split first, Granite's scales folded first, OLMo 2's norm weights across heads split with the heads), and
    adapters cut with them."""
    from tests.engine.test_tensor_parallel import tp_workers

    model_dir, (attn, mlp) = family
    specs = [("attn", 8, attn), ("mlp", 4, mlp)]
    peft = save_peft_adapters(model_dir, tmp_path, specs, std=0.1)
    prompts, names = PROMPTS[:3], ["attn", "mlp", None]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    # one rank group for the logits and the adapters' outputs (a group's start is seconds)
    with LLM(str(model_dir), num_kv_blocks=128, block_size=8, max_lora_rank=8, tensor_parallel_size=2) as llm:
        engine = llm.engine
        assert engine.runner.workers is not None
        assert (engine.runner.native is not None) == native_expected(
            model_dir, cpu_native.library() is not None
        )
        for got, p in zip(engine_logits(engine, PROMPTS, chunk=7), PROMPTS, strict=True):
            torch.testing.assert_close(got, hf_logits(model_dir, p), atol=2e-4, rtol=1e-4)
        for name, _, _ in specs:
            llm.add_lora(name, tmp_path / name)
        outs = llm.generate(prompts, params, adapters=names)
    for p, n, out in zip(prompts, names, outs, strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :]
    assert tp_workers() == []
