"""A model directory's tokenizer is the class transformers' AutoTokenizer picks for it; the pick is remembered
under the motet cache and a later start loads that class directly (motet/engine/tokenizer.py `load_tokenizer`):
AutoTokenizer's pick imports the model family's config class, and with it most of transformers' modelling code and
torch.distributed (issue 65: seconds of every warm start). What a remembered load gives is checked against
AutoTokenizer's own tokenizer: its class, ids, text, special tokens and chat template."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers
from transformers import AutoTokenizer

from motet.engine import tokenizer as tokenizer_module
from motet.engine.tokenizer import load_tokenizer, tokenizer_class_memo
from tests.live_server import ROOT

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand blank lines  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "Ünïcödé façade naïve café — 東京 🎵",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3"}]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The memos go to this test's own cache, never the user's."""
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def assert_same(ours, ref) -> None:
    assert type(ours) is type(ref)
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert ours.all_special_tokens == ref.all_special_tokens and ours.all_special_ids == ref.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        ref.unk_token_id,
    )
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in ref.added_tokens_decoder.items()
    }
    assert ours.chat_template == ref.chat_template
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    if ref.chat_template:
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
            ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        )


@pytest.fixture(params=["tiny", "default"])
def model_dir(request, tiny_model_dir):
    if request.param == "tiny":
        return tiny_model_dir
    return request.getfixturevalue("default_model_dir")


def test_a_remembered_pick_loads_what_autotokenizer_loads(model_dir, monkeypatch):
    ref = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    first = load_tokenizer(model_dir).hf  # picked by AutoTokenizer, and remembered
    assert_same(first, ref)
    memo = tokenizer_class_memo(model_dir)
    assert json.loads(memo.read_text())["class"] == type(ref).__qualname__

    def no_pick(*a, **kw):
        raise AssertionError("AutoTokenizer picked again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_pick)
    assert_same(load_tokenizer(model_dir).hf, ref)


def test_a_changed_file_or_another_transformers_picks_again(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    load_tokenizer(model)
    memo = tokenizer_class_memo(model)
    assert memo.is_file()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}, indent=1))
    assert tokenizer_class_memo(model) != memo  # the file changed: another key
    assert load_tokenizer(model).hf.model_max_length == 77
    monkeypatch.setattr(transformers, "__version__", "0.0.0")
    assert tokenizer_class_memo(model) != memo


def test_a_memo_that_does_not_read_is_picked_again(tiny_model_dir):
    memo = tokenizer_class_memo(tiny_model_dir)
    memo.parent.mkdir(parents=True)
    memo.write_text('{"module": "os", "class": "nothing here"}')
    ref = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert_same(load_tokenizer(tiny_model_dir).hf, ref)
    assert json.loads(memo.read_text())["class"] == type(ref).__qualname__  # written again


def test_memos_are_bounded(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "MEMOS_KEPT", 3)
    memo = tokenizer_class_memo(tiny_model_dir)
    memo.parent.mkdir(parents=True)
    for i in range(5):
        (memo.parent / f"old-{i}.json").write_text("{}")
    load_tokenizer(tiny_model_dir)
    assert memo.is_file() and len(list(memo.parent.glob("*.json"))) == 3


def test_a_remembered_load_imports_no_model_family_code(tiny_model_dir, cache):
    """The cause, read from a fresh interpreter's modules: the second load imports neither the family's config
    class nor torch.distributed's tensors that transformers' modelling code pulls in."""
    load_tokenizer(tiny_model_dir)  # the first start's pick
    code = (
        "import json, sys\n"
        "from motet.engine.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tiny_model_dir)!r})\n"
        "print(json.dumps([m for m in ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor',"
        " 'transformers.models.auto.tokenization_auto') if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
