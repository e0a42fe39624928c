"""LongRoPE (Phi-3.5's and Phi-4-mini's `rope_scaling` of type longrope: short factors within the original context,
long ones past it) on a tiny random Phi3ForCausalLM with an original context of 32 and 128 positions, against
transformers: logits of prompts within the original context and past it, and greedy continuations that cross it
as they generate (transformers' Phi-3 drops its cache as a sequence grows past the original context and computes it
again with the long factors: motet recomputes such a sequence there too), on both CPU paths, in chunks, in batches
and from the prefix cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import engine_logits, hf_greedy_outputs
from tests.kernels.test_quantization import needs_native
from tests.models.test_gguf_families import write_family_gguf
from tests.models.test_moe import randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ORIGINAL = 32


def longrope(pairs: int, **extra) -> dict:
    """A longrope rope_scaling over `pairs` rotated pairs: factors far from 1 and from each other."""
    return dict(
        type="longrope",
        short_factor=[1.0 + 0.35 * i for i in range(pairs)],
        long_factor=[1.5 + 1.7 * i for i in range(pairs)],
        **extra,
    )


# head_dim 16: 8 rotated pairs; Phi-4-mini's partial rotary (here a half: 4 pairs) with an explicit attention
# factor
CONFIGS = {
    "phi3.5": dict(rope_scaling=longrope(8)),
    "partial": dict(partial_rotary_factor=0.5, rope_scaling=longrope(4, attention_factor=1.25)),
}
SHORT = [list(range(3, 3 + n)) for n in (1, 9, 32)]  # within the original context (32: its last position)
LONG = [list(range(5, 5 + n)) for n in (33, 70)] + [[7, 8, 9, 10] * 20]  # past it


@pytest.fixture(scope="module", params=list(CONFIGS))
def phi3_longrope(request, tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp(request.param),
        arch="phi3",
        pad_token_id=0,
        tied=False,
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL,
        **CONFIGS[request.param],
    )
    randomize_norms(path)
    return path


PATHS = [pytest.param(False, id="eager"), pytest.param(True, id="native", marks=needs_native)]


@pytest.mark.parametrize("compiled", PATHS)
def test_logits_match_hf_within_and_past_the_original_context(phi3_longrope, compiled):
    hf = AutoModelForCausalLM.from_pretrained(phi3_longrope, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "longrope"
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0] for p in SHORT + LONG]
    llm = LLM(str(phi3_longrope), device="cpu", block_size=8, compile_step=compiled)
    assert (llm.engine.runner.native is not None) == compiled
    for chunk in (None, 11):  # whole, and in chunks that cross the original context (batched, all prompts)
        got = engine_logits(llm.engine, SHORT + LONG, chunk=chunk)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", PATHS)
def test_greedy_tokens_equal_generate_across_the_original_context(phi3_longrope, compiled):
    """Prompts of 20 and 31 tokens generate past position 32 (where transformers' Phi-3 recomputes its cache with
    the long factors); those of 40 and 70 start past it. In one batch, then again: the second time the prompts
    come from the prefix cache (a short-factor block is never a long-factor one's: their tokens turn differently),
    and the engine's drafts from its earlier outputs stop at the original context."""
    prompts = [list(range(3, 23)), list(range(40, 71)), list(range(4, 44)), [11, 12, 13, 14, 15] * 14]
    want = hf_greedy_outputs(phi3_longrope, prompts, 24)
    llm = LLM(str(phi3_longrope), device="cpu", block_size=8, compile_step=compiled)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
    # the long prompt whose first 32 tokens are the short prompt's: its own rotation, not the cached blocks'
    shared = prompts[2][:32]
    llm.generate([shared], params)
    longer = shared + list(range(100, 110))
    want = hf_greedy_outputs(phi3_longrope, [longer], 8)
    out = llm.generate([longer], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert out[0].token_ids == want[0]


def test_longrope_config_checked(tmp_path):
    """Factors of the wrong count or sign name the field; the top-level original context wins over the nested
    one (as transformers' Phi-3 takes it); Phi-3's first spelling of the type ("su") is LongRoPE."""
    path = build_tiny_model(
        tmp_path / "m",
        arch="phi3",
        pad_token_id=0,
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=longrope(8),
    )
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    key = "rope_parameters" if raw.get("rope_scaling") is None else "rope_scaling"
    nested = json.loads(json.dumps(raw))
    nested[key].update(type="su", rope_type="su", original_max_position_embeddings=64)
    cfg = ModelConfig.from_dict(nested)
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    for field, bad in (("short_factor", [1.0] * 7), ("long_factor", [1.0] * 7 + [-2.0])):
        broken = json.loads(json.dumps(raw))
        broken[key][field] = bad
        with pytest.raises(ModelLoadError, match=field):
            ModelConfig.from_dict(broken)


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["whole", "partial"])
def test_gguf_file_with_rope_factors_served_bare_matches_hf(tmp_path, monkeypatch, partial):
    """Phi-3's GGUF file as llama.cpp's converter writes LongRoPE (rope_factors_long / rope_factors_short tensors,
    the original context and the attention factor as keys, the rotary's dimensions: a partial one too): the
    config reads them back, and the file served bare gives transformers' logits within and past the original
    context."""
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    source = build_tiny_model(
        tmp_path / "src",
        arch="phi3",
        pad_token_id=0,
        tied=False,
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        rope_scaling=longrope(int(8 * partial)),
    )
    randomize_norms(source)
    path = write_family_gguf(source, tmp_path / "bare" / "phi3-longrope.gguf", "phi3")
    llm = LLM(str(path), device="cpu", block_size=8)
    served = llm.engine.runner.model.config
    assert served.rope_scaling["rope_type"] == "longrope" and served.rotary_dim == int(16 * partial)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0] for p in SHORT + LONG]
    for g, w in zip(engine_logits(llm.engine, SHORT + LONG, chunk=11), want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


def test_cached_tokens_count_the_prompt_served_from_the_cache(phi3_longrope):
    """A 20-token prompt generating past the original context, twice. The second time its first admission finds
    its prompt's two full blocks in the prefix cache (16 tokens: the last prompt token is always computed); its
    recompute past the original context then finds the first request's long-factor blocks, outputs and all (32
    tokens), which are no prompt tokens served from the cache: usage's cached_tokens counts the 16 (it said 32,
    more than the prompt)."""
    prompt = list(range(3, 23))
    llm = LLM(str(phi3_longrope), device="cpu", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    first = llm.generate([prompt], params)[0]
    preemptions = llm.engine.stats().preemptions
    again = llm.generate([prompt], params)[0]
    assert llm.engine.stats().preemptions == preemptions + 1  # (recomputed past the original context)
    assert again.token_ids == first.token_ids
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, (len(prompt) - 1) // 8 * 8)
