"""Reasoning split (`<think>...</think>`): whole-output rules, and the stream parser agreeing with them
for every split of an output."""

from __future__ import annotations

import random

import pytest

from motet.grammar.reasoning import (
    REASONING_END,
    THINK,
    ReasoningStreamParser,
    reasoning_format,
)
from tests.grammar.streaming import feed_reasoning


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
    assert THINK.split(text, started) == (reasoning, content)
    assert stream(text, started, []) == (reasoning or "", content)


def stream(text: str, started: bool, cuts: list[int]) -> tuple[str, str]:
    return feed_reasoning(ReasoningStreamParser(started=started), text, cuts)


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
    reasoning, content = THINK.split(text, started)
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
        reasoning, content = THINK.split(text, started)
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
        assert parser.reasoning_ended == THINK.ended(text[:i], started), text[:i]


def test_reasoning_ended():
    assert REASONING_END == "</think>"
    assert not THINK.ended("")
    assert not THINK.ended(" <thi")
    assert THINK.ended("Hello")
    assert not THINK.ended("<think>a</thin")
    assert THINK.ended("<think>a</think>")
    assert not THINK.ended("", started=True)
    assert not THINK.ended("Hello", started=True)
    assert THINK.ended("Hello</think>", started=True)


# ---------------------------------------------------------------------------------------------------
# The formats by vLLM's names

THOUGHT, REST = "This is a reasoning section", "This is the rest"


@pytest.mark.parametrize(
    "name, text, started, reasoning, content",
    [
        # vLLM's tests/reasoning/test_qwen3_reasoning_parser.py
        ("qwen3", f"<think>{THOUGHT}</think>{REST}", False, THOUGHT, REST),
        (
            "qwen3",
            REST,
            False,
            None,
            REST,
        ),  # enable_thinking=False: the template closed the reasoning already
        ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\n{REST}", False, THOUGHT, REST),
        ("qwen3", f"{THOUGHT}</think>{REST}", True, THOUGHT, REST),  # Qwen3-2507's template opened <think>
        ("qwen3", f"<think>{THOUGHT}", False, THOUGHT, ""),  # cut off while thinking
        # vLLM's tests/reasoning/test_deepseekr1_reasoning_parser.py: R1 may not write <think>
        ("deepseek_r1", f"{THOUGHT}</think>{REST}", False, THOUGHT, REST),
        ("deepseek_r1", f"<think>{THOUGHT}</think>{REST}", False, THOUGHT, REST),
        ("deepseek_r1", f"{THOUGHT}\n</think>\n\n{REST}", False, THOUGHT, REST),
        ("deepseek_r1", THOUGHT, False, THOUGHT, ""),  # no end: all reasoning (vLLM's content is None)
        ("deepseek_r1", f"</think>{REST}", False, None, REST),
        ("deepseek_r1", f"<think>{THOUGHT}", False, THOUGHT, ""),
        # vLLM's tests/reasoning/test_granite_reasoning_parser.py
        ("granite", f"Here is my thought process:{THOUGHT}Here is my response:{REST}", False, THOUGHT, REST),
        ("granite", f"Here's my thought process:{THOUGHT}Here's my response:{REST}", False, THOUGHT, REST),
        (
            "granite",
            f"Here is my thought process:\n{THOUGHT}\nHere's my response:\n{REST}",
            False,
            THOUGHT,
            REST,
        ),
        ("granite", "This is content", False, None, "This is content"),
        # only the thought process: vLLM's whole parse gives all content, its stream reasoning; motet reasoning
        ("granite", f"Here is my thought process:{THOUGHT}", False, THOUGHT, ""),
        (
            "granite",
            f"Sure. Here is my thought process:{THOUGHT}",
            False,
            None,
            f"Sure. Here is my thought process:{THOUGHT}",
        ),
    ],
)
def test_formats(name, text, started, reasoning, content):
    fmt = reasoning_format(name)
    assert fmt.split(text, started) == (reasoning, content)
    assert stream_format(fmt, text, started, []) == (reasoning or "", content)


def stream_format(fmt, text: str, started: bool, cuts: list[int]) -> tuple[str, str]:
    return feed_reasoning(fmt.stream_parser(started), text, cuts)


FORMAT_PIECES = {
    "deepseek_r1": ["<think>", "</think>", "<thi", "</th", "\n", " ", "a", "Answer."],
    "granite": [
        "Here is my thought process:",
        "Here's my thought process:",
        "Here is my response:",
        "Here's my response:",
        "Here",
        "Here's my",
        " is my",
        " response",
        ":",
        "\n",
        " ",
        "a",
    ],
}


@pytest.mark.parametrize("name", list(FORMAT_PIECES))
def test_formats_stream_equals_split_on_random_outputs(name):
    fmt = reasoning_format(name)
    rng = random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(FORMAT_PIECES[name]) for _ in range(rng.randint(0, 10)))
        started = rng.random() < 0.3
        reasoning, content = fmt.split(text, started)
        for _ in range(4):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1))
            assert stream_format(fmt, text, started, cuts) == (reasoning or "", content), (
                text,
                started,
                cuts,
            )
        parser = fmt.stream_parser(started)
        for i in range(len(text) + 1):
            if i:
                parser.feed(text[i - 1])
            assert parser.reasoning_ended == fmt.ended(text[:i], started), text[:i]


def test_started_from_the_prompt():
    qwen3, r1 = reasoning_format("qwen3"), reasoning_format("deepseek_r1")
    assert qwen3.started("<|im_start|>assistant\n<think>\n")  # Qwen3-2507 thinking's template
    assert not qwen3.started("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert r1.started("<｜Assistant｜>")  # R1 begins inside its reasoning whatever the prompt
    assert reasoning_format("none") is None and reasoning_format(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("deepseek_v3")
