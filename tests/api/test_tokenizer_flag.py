"""`--tokenizer DIR`, vLLM's flag: `motet serve FILE.gguf --tokenizer DIR` serves the file with the tokenizer and chat
template of DIR (the original model's, say) instead of those derived from its metadata; a DIR that is not a
tokenizer's directory is refused in one line naming the flag."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from motet.api.cli import main
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.live_server import ThreadServer, assert_chat_prompt_ids
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# the tokenizer directory's own chat template (the file carries tiny_models' ChatML one)
OTHER_TEMPLATE = (
    "{% for m in messages %}{{ '### ' + m['role'] | upper + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### ASSISTANT:\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gguf_and_tokenizer(tmp_path_factory):
    """A tiny model's GGUF file, and a copy of its tokenizer's directory with another chat template."""
    tmp = tmp_path_factory.mktemp("tokenizer-flag")
    source = build_tiny_model(tmp / "source")
    path = write_gguf_file(source, tmp / "bare" / "tiny.gguf", {})
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, tok_dir / name)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    return path, tok_dir


def test_serve_a_gguf_file_with_the_named_tokenizer(gguf_and_tokenizer, tmp_path, monkeypatch):
    """A chat is rendered with DIR's template and encoded by DIR's tokenizer (transformers' on DIR: the reference),
    through /tokenize and a chat completion's prompt tokens."""
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    path, tok_dir = gguf_and_tokenizer
    ref = AutoTokenizer.from_pretrained(tok_dir)
    want = ref.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ref.decode(want).startswith("### SYSTEM:\nBe brief.")  # (not the file's ChatML)
    server = ThreadServer(
        "--model", str(path), "--tokenizer", str(tok_dir), "--threads", "1", "--max-model-len", "256",
        "--data-dir", str(tmp_path / "data"),
    )  # fmt: skip
    try:
        assert_chat_prompt_ids(server.url, path.stem, MESSAGES, want)
    finally:
        server.stop()


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_a_tokenizer_flag_naming_no_tokenizer_is_refused_in_one_line(
    gguf_and_tokenizer, tmp_path, capsys, what
):
    path, _ = gguf_and_tokenizer
    named = tmp_path / what
    if what == "empty":
        named.mkdir()
    assert main(["serve", "--model", str(path), "--tokenizer", str(named), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tokenizer {named}" in err[0], err
    assert ("no such directory" if what == "missing" else "no tokenizer in that directory") in err[0]
