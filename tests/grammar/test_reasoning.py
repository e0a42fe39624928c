"""Reasoning split (`<think>...</think>`): whole-output rules, and the stream parser agreeing with them
for every split of an output."""

from __future__ import annotations

import random

import pytest

from motet.grammar.reasoning import REASONING_END, ReasoningStreamParser, reasoning_ended, split_reasoning


@pytest.mark.parametrize(
    "text, started, reasoning, content",
    [
        ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False, "Let me think.", "The answer is 4."),
        ("  \n<think>a\n\nb</think>c\n", False, "a\n\nb", "c\n"),
        ("The answer is 4.", False, None, "The answer is 4."),
        ("  The answer.", False, None, "  The answer."),  # no reasoning: content verbatim
        ("", False, None, ""),
        ("\n\n", False, None, "\n\n"),
        ("<thin", False, None, "<thin"),
        ("x <think>y</think>z", False, None, "x <think>y</think>z"),
        ("a</think>b", False, None, "a</think>b"),
        ("<think>\nstill thinking\n", False, "still thinking", ""),  # never closed
        ("<think>", False, None, ""),
        ("<think>\n\n</think>\n\nHi", False, None, "Hi"),  # empty reasoning is None
        ("<think>a</think>", False, "a", ""),
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),
        ("<think><think>a</think>b", False, "<think>a", "b"),
        ("\nLet me think.\n</think>\n\nFour.", True, "Let me think.", "Four."),
        ("Still going", True, "Still going", ""),
        ("</think>Four.", True, None, "Four."),
        # re-opened anyway (Qwen3's old templates): skipped, as vLLM does
        ("<think>x</think>y", True, "x", "y"),
        (" <think>\nx</think>y", True, "x", "y"),
        ("", True, None, ""),
    ],
)
def test_split_reasoning(text, started, reasoning, content):
    assert split_reasoning(text, started) == (reasoning, content)
    assert stream(text, started, []) == (reasoning or "", content)


def stream(text: str, started: bool, cuts: list[int]) -> tuple[str, str]:
    parser = ReasoningStreamParser(started=started)
    reasoning, content, prev = [], [], 0
    for cut in [*sorted(cuts), len(text)]:
        r, c = parser.feed(text[prev:cut])
        reasoning.append(r)
        content.append(c)
        prev = cut
    r, c = parser.finish()
    return "".join([*reasoning, r]), "".join([*content, c])


EXAMPLES = [
    ("<think>\nStep 1.\n\nStep 2.\n</think>\n\nAnswer: 42.\n", False),
    ("  <think> a < b </thin </think> <think> c", False),
    ("Plain text with </think> inside.", False),
    (" \n <thi", False),
    ("<think>\n\n", False),
    ("<think>x\u2003</think>\u2003y", False),
    ("\nReasoning here.\n</think>\n\nContent.", True),
    ("no end in sight  ", True),
    ("</think>", True),
    ("\n\n</think>\n\n", True),
]


@pytest.mark.parametrize("text, started", EXAMPLES)
def test_stream_equals_split_for_every_split(text, started):
    reasoning, content = split_reasoning(text, started)
    want = (reasoning or "", content)
    assert stream(text, started, list(range(1, len(text)))) == want  # one character at a time
    for i in range(len(text) + 1):
        assert stream(text, started, [i]) == want, i
        for j in range(i, len(text) + 1):
            assert stream(text, started, [i, j]) == want, (i, j)


def test_stream_equals_split_on_random_outputs():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<think", "</thi", "\n", " ", "\n\n", "a", "b c", "<", ">", "Answer."]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        started = rng.random() < 0.3
        reasoning, content = split_reasoning(text, started)
        for _ in range(5):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1))
            assert stream(text, started, cuts) == (reasoning or "", content), (text, started, cuts)


def test_stream_is_incremental():
    parser = ReasoningStreamParser()
    assert parser.feed(" ") == ("", "")
    assert parser.feed("<thi") == ("", "")  # may still open the reasoning
    assert parser.feed("nk>\n") == ("", "")
    assert parser.feed("First, ") == ("First,", "")  # trailing whitespace held back
    assert parser.feed("add.\n") == (" add.", "")
    assert parser.feed("</th") == ("", "")
    assert not parser.reasoning_ended
    assert parser.feed("ink>") == ("", "")
    assert parser.reasoning_ended
    assert parser.feed("\n\n") == ("", "")
    assert parser.feed("It is ") == ("", "It is ")  # content streams verbatim once it started
    assert parser.feed("4.\n") == ("", "4.\n")
    assert parser.finish() == ("", "")


def test_stream_without_reasoning_passes_content_through():
    parser = ReasoningStreamParser()
    assert parser.feed("\n") == ("", "")
    assert parser.feed("Hi") == ("", "\nHi")
    assert parser.reasoning_ended
    assert parser.feed(" <think>x</think>") == ("", " <think>x</think>")


def test_stream_started():
    parser = ReasoningStreamParser(started=True)
    assert not parser.reasoning_ended
    assert parser.feed("\nHmm") == ("Hmm", "")
    assert parser.feed("</think>\n\nYes") == ("", "Yes")
    assert parser.reasoning_ended


@pytest.mark.parametrize("text, started", EXAMPLES + [("<think>a</think>", False), ("Hello", False)])
def test_reasoning_ended_matches_stream(text, started):
    parser = ReasoningStreamParser(started=started)
    for i in range(len(text) + 1):
        if i:
            parser.feed(text[i - 1])
        assert parser.reasoning_ended == reasoning_ended(text[:i], started), text[:i]


def test_reasoning_ended():
    assert REASONING_END == "</think>"
    assert not reasoning_ended("")
    assert not reasoning_ended(" <thi")
    assert reasoning_ended("Hello")
    assert not reasoning_ended("<think>a</thin")
    assert reasoning_ended("<think>a</think>")
    assert not reasoning_ended("", started=True)
    assert not reasoning_ended("Hello", started=True)
    assert reasoning_ended("Hello</think>", started=True)
