"""A training file's examples are counted before any is parsed or tokenized (issue 68, finding 10: a file of
100,001 short chats was refused for its count only after 100,000 were tokenized, minutes of the server's CPU): the
count is the examples `read_examples` reads, whatever the blocks the file is read in, and a file of too many is
refused before the tokenizer sees one."""

from __future__ import annotations

import io
import json
import random

import pytest

from motet.engine.tokenizer import load_tokenizer
from motet.grammar.tool_formats import tool_format
from motet.training import dataset
from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import DataError, read_examples
from motet.training.dataset import count_examples, prepare

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "HI"}]})


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_the_count_is_the_examples_read_examples_reads(monkeypatch, block):
    monkeypatch.setattr(dataset, "_BLOCK", block)
    rng = random.Random(block)
    for _ in range(200):
        lines = [
            rng.choice([CHAT, "", " ", "\t \r", " " + CHAT + " \r", "\x0b"])
            for _ in range(rng.randint(1, 12))
        ]
        data = "\n".join(lines).encode() + rng.choice([b"", b"\n", b" \n \n"])
        try:
            want = sum(1 for _ in read_examples(io.BytesIO(data), "supervised", 1 << 20, 1000))
        except DataError as e:
            assert "no examples" in str(e)
            with pytest.raises(DataError, match="holds no examples"):
                count_examples(io.BytesIO(data), 1000)
            continue
        source = io.BytesIO(data)
        assert count_examples(source, 1000) == want and source.tell() == 0, data
        if want > 1:
            with pytest.raises(DataError, match=f"more than {want - 1} examples"):
                count_examples(io.BytesIO(data), want - 1)


def test_a_file_of_too_many_is_refused_before_one_is_tokenized(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    encoder = ChatEncoder(tokenizer, tool_format(None, tokenizer.hf.chat_template), 1024)
    encoded = []
    supervised = encoder.supervised
    encoder.supervised = lambda example: encoded.append(example) or supervised(example)
    data = io.BytesIO("\n".join([CHAT] * 11).encode())
    with pytest.raises(DataError, match="more than 10 examples"):
        prepare(data, "supervised", encoder, tmp_path / "rows", max_examples=10)
    assert encoded == [] and not list(tmp_path.iterdir())
    assert prepare(io.BytesIO("\n".join([CHAT] * 10).encode()), "supervised", encoder, tmp_path / "rows",
                   max_examples=10).examples == len(encoded) == 10  # fmt: skip
