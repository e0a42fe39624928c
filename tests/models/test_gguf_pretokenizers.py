"""The pre-tokenizers of GPT-OSS's and DeepSeek's GGUF files (`tokenizer.ggml.pre` "gpt-4o", "deepseek-v3",
"deepseek-llm"), against the models' own tokenizer.json.

tests/fixtures/gguf_pretokenizers.json holds each one's normalizer, pre_tokenizer and ignore_merges as its
tokenizer.json has them (its "source" says where each came from): the `tokenizers` library rebuilds the reference
from that JSON, and motet's split (motet/engine/weights/gguf_pretokenizers.py) must equal it piece for piece and
offset for offset. A GGUF file carrying a real vocabulary is too large to keep, so the real vocabularies are
tested where their tokenizer.json is in the Hugging Face cache (skipped otherwise), and a tiny vocabulary's GGUF
file under each name is served bare, encoding as the tiny tokenizer.json with that pre-tokenizer does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.gguf_config import PRE_TOKENIZERS
from motet.engine.weights.gguf_convert import write_hf_metadata
from motet.engine.weights.gguf_model import gguf_model_dir
from motet.engine.weights.gguf_pretokenizers import pre_tokenizer
from tests.engine.test_gguf_model_file import TEXTS, write_gguf_file
from tests.tiny_models import build_tiny_model

FIXTURE = Path(__file__).parent.parent / "fixtures" / "gguf_pretokenizers.json"
REFERENCE = json.loads(FIXTURE.read_text())
NAMES = ["gpt-4o", "deepseek-v3", "deepseek-llm"]
# each name's model on the Hub, whose tokenizer.json the real-vocabulary test reads from the cache
REPOS = {
    "gpt-4o": "openai/gpt-oss-20b",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-llm": "deepseek-ai/DeepSeek-V2-Lite",
}
SAMPLE = [
    "Hello world",
    "I'm sure they'll say we'd've DONE it; it's JOHN'S, isn't it? We'RE here, you've seen",
    "1 12 123 1234 12345 123456 1234567 3.14159265358979 -0.5e10 $1,234,567.89 2024-11-26",
    "x=1234567890123456789012345678901234567890",
    "東京タワーは333メートルです。北京欢迎你！한국어 텍스트도 있습니다. ひらがなとカタカナ",
    "Привет, мир! Ελληνικά κείμενα. Ünïcödé façade naïve café — coöperate",
    "!!! ??? ... --- *** ((())) [[...]] {{}} <<>> ,,;; ''\"\" `code` a/b/c https://example.com/path?q=1&r=2",
    "line one\nline two\r\nline three\n\n\n  indented\n\ttabbed\t\tdouble\n   \n",
    "trailing spaces   ",
    "   leading spaces",
    "emoji 🎵🎶 👩‍👩‍👧 🇫🇷 ✨test✨ 🚀rocket",
    "full-width：（括号）「引用」，句号。ＡＢＣ１２３",
    "camelCaseWords and snake_case_words and ALLCAPS and MiXeD",
    "combining: e\u0301 a\u0308 n\u0303; zero-width\u200bjoined",
    "def add(a, b):\n    return a + b  # sum\n",
]


def reference(name: str) -> Tokenizer:
    """A `tokenizers` Tokenizer whose normalizer and pre-tokenizer are the fixture's for `name` (no vocabulary)."""
    ref = REFERENCE[name]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": ref["normalizer"],
        "pre_tokenizer": ref["pre_tokenizer"],
        "post_processor": None,
        "decoder": None,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    return Tokenizer.from_str(json.dumps(spec))


def reference_split(name: str, text: str) -> list[tuple[str, tuple[int, int]]]:
    ref = reference(name)
    if ref.normalizer is not None:  # DeepSeek-V3's is an empty sequence: text as it is
        assert ref.normalizer.normalize_str(text) == text
    return ref.pre_tokenizer.pre_tokenize_str(text)


@pytest.mark.parametrize("name", NAMES)
def test_split_equals_the_models_tokenizer_json(name):
    assert name in PRE_TOKENIZERS
    ours = pre_tokenizer(name)
    for text in SAMPLE + TEXTS:
        assert ours.pre_tokenize_str(text) == reference_split(name, text), text


def test_the_sample_tells_the_names_apart():
    """Each name splits the sample differently from the others, and from the names motet built before."""
    splits = {
        name: [pre_tokenizer(name).pre_tokenize_str(t) for t in SAMPLE]
        for name in NAMES + ["qwen2", "llama-bpe", "default"]
    }
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert splits[a] != splits[b], (a, b)


def gguf_vocabulary(tokenizer_json: dict) -> tuple[list[str], list[int], list[str]]:
    """A tokenizer.json's vocabulary as llama.cpp's converter writes it (get_vocab_base): a token per id, [PADi]
    where none has it (UNUSED, 5), added tokens CONTROL (3) when special else USER_DEFINED (4), the others NORMAL
    (1); the merges as "a b" strings."""
    by_id = {i: t for t, i in tokenizer_json["model"]["vocab"].items()}
    added = {a["id"]: a for a in tokenizer_json["added_tokens"]}
    by_id |= {i: a["content"] for i, a in added.items()}
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(5)
            continue
        tokens.append(by_id[i])
        types.append((3 if added[i]["special"] else 4) if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return tokens, types, merges


@pytest.mark.parametrize("name", NAMES)
def test_real_vocabulary_encodes_as_the_models_tokenizer(name, tmp_path):
    """The model's whole vocabulary under its GGUF name: the tokenizer motet derives from the metadata encodes
    the sample as the model's own tokenizer.json does (from the Hugging Face cache; skipped where it is not)."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(REPOS[name], "tokenizer.json")
    if not isinstance(path, str):
        pytest.skip(
            f"{REPOS[name]}'s tokenizer.json is not in the Hugging Face cache (it is not downloaded here)"
        )
    tokens, types, merges = gguf_vocabulary(json.loads(Path(path).read_text()))
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": name,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    config = {
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "max_position_embeddings": 4096,
    }
    write_hf_metadata(tmp_path, meta, config)
    ours, ref = Tokenizer.from_file(str(tmp_path / "tokenizer.json")), Tokenizer.from_file(path)
    for text in SAMPLE + TEXTS:
        assert (
            ours.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False).ids
        ), text


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("source"))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_gguf_file_under_the_name_encodes_as_that_tokenizer_json(
    name, tiny_source, tmp_path, monkeypatch
):
    """A GGUF file written as llama.cpp's converter writes one, under the name: accepted, and its derived
    tokenizer encodes as the tiny model's tokenizer.json does with the fixture's normalizer, pre-tokenizer and
    ignore_merges in place of its own."""
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf_file(tiny_source, tmp_path / "bare" / "tiny.gguf", {}, pre=name)
    ours = load_tokenizer(gguf_model_dir(path, tmp_path / "cache"))
    spec = json.loads((tiny_source / "tokenizer.json").read_text())
    spec["normalizer"] = REFERENCE[name]["normalizer"]
    spec["pre_tokenizer"] = REFERENCE[name]["pre_tokenizer"]
    spec["model"]["ignore_merges"] = REFERENCE[name]["ignore_merges"]
    ref = Tokenizer.from_str(json.dumps(spec))
    for text in SAMPLE + TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
