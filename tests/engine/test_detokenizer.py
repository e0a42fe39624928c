"""Incremental detokenizer vs a full decode, on a byte-level BPE trained on the fly; stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from motet.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Straße.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀 😂 🎉 👍🏽 🇫🇷 ❤️ and math ∑∫√∞ ≤ ≥.",
] * 20


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", bos_token="<|im_start|>")


def stream(tok, prompt_ids, out_ids, skip=True):
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [d.push(t) for t in out_ids]
    deltas.append(d.flush())
    assert "".join(deltas) == d.text
    return deltas


def test_tokenizer_splits_multibyte_characters(tok):
    # the test is only meaningful if some characters span several tokens
    ids = tok.encode("𝄞", add_special_tokens=False)
    assert len(ids) >= 2 and all("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode(tok, skip):
    rng = random.Random(0)
    prompt = tok.encode("<|im_start|>user\nSay something nice 😀<|im_end|>\n", add_special_tokens=False)
    texts = CORPUS[:4] + ["mixed 𝄞 ünïcödé 🦄 <|im_end|> tail", "  spaces\n\n\ttabs ", "💩" * 3]
    cases = [tok.encode(t, add_special_tokens=False) for t in texts]
    # random ids: includes special tokens and invalid byte sequences mid-stream
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    for out in cases:
        deltas = stream(tok, prompt, out, skip)
        assert "".join(deltas) == tok.decode(out, skip_special_tokens=skip)


def test_multibyte_char_split_across_tokens_never_yields_replacement(tok):
    text = "a𝄞b 🦄 ü"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, tok.encode("x", add_special_tokens=False), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some delta was held back while a character was incomplete


def test_incomplete_tail_flushes_as_replacement(tok):
    ids = tok.encode("𝄞", add_special_tokens=False)[:-1]
    d = IncrementalDetokenizer(tok, [0])
    assert [d.push(t) for t in ids] == [""] * len(ids)
    assert d.flush() == tok.decode(ids) and "\ufffd" in d.text


def test_skip_special_tokens(tok):
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, [0], ids, skip=True)) == "hi"
    assert "".join(stream(tok, [0], ids, skip=False)) == "hi<|im_end|>"


def test_window_stays_small(tok):
    d = IncrementalDetokenizer(tok, tok.encode("prompt " * 50, add_special_tokens=False))
    for t in tok.encode("Hello world, the quick brown fox. " * 30, add_special_tokens=False):
        d.push(t)
        assert len(d.ids) <= 8


def feed_all(m: StopStringMatcher, deltas):
    out, stopped = [], False
    for delta in deltas:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def splits(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(6, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stop_string_not_leaked_and_found_across_deltas():
    rng = random.Random(1)
    text = "The answer is 42.\n###\nmore text"
    for _ in range(50):
        m = StopStringMatcher(["###"])
        emitted = []
        for delta in splits(text, rng):
            out, stopped = m.feed(delta)
            emitted.append(out)
            assert "#" not in "".join(emitted)  # held back before the match is known
            if stopped:
                break
        assert stopped and "".join(emitted) == "The answer is 42.\n"


def test_stop_earliest_wins_and_include():
    text = "alpha beta STOP gamma END delta"
    for deltas in ([text], list(text)):
        assert feed_all(StopStringMatcher(["END", "STOP"]), deltas) == ("alpha beta ", True)
        m = StopStringMatcher(["END", "STOP"], include_stop_str_in_output=True)
        assert feed_all(m, deltas) == ("alpha beta STOP", True)
    # overlapping stops: the one that completes first, whatever the split
    for deltas in (["xabcx"], list("xabcx")):
        assert feed_all(StopStringMatcher(["abc", "b"]), deltas) == ("xa", True)


def test_no_match_flush_returns_everything():
    rng = random.Random(2)
    text = "partial sto and ST and #"
    for _ in range(20):
        m = StopStringMatcher(["STOP", "stop", "##"])
        assert feed_all(m, splits(text, rng)) == (text, False)
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.flush() == "ST" and m.flush() == ""


def test_after_stop_everything_is_dropped():
    m = StopStringMatcher(["\n"])
    assert m.feed("one\ntwo") == ("one", True)
    assert m.feed("three") == ("", True) and m.flush() == ""
