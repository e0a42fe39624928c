"""GGUF files of the families declared beside Llama and Qwen (Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite), written
with gguf-py the way llama.cpp's convert_hf_to_gguf.py writes each (its model classes' hyperparameter keys, its
tensor name map, Gemma's norm weights as 1 + w, Granite's q/k rows permuted and multipliers as scales, Phi-3's
fused attn_qkv / ffn_up, Gemma 3's embedding rows cut to the vocabulary): served bare (`LLM(file.gguf)`) with
logits as transformers computes them on the source checkpoint (on gguf-py's dequantization of the blocks for a
quantized file), and converted back (`convert_gguf`, what `motet pull` runs) to the source's own tensors.

The tiny checkpoints carry tests/tiny_models.py's byte-level BPE tokenizer, written as the converter's gpt2
vocabulary (`write_gguf_file`'s): llama.cpp's converter writes Gemma's (always) and Phi-3's (but Phi-4's)
vocabularies from a SentencePiece tokenizer.model instead, tested in tests/models/test_gguf_sentencepiece.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from motet.engine.llm import LLM
from motet.engine.weights.gguf_config import hf_config, metadata_of
from motet.engine.weights.gguf_convert import convert_gguf, write_hf_metadata
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.engine.test_gguf_model_file import OPTIONS, add_base_keys, add_gpt2_vocab
from tests.kernels.test_quantization import (
    assert_close_but_for_rounding_flips,
    needs_native,
    quantizing_inputs,
)
from tests.models.test_moe import randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# tiny_models arch (= its GGUF architecture) -> the overrides of its checkpoint: each family's options where the
# GGUF carries them (Gemma's query scale: 1/sqrt(head_dim), as llama.cpp assumes but for the 27B models)
FAMILIES = {
    # sandwich norms (1 + w), q/k norms, the first five of six layers sliding (llama.cpp's pattern where the
    # file says none) with their own rope base, a window the longer prompts pass, final logits soft-capped
    "gemma3": dict(
        num_hidden_layers=6,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=300,  # the tokenizer's: the converter cuts the embedding rows to it
        pad_token_id=0,
        sliding_window=12,
        final_logit_softcapping=5.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
    # every other layer sliding, attention scores and logits soft-capped (caps low enough to bite)
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=300,
        pad_token_id=0,
        sliding_window=12,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    ),
    "phi3": dict(pad_token_id=0, tied=False),  # fused qkv_proj / gate_up_proj
    "olmo2": dict(pad_token_id=0, tied=False),  # post-norms, q/k norms across heads
    "granite": dict(  # four multipliers far from 1, tied embeddings
        embedding_multiplier=6.0,
        attention_multiplier=0.11,
        residual_multiplier=0.3,
        logits_scaling=4.0,
    ),
}
PROJECTIONS = {  # the Hugging Face modules a quantized GGUF's blocks serve (Granite's q/o/down: folded, floats)
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "granite": ("gate_proj", "up_proj"),
}
Q8_0_TYPES = {  # a llama.cpp-style mix: projections in Q8_0, the table in F16, norms F32
    "token_embd": "F16", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0",
    "attn_qkv": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q8_0",
}  # fmt: skip


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute (Granite's converter is Llama's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_hyperparameters(writer, arch: str, cfg, raw: dict) -> None:
    """The keys each family's converter class writes (Gemma2Model, Gemma3Model, Phi3MiniModel, Olmo2Model,
    GraniteModel), from its config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_base_keys(writer, cfg)
    rope = cfg.rope_parameters
    if arch == "gemma2":  # no rope keys at all
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif arch == "gemma3":  # no sliding window pattern: llama.cpp takes every sixth layer global
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif (
        arch == "phi3"
    ):  # Phi3MiniModel: its rotary's dimensions; LongRoPE's attention factor from the contexts
        original = raw.get("original_max_position_embeddings") or 4096
        writer.add_rope_scaling_orig_ctx_len(original)
        partial = rope.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            )
    elif arch == "olmo2":
        writer.add_rope_freq_base(rope["rope_theta"])
        if "head_dim" in raw:
            writer.add_key_length(raw["head_dim"])
            writer.add_value_length(raw["head_dim"])
    elif arch == "granite":  # head_dim dropped; the multipliers as scales
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def gguf_tensors(arch: str, hf) -> dict[str, torch.Tensor]:
    """The source's tensors as the converter writes them, under gguf-py's tensor name map of the architecture."""
    cfg, state = hf.config, hf.state_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out = {}
    for name, w in state.items():
        if arch == "gemma2" and name == "lm_head.weight":  # skipped: Gemma 2's head is the table
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = w.clone()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w += 1  # Gemma's RMSNorm multiplies by 1 + w
        if arch == "gemma3" and name == "model.embed_tokens.weight":
            w = w[: cfg.vocab_size + 3]  # the tokenizer's vocabulary and its added tokens (here: all rows)
        if arch == "granite" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = w
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "phi3" and rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors: LongRoPE's factors
        out["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
        out["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)
    return out


def write_family_gguf(
    model_dir: Path, out: Path, arch: str, types: dict[str, str] | None = None, vocab=None
) -> Path:
    """`model_dir` as one GGUF file as llama.cpp's converter writes its family; 2-D tensors in `types`' GGML
    types by their GGUF names (F32 where not named), 1-D ones (norms) F32, as the converter keeps them.
    `vocab(writer, model_dir, vocab_size)`: another vocabulary's writer than the gpt2 one."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    raw = json.loads((model_dir / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch=arch)
    add_hyperparameters(writer, arch, hf.config, raw)
    if vocab is None:
        add_gpt2_vocab(writer, model_dir, hf.config.vocab_size, "gpt-2")
    else:
        vocab(writer, model_dir, hf.config.vocab_size)
    for name, w in gguf_tensors(arch, hf).items():
        qtype = gguf.GGMLQuantizationType[
            (types or {}).get(name.split(".")[-2], "F32") if w.dim() == 2 else "F32"
        ]
        data = w.numpy() if qtype.name == "F32" else gguf.quants.quantize(w.numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype.name == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized_reference(model_dir: Path, out: Path, arch: str, types: dict[str, str]) -> Path:
    """The source checkpoint with each weight a quantized GGUF tensor holds replaced by gguf-py's dequantization
    of its blocks (row-wise formats: the same whether Granite's rows were permuted first or not)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            qtype = types.get(gguf_name.split(".")[-2], "F32") if p.dim() == 2 else "F32"
            if qtype != "F32":
                t = gguf.GGMLQuantizationType[qtype]
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), t), t)))
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    arch, overrides = request.param, dict(FAMILIES[request.param])
    tied = overrides.pop("tied", True)
    source = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, tied=tied, **overrides)
    randomize_norms(source)  # norm weights read from the wrong place (or offset twice) would show
    return arch, source


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MOTET_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_f32_file_served_bare_matches_hf(family, tmp_path, compiled):
    arch, source = family
    path = write_family_gguf(source, tmp_path / "bare" / f"{arch}.gguf", arch)
    llm = LLM(str(path), compile_step=compiled, **OPTIONS)
    served = llm.engine.runner.model.config
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert served.architecture == hf.config.architectures[0]
    assert (llm.engine.runner.native is not None) == compiled
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    # prefill in chunks of 7: within the sliding windows of 12, as the scheduler cuts them
    for got, ref in zip(engine_logits(llm.engine, PROMPTS, chunk=7), want, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_quantized_file_served_bare_matches_hf_on_gguf_py_dequantized(family, tmp_path, compiled):
    arch, source = family
    path = write_family_gguf(source, tmp_path / "bare" / f"{arch}-q8_0.gguf", arch, Q8_0_TYPES)
    eng = LLM(str(path), compile_step=compiled, **OPTIONS).engine
    assert (eng.runner.native is not None) == compiled
    if not compiled:  # (the native step packs the layers its own way)
        linears = eng.runner.model.decoder_linears()
        formats = {lin.quantized.format.name if lin.quantized else None for lin in linears}
        assert formats == ({"int8", None} if arch == "granite" else {"int8"})  # Granite's folded ones: floats
    ref = dequantized_reference(source, tmp_path / "ref", arch, Q8_0_TYPES)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    projections = PROJECTIONS.get(
        arch, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    hf = quantizing_inputs(hf, lm_head=not hf.config.tie_word_embeddings, projections=projections)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    got = engine_logits(eng, PROMPTS, chunk=7)
    if hf.config.num_hidden_layers <= 2:
        assert_close_but_for_rounding_flips(got, want)
    else:  # six layers of sandwich norms carry an int8 rounding flip further: up to ~0.6 here, rare and local
        flipped = [(g - w).abs() for g, w in zip(got, want, strict=True) if (g - w).abs().max() > 1e-4]
        assert len(flipped) <= len(got) // 2 and all(d.max() < 1.0 and d.mean() < 0.01 for d in flipped)


def test_converts_back_to_the_source_checkpoint(family, tmp_path):
    """`convert_gguf` writes the family's own checkpoint: its tensors (fused ones fused, Granite's q/k rows in
    Hugging Face's order) equal the source's, Gemma's norms to the rounding of 1 + w, and transformers loads it
    as the family computing the source's logits."""
    arch, source = family
    path = write_family_gguf(source, tmp_path / "g" / f"{arch}.gguf", arch)
    out = convert_gguf(path, tmp_path / "out")
    got, want = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    if "lm_head.weight" in want and json.loads((source / "config.json").read_text())["tie_word_embeddings"]:
        del want["lm_head.weight"]
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # (w + 1) - 1 in float32
            torch.testing.assert_close(got[name], w, atol=2**-22, rtol=0)
        else:
            assert torch.equal(got[name], w), name
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert type(converted) is type(hf)
    with torch.no_grad():
        for prompt in PROMPTS[:4]:
            ids = torch.tensor([prompt])
            torch.testing.assert_close(converted(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_what_a_family_file_cannot_say_is_refused(tmp_path):
    """A vocabulary of another kind than gpt2 BPE or SentencePiece's (T5's Unigram), a SentencePiece one without its
    scores, half of LongRoPE's factors and an OLMo 3 file's sliding windows each name what motet does not read."""
    source = build_tiny_model(tmp_path / "src", arch="olmo2", pad_token_id=0)
    path = write_family_gguf(source, tmp_path / "a" / "olmo.gguf", "olmo2")
    reader = gguf.GGUFReader(str(path))
    meta, names = metadata_of(reader), {t.name for t in reader.tensors}
    with pytest.raises(
        ModelLoadError, match=r"tokenizer 't5' \(tokenizer\.ggml\.model\); motet builds .*'llama'"
    ):
        hf_config({**meta, "tokenizer.ggml.model": "t5"}, names, "ugm.gguf")
    with pytest.raises(ModelLoadError, match=r"SentencePiece vocabulary without its scores"):
        hf_config({**meta, "tokenizer.ggml.model": "llama"}, names, "spm.gguf")
    with pytest.raises(ModelLoadError, match=r"sliding-window layers .*OLMo 3"):
        hf_config({**meta, "olmo2.attention.sliding_window": 4096}, names, "olmo3.gguf")
    with pytest.raises(ModelLoadError, match=r"LongRoPE's factors come as both"):
        hf_config(meta, {*names, "rope_factors_long.weight"}, "phi.gguf", {"rope_factors_long.weight": [1.0]})


@pytest.mark.parametrize(
    "pre,pieces",
    [
        ("dbrx", ["ab", "Ġ", "123", "45", "Ġc", "!!"]),  # Llama 3's split (cl100k's: Phi-4's, OLMo 2's files)
        ("llama-bpe", ["ab", "Ġ", "123", "45", "Ġc", "!!"]),
        ("refact", ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġc", "!!"]),  # digits one by one (Granite 3's files)
        ("olmo", ["ab", "Ġ12345", "Ġc", "!!"]),  # GPT-2's
    ],
)
def test_the_pre_tokenizers_these_families_files_name(tmp_path, pre, pieces):
    """The split llama.cpp's llama-vocab.cpp makes for each pre-tokenizer name these families' files carry."""
    source = build_tiny_model(tmp_path / "src", arch="olmo2", pad_token_id=0)
    reader = gguf.GGUFReader(str(write_family_gguf(source, tmp_path / "a" / "olmo.gguf", "olmo2")))
    meta = {**metadata_of(reader), "tokenizer.ggml.pre": pre}
    write_hf_metadata(tmp_path, meta, hf_config(meta, {t.name for t in reader.tensors}, "olmo.gguf"))
    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).pre_tokenizer.pre_tokenize_str("ab 12345 c!!")
    assert [p for p, _ in got] == pieces
