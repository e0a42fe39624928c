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
    assert_same(load_tokenizer(model_dir).transformers(), ref)


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
    monkeypatch.setattr(tokenizer_module, "library_versions", lambda: ["0.0.0", "0.0.0"])
    assert tokenizer_class_memo(model) != memo


def test_a_memo_that_does_not_read_is_picked_again(tiny_model_dir):
    memo = tokenizer_class_memo(tiny_model_dir)
    memo.parent.mkdir(parents=True)
    memo.write_text('{"module": "os", "class": "nothing here"}')
    ref = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert_same(load_tokenizer(tiny_model_dir).transformers(), ref)
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


# A template that reaches what chat templates use: the special tokens' variables, tools through tojson, a
# namespace, loop controls, raise_exception, reasoning under its names, content blocks, a missing (None) key.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system=false) %}
{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% if not loop.last %},{% endif %}{% endfor %}</tools>
{% endif %}{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = true %}{% endif %}
{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
<|{{ m.role }}|>{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% if m.content is string %}{{ m.content }}{% elif m.content is not none %}{% for b in m.content %}{% if b.type != 'text' %}{% continue %}{% endif %}{{ b.text }}{% endfor %}{% endif %}
{% if 'tool_calls' in m %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% if not ns.system %}(no system){% endif %}{% endif %}"""

CHATS = [
    (MESSAGES, {"add_generation_prompt": True}),
    (MESSAGES, {"add_generation_prompt": False}),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        {"continue_final_message": True},
    ),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello  "}],
        {"continue_final_message": True},
    ),
    (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning": "mull",
                "tool_calls": [{"name": "f", "arguments": {"x": 1}}],
            },
            {"role": "tool", "content": "42"},
        ],
        {
            "add_generation_prompt": True,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
    ),
    (
        [{"role": "user", "content": "é 東京 </s>"}],
        {"add_generation_prompt": True, "custom_flag": [1, "two"]},
    ),
]


def test_a_snapshot_answers_as_transformers(model_dir):
    """Issue 65: a later start serves from the tokenizer's snapshot, without transformers; what serving asks of it
    is transformers' answer: ids (with and without special tokens), text, tokens, the special tokens, the chat
    template and its rendering (the model's template, and one using what templates use, on chats of every kind)."""
    from motet.engine.chat_render import render
    from motet.engine.tokenizer_snapshot import TokenizerSnapshot

    ref = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    load_tokenizer(model_dir)  # the first start: keeps the snapshot
    tok = load_tokenizer(model_dir)
    snap = tok.hf
    assert isinstance(snap, TokenizerSnapshot) and snap._hf is None  # (transformers' tokenizer never loaded)
    assert len(snap) == len(ref) and tok.vocab_size == len(ref)
    assert (snap.bos_token_id, snap.eos_token_id, snap.pad_token_id, snap.eos_token) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        ref.eos_token,
    )
    assert snap.all_special_ids == ref.all_special_ids and snap.chat_template == ref.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert snap.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert snap.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            assert snap.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
            assert snap.convert_ids_to_tokens(ids, skip_special_tokens=True) == ref.convert_ids_to_tokens(
                ids, skip_special_tokens=True
            )
    templates = [t for t in (ref.chat_template, RICH_TEMPLATE) if t]
    for template in templates:
        for chat, kwargs in CHATS:
            try:
                want = ref.apply_chat_template(chat, chat_template=template, tokenize=False, **kwargs)
            except Exception as e:  # (a chat this template cannot render: refused the same way)
                with pytest.raises(type(e)):
                    render(template, chat, snap.special_tokens_map, **kwargs)
                continue
            assert render(template, chat, snap.special_tokens_map, **kwargs) == want
            if template == ref.chat_template:
                assert tok.render_chat(chat, **{"add_generation_prompt": False, **kwargs}) == want
    assert snap._hf is None
    assert snap.transformers().get_vocab() == ref.get_vocab()  # anything else: transformers' own, loaded then


def test_a_template_error_is_transformers_error():
    """A template's own refusal (raise_exception) and a sandbox refusal read as transformers' do."""
    import jinja2

    from motet.engine.chat_render import render

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role robot"):
        render(RICH_TEMPLATE, [{"role": "robot", "content": "x"}], {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}], {})
    with pytest.raises(ValueError, match="not compatible"):
        render(RICH_TEMPLATE, MESSAGES, {}, add_generation_prompt=True, continue_final_message=True)


def test_a_warm_load_imports_no_transformers(tiny_model_dir, cache):
    """Issue 65, the cause read from a fresh interpreter's modules: once the first start kept the snapshot, a
    later one loads the tokenizer, renders a chat and encodes it without importing transformers (its import and
    the tokenizer's build through it were a second or two of a warm start)."""
    load_tokenizer(tiny_model_dir)  # the first start
    ref = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    want = ref.encode(
        ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    code = (
        "import json, sys\n"
        "from motet.engine.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tiny_model_dir)!r})\n"
        f"ids = tok.encode_chat({MESSAGES!r})\n"
        "print(json.dumps([ids, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ids, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert ids == want and imported == []


def test_first_imports_of_transformers_from_two_threads_complete(tiny_model_dir, cache):
    """A warm start imports transformers at its first use, and two threads may be first: the grammar vocabulary's
    idle-time build (the snapshot's transformers tokenizer, then llguidance's backend) beside a fine-tuning job's
    planning (peft, under `first_imports` as api/fine_tuning/routes.py imports it). Unguarded, Python handed one of
    them a half-made transformers (a suite run: "cannot import name 'AutoModel' from 'transformers'", a 500 on a
    job's creation; two bare threads importing llguidance.hf and peft fail so every time here)."""
    load_tokenizer(tiny_model_dir)  # the first start keeps the snapshot
    code = (
        "import threading\n"
        "from motet.engine.tokenizer import load_tokenizer\n"
        "from motet.grammar.backend import GrammarTokenizer\n"
        "from motet.grammar.cache import GrammarCache\n"
        "from motet.serial_imports import first_imports\n"
        f"tok = load_tokenizer({str(tiny_model_dir)!r})\n"
        "errors, start = [], threading.Barrier(2)\n"
        "def vocabulary():\n"
        "    start.wait()\n"
        "    try:\n"
        "        hf = tok.transformers()\n"
        "        GrammarCache().backend('llguidance', GrammarTokenizer(hf, vocab_size=len(hf)))\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "def job():\n"
        "    start.wait()\n"
        "    try:\n"
        "        with first_imports():\n"
        "            from peft import LoraConfig\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "threads = [threading.Thread(target=f) for f in (vocabulary, job)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors, errors\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_early_load_builds_the_snapshot_beside_the_start(tiny_model_dir, monkeypatch):
    """`motet serve` begins loading the tokenizer's snapshot before its imports (load_tokenizer_early): the
    engine's load_tokenizer takes what that thread built; without a snapshot it loads through transformers
    itself (the early thread never imports transformers beside the start's own imports)."""
    import threading

    from motet.engine.tokenizer import load_tokenizer_early
    from motet.engine.tokenizer_snapshot import TokenizerSnapshot

    built, real_init = [], TokenizerSnapshot.__init__

    def counted(self, *a, **kw):
        built.append(threading.current_thread().name)
        real_init(self, *a, **kw)

    monkeypatch.setattr(TokenizerSnapshot, "__init__", counted)
    load_tokenizer_early(tiny_model_dir)  # (no snapshot yet: nothing for the early thread)
    first = load_tokenizer(tiny_model_dir)
    assert not isinstance(first.hf, TokenizerSnapshot) and built == []
    load_tokenizer_early(tiny_model_dir)
    later = load_tokenizer(tiny_model_dir)
    assert isinstance(later.hf, TokenizerSnapshot) and built == ["motet-tokenizer"]
    assert later.encode_chat(MESSAGES) == first.encode_chat(MESSAGES)
