"""A bare GGUF file served as the model (`--model path/to/file.gguf`, nothing beside it: motet/engine/weights/gguf_model.py).

The files are written the way llama.cpp's convert_hf_to_gguf.py writes them (hyperparameters, the vocabulary
with its token types, q/k rows permuted for its rotary), with gguf-py (llama.cpp's own Python package) quantizing
the blocks and reading the tokenizer's merges, special ids and chat template (its SpecialVocab). The served model
is checked against Hugging Face transformers on the source checkpoint with gguf-py's dequantization of the same
blocks, its tokenizer against the source model's Hugging Face tokenizer; the slow test serves the default model's
own GGUF file through `motet serve` and the OpenAI SDK against its model directory served with --quantization gguf.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from motet.api.served_names import served_names
from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights import gguf_config
from motet.engine.weights.model_store import resolve_model
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.kernels.test_quantization import (
    GGUF_TYPES,
    add_llama_tensors,
    assert_close_but_for_rounding_flips,
    gguf_reference,
    needs_native,
    quantizing_inputs,
)
from tests.own_cache import own_cache
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
OPTIONS = dict(device="cpu", block_size=8, num_kv_blocks=256)
UNTIED_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0"}  # the rest F32, output.weight too
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 12345",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>def add(a, b):\n    return a + b\n<|im_end|>",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "Ünïcödé façade naïve café — 東京 北京 🎵🎶",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to 3: 1 2 3 🎉"},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": "<|im_end|> is not the end"},
]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """The derived config and tokenizer go to this test's own cache, never the user's (the native kernels shared)."""
    return own_cache(monkeypatch, tmp_path / "cache")


def add_base_keys(writer, cfg) -> None:
    """The keys every llama.cpp converter class writes from a config (its TextModel's set_gguf_parameters)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_gguf_file(
    model_dir: Path,
    out: Path,
    types: dict[str, str],
    pre: str = "gpt-2",
    arch: str = "llama",
    quantize=None,
    meta: dict[str, int] | None = None,
    vocab=None,
):
    """`model_dir` as one GGUF file, as convert_hf_to_gguf.py's LlamaModel writes it: its hyperparameters, the
    vocabulary (get_vocab_base: [PADi] fill to the model's vocab_size, special added tokens CONTROL), gguf-py's
    SpecialVocab for merges, special ids and chat template; tensors in `types`' GGML types (F32 where not named),
    quantized by gguf-py (or `quantize(array, type)`). `vocab(writer, model_dir, vocab_size)`: another
    vocabulary's writer (a SentencePiece one's: tests/models/test_gguf_sentencepiece.py)."""
    import gguf

    quantize = quantize or gguf.quants.quantize

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = hf.config
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch=arch)
    add_base_keys(writer, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:  # as llama.cpp's converter writes it then
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_vocab_size(cfg.vocab_size)

    if vocab is None:
        add_gpt2_vocab(writer, model_dir, cfg.vocab_size, pre)
    else:
        vocab(writer, model_dir, cfg.vocab_size)

    for key, value in (meta or {}).items():  # hyperparameters as a malformed file would have them
        writer.add_uint32(key, value)
    add_llama_tensors(writer, hf, types, quantize, permute=arch == "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_gpt2_vocab(writer, model_dir: Path, vocab_size: int, pre: str) -> None:
    """The byte-level BPE vocabulary of `model_dir` as the converter's get_vocab_base writes it ([PADi] fill to
    the model's vocab_size, special added tokens CONTROL), with gguf-py's SpecialVocab for merges, special ids
    and chat template."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types_ = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types_.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        if reverse[i] in added:
            types_.append(gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types_.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types_)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_source, tmp_path_factory) -> Path:
    """The tiny model as one GGUF file, alone in its directory."""
    path = write_gguf_file(tiny_source, tmp_path_factory.mktemp("bare") / "tiny-q4.gguf", GGUF_TYPES)
    assert os.listdir(path.parent) == [path.name]
    return path


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_bare_gguf_file_matches_hf_on_gguf_py_dequantized(tiny_source, tiny_gguf, tmp_path, compiled):
    llm = LLM(str(tiny_gguf), compile_step=compiled, **OPTIONS)
    eng = llm.engine
    assert eng.config.quantization == "gguf"  # implied: its projections are served in their blocks
    if not compiled:
        formats = [lin.quantized.format.name for lin in eng.runner.model.decoder_linears()]
        assert formats == ["int4", "int8", "int4", "int8"] * 2  # qkv, o, gate_up, down per layer
    assert os.listdir(tiny_gguf.parent) == [tiny_gguf.name]  # nothing written beside the file
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_reference(tiny_source, tmp_path / "ref", GGUF_TYPES)
    ).eval()
    # the CPU product rounds the projections' inputs, and the lm_head's: the tied Q8_0 table in its blocks
    hf = quantizing_inputs(hf, lm_head=True)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_rounding_flips(engine_logits(eng, PROMPTS), want)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS[:3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy_hf(hf, p, 12) for p in prompts]


def test_untied_and_linear_rope_scaling_come_from_the_metadata(tmp_path):
    source = build_tiny_model(
        tmp_path / "source",
        tied=False,
        seed=1,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=5e4,
    )
    path = write_gguf_file(source, tmp_path / "bare" / "untied.gguf", UNTIED_TYPES)
    eng = LLM(str(path), compile_step=False, **OPTIONS).engine
    cfg = eng.model_config
    assert not cfg.tie_word_embeddings and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.rope_theta == 5e4
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    hf_cfg = hf.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        hf_cfg.num_hidden_layers,
        hf_cfg.hidden_size,
        hf_cfg.intermediate_size,
        hf_cfg.vocab_size,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        hf_cfg.max_position_embeddings,
        hf_cfg.rms_norm_eps,
    )
    ref = gguf_reference(source, tmp_path / "ref", UNTIED_TYPES)
    hf = AutoModelForCausalLM.from_pretrained(ref).eval()
    hf = quantizing_inputs(hf, lm_head=False, projections=("q_proj", "k_proj", "v_proj"))
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS[:3]]
    assert_close_but_for_rounding_flips(engine_logits(eng, PROMPTS[:3]), want)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_families_gguf_files_match_hf(tmp_path, cache, arch, compiled):
    """A Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms, head_dim apart from hidden / heads) GGUF file as
    llama.cpp's converter writes it (its own architecture's keys, q/k rows in Hugging Face's order, the qwen2
    pre-tokenizer), in F32: served bare, logits equal transformers' on the source checkpoint."""
    from tests.models.test_moe import randomize_norms

    source = build_tiny_model(tmp_path / "src", arch=arch, tied=False, head_dim=32)
    randomize_norms(source)
    path = write_gguf_file(source, tmp_path / "bare" / f"{arch}.gguf", {}, pre="qwen2", arch=arch)
    llm = LLM(str(path), compile_step=compiled, **OPTIONS)
    cfg = llm.engine.runner.model.config
    assert cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (cfg.attention_bias, cfg.qk_norm, cfg.head_dim) == (arch == "qwen2", arch == "qwen3", 32)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    for got, ref in zip(engine_logits(llm.engine, PROMPTS), want, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # the qwen2 pre-tokenizer splits as Qwen2's tokenizer.json does: digits one by one, words with their space
    from tokenizers import Tokenizer

    (derived,) = cache.rglob("tokenizer.json")
    pieces = Tokenizer.from_file(str(derived)).pre_tokenizer.pre_tokenize_str("ab 123 c!!")
    assert [p for p, _ in pieces] == ["ab", "Ġ", "1", "2", "3", "Ġc", "!!"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_families_gguf_files_convert_to_their_checkpoints(tmp_path, arch):
    """`convert_gguf` (what `motet pull` runs) writes the family's own Hugging Face directory: transformers loads
    it as that family and computes the source checkpoint's logits exactly (F32 tensors)."""
    from motet.engine.weights.gguf_convert import convert_gguf

    source = build_tiny_model(tmp_path / "src", arch=arch, tied=False, head_dim=32)
    path = write_gguf_file(source, tmp_path / "g" / "m.gguf", {}, pre="qwen2", arch=arch)
    converted = AutoModelForCausalLM.from_pretrained(convert_gguf(path, tmp_path / "out")).eval()
    hf = AutoModelForCausalLM.from_pretrained(source).eval()
    assert type(converted) is type(hf)
    with torch.no_grad():
        for prompt in PROMPTS[:3]:
            ids = torch.tensor([prompt])
            torch.testing.assert_close(converted(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_tokenizer_and_chat_template_from_the_metadata(tiny_source, tiny_gguf):
    llm = LLM(str(tiny_gguf), compile_step=False, **OPTIONS)
    eng, tok = llm.engine, llm.tokenizer
    ref = AutoTokenizer.from_pretrained(tiny_source)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(ref.encode(text), skip_special_tokens=False) == text
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert tok.hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    for add in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert tok.render_chat(MESSAGES, add_generation_prompt=add) == want
    rendered = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.encode_chat(MESSAGES) == ref.encode(rendered, add_special_tokens=False)
    # generation settings: BOS and EOS ids as the source model's
    assert eng.model_config.bos_token_id == ref.bos_token_id
    assert eng.eos_token_ids == {ref.eos_token_id}


def test_served_by_its_stem(tiny_gguf):
    args = argparse.Namespace(served_model_name=None)
    names = served_names(args, EngineConfig(model=str(tiny_gguf)))
    assert names[0] == "tiny-q4" and str(tiny_gguf) in names
    assert (
        served_names(argparse.Namespace(served_model_name=["mine"]), EngineConfig(model=str(tiny_gguf)))[0]
        == "mine"
    )


def test_derived_once_never_copying_the_weights(tiny_gguf, cache, monkeypatch, caplog):
    with caplog.at_level("INFO", logger="motet.engine"):
        d = resolve_model(str(tiny_gguf))
    # it says so as it begins (issue 57: a large vocabulary's derivation kept the port closed 26 s, silently)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"{tiny_gguf.name}: deriving its config, tokenizer and chat template") for m in said
    )
    assert any(m.startswith(f"{tiny_gguf.name}: derived in") for m in said), said
    assert d.parent == cache / "gguf" and d.name.startswith("tiny-q4-")
    assert (d / "model.gguf").is_symlink() and (d / "model.gguf").resolve() == tiny_gguf.resolve()
    assert sum(f.stat().st_size for f in d.iterdir() if not f.is_symlink()) < tiny_gguf.stat().st_size / 2
    assert not list(d.glob("*.safetensors"))

    def derive_again(*a, **kw):
        raise AssertionError("derived again")

    monkeypatch.setattr(gguf_config, "reader_config", derive_again)
    assert resolve_model(str(tiny_gguf)) == d  # found in the cache: the metadata is not read again
    moved = tiny_gguf.parent.parent / "moved" / "other.gguf"
    moved.parent.mkdir()
    shutil.copy(tiny_gguf, moved)
    with pytest.raises(AssertionError, match="derived again"):  # another file: derived for itself
        resolve_model(str(moved))


def test_quantization_flag_with_a_gguf_file(tiny_gguf, capsys):
    for q in ("int8", "int4"):
        with pytest.raises(ValueError, match=rf"quantization '{q}': .*tiny-q4\.gguf is a GGUF file"):
            EngineConfig(model=str(tiny_gguf), quantization=q)
    assert EngineConfig(model=str(tiny_gguf), quantization="gguf").quantization == "gguf"
    assert EngineConfig(model=str(tiny_gguf)).quantization == "gguf"
    from motet.api.cli import main

    assert main(["generate", "--model", str(tiny_gguf), "--quantization", "int4", "--prompt", "hi"]) == 2
    assert "is a GGUF file, served in its own quantized blocks" in capsys.readouterr().err


def test_unreadable_and_unserved_files_are_refused(tiny_source, tmp_path, cache):
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a GGUF file at all")
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a readable GGUF file"):
        resolve_model(str(junk))
    with pytest.raises(ModelLoadError, match=r"no such directory or file, and not a known model name"):
        resolve_model(str(tmp_path / "missing.gguf"))

    falcon = write_gguf_file(tiny_source, tmp_path / "q" / "falcon.gguf", {}, arch="falcon")
    with pytest.raises(
        ModelLoadError, match=r"falcon\.gguf: GGUF architecture 'falcon'; motet serves .*'llama', 'qwen2'"
    ) as unserved:
        LLM(str(falcon), **OPTIONS)
    listed = re.search(r"of architecture (.*?) \(", str(unserved.value))[1].split(", ")
    assert len(listed) == len(set(listed)), listed  # issue 68: 'llama' was listed twice (Mixtral's files too)
    pre = write_gguf_file(tiny_source, tmp_path / "p" / "pre.gguf", {}, pre="falcon")
    with pytest.raises(
        ModelLoadError, match=r"pre-tokenizer 'falcon' \(tokenizer\.ggml\.pre\); motet builds"
    ):
        LLM(str(pre), **OPTIONS)

    def zero_q8_1(w, qtype):  # Q8_1: a type gguf-py writes but cannot dequantize (nor quantize)
        if qtype.name != "Q8_1":
            return gguf.quants.quantize(w, qtype)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)

    q81 = write_gguf_file(
        tiny_source, tmp_path / "b" / "q8_1.gguf", GGUF_TYPES | {"ffn_down": "Q8_1"}, quantize=zero_q8_1
    )
    with pytest.raises(
        ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' is Q8_1, which gguf-py cannot dequantize"
    ):
        LLM(str(q81), **OPTIONS)
    assert not list((cache / "gguf").glob(".*"))  # no half-derived directory left behind


@pytest.mark.slow
def test_default_models_gguf_served_alone_equals_its_directory(default_model_dir, tmp_path, monkeypatch):
    """The default model's own Q4_1 file, copied alone into a directory and served through `motet serve`, answers
    a greedy chat like its model directory's GGUF file (quantization="gguf") in the offline engine. (The offline
    engine for the directory, not a second server: that the server answers as the offline engine does is
    tests/cluster/test_cluster.py's and tests/api/test_api.py's check.)"""
    import openai

    from motet.evals.server import ManagedServer

    bare = tmp_path / "bare" / "SmolLM2-135M-Instruct-Q4_1.gguf"
    bare.parent.mkdir()
    shutil.copy(Path(default_model_dir) / "model.gguf", bare)
    assert os.listdir(bare.parent) == [bare.name]
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    served = "SmolLM2-135M-Instruct-Q4_1"
    args = ["--max-num-seqs", "4", "--kv-cache-memory-gb", "0.25", "--model", str(bare)]
    with ManagedServer(args, log_path=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == [served]
        reply = client.chat.completions.create(model=served, messages=messages, max_tokens=32, temperature=0)
    llm = LLM(str(default_model_dir), quantization="gguf", max_num_seqs=4, dtype="auto")  # as `motet serve`
    prompt = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    assert reply.choices[0].message.content == out.text
    assert reply.choices[0].finish_reason == out.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(out.token_ids))
    assert "Paris" in out.text
    assert os.listdir(bare.parent) == [bare.name]  # still alone
