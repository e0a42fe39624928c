"""The model declarations (motet/models/): no architecture's name is tested outside its declaration and the
registry, each declaration is short, and a family added as a declaration alone (Qwen3, dense: Llama's layers
with per-head q/k norms) runs on both CPU paths as Hugging Face transformers does: logits in batches and
prefill chunks, greedy generation, prefix cache hits, and LoRA adapters on every projection against PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import motet
from motet.engine.config import ModelConfig, ModelLoadError
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.models import DECLARATIONS, SUPPORTED_ARCHITECTURES
from tests.test_engine import PROMPTS, engine_logits, hf_logits
from tests.test_lora_engine import peft_reference, save_peft_adapters
from tests.test_moe import PATHS, hf_greedy, randomize_norms
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
    for path in (PACKAGE / "models").glob("*.py"):
        assert len(path.read_text().splitlines()) < 150, path.name
    names = [n for d in DECLARATIONS for n in d.names]
    assert len(names) == len(set(names))


def test_an_unknown_architecture_names_the_served_ones():
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM") as e:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(e.value)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", tied=False, head_dim=32)
    randomize_norms(model_dir)  # q/k norm weights read from the wrong place would show
    return model_dir


def test_qwen3_config_reads_its_declaration(qwen3_dir):
    cfg = ModelConfig.from_dir(qwen3_dir)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.head_dim == 32 and not cfg.is_moe


@pytest.mark.parametrize("compiled", PATHS)
def test_qwen3_matches_transformers(qwen3_dir, compiled):
    llm = LLM(
        str(qwen3_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=48, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == compiled
    refs = [hf_logits(qwen3_dir, p) for p in PROMPTS]
    for chunk in (None, 7):  # whole prompts in one batch, then 7-token chunks
        for got, ref in zip(engine_logits(llm.engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]
    expected = hf_greedy(qwen3_dir, prompts, 32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # again, from the prefix cache
    assert llm.engine.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("compiled", PATHS)
def test_qwen3_lora_matches_peft(qwen3_dir, tmp_path, compiled):
    specs = [
        ("attn", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("mlp", 4, ["gate_proj", "up_proj", "down_proj"]),
    ]
    peft = save_peft_adapters(qwen3_dir, tmp_path, specs, std=0.1)
    llm = LLM(
        str(qwen3_dir), num_kv_blocks=128, block_size=8, max_lora_rank=8, max_loras=2, compile_step=compiled
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
