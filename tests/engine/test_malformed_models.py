"""A model is input: a config.json or GGUF file whose hyperparameters are out of range (context length 0, no
attention heads, 2**32-1 layers, ...) or a model path that is not a regular file (a FIFO) is refused at
start-up with one line naming the field and its range, exit 2, before anything is allocated or served (such
files used to segfault in the native attention, raise ZeroDivisionError, or grow without end)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from motet.api.cli import main
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("source"))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))


def refused(model, capsys) -> str:
    """`motet generate --model MODEL`'s exit status must be 2; its one line on stderr."""
    capsys.readouterr()  # (what made the model wrote progress bars)
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_position_embeddings", 0, "max_position_embeddings must be from 1 to 16777216, got 0"),
        ("num_attention_heads", 0, "num_attention_heads must be from 1 to 1024, got 0"),
        ("num_hidden_layers", 2**32 - 1, "num_hidden_layers must be from 1 to 1024, got 4294967295"),
        (
            "num_key_value_heads",
            3,
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ("vocab_size", -5, "vocab_size must be from 1 to 16777216, got -5"),
        ("rms_norm_eps", 0, "rms_norm_eps must be above 0 and below 1, got 0"),
        ("num_hidden_layers", "many", "num_hidden_layers must be an integer from 1 to 1024, got 'many'"),
        ("hidden_size", 2.5, "hidden_size must be an integer from 1 to 65536, got 2.5"),
    ],
)
def test_out_of_range_config_json_is_one_line(source, tmp_path, capsys, field, value, message):
    model = tmp_path / "m"
    shutil.copytree(source, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg[field] = value
    (model / "config.json").write_text(json.dumps(cfg))
    line = refused(model, capsys)
    assert str(model / "config.json") in line and re.search(message, line), line


@pytest.mark.parametrize(
    "key, value",
    [
        ("llama.context_length", 0),
        ("llama.attention.head_count", 0),
        ("llama.block_count", 0xFFFFFFFF),
        ("llama.embedding_length", 0),
    ],
)
def test_out_of_range_gguf_metadata_is_one_line(source, tmp_path, capsys, key, value):
    path = write_gguf_file(source, tmp_path / "g" / "bad.gguf", {}, meta={key: value})
    line = refused(path, capsys)
    assert f"bad.gguf: {key} must be from" in line and f"got {value}" in line


def test_a_fifo_as_the_model_is_refused(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    line = refused(fifo, capsys)
    assert "is not a regular file or a directory" in line
