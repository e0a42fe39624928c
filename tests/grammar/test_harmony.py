"""GPT-OSS's harmony output (motet/grammar/harmony.py): its channels as reasoning (`--reasoning-parser openai_gptoss`)
and its calls as OpenAI tool calls (`--tool-call-parser openai`), whole and streamed; the grammar of a forced call.

The outputs are written as gpt-oss writes them: OpenAI's harmony cookbook, and token-by-token transcripts of
gpt-oss-20b (both placements of the recipient, a cut-off `<|call|>`, a header-less first message)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from motet.grammar.reasoning import HARMONY, REASONING_FORMATS, reasoning_format
from motet.grammar.tool_calls import validate_tools
from motet.grammar.tool_formats import OPENAI, tool_format
from tests.grammar.streaming import collect, every_split, feed_calls, feed_reasoning

ANALYSIS = '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use get_weather tool.<|end|>'
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"location":"Tokyo"}<|call|>'
)
TOKYO = ("get_weather", {"location": "Tokyo"})
THOUGHT = 'User asks: "What is the weather in Tokyo?" We need to use get_weather tool.'


def both(text: str):
    """The reasoning split, then the tool-call parse of its content, as the chat output runs them."""
    reasoning, content = HARMONY.split(text)
    content, calls = OPENAI.parse(content)
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        (ANALYSIS + CALL, THOUGHT, None, [TOKYO]),  # the cookbook's call
        (
            ANALYSIS + CALL.removesuffix("<|call|>"),
            THOUGHT,
            None,
            [TOKYO],
        ),  # <|call|> is a stop token: not in the text
        (
            "<|channel|>analysis<|message|>User asks a simple math question.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
            "User asks a simple math question.",
            "2 + 2 = 4.",
            [],
        ),
        (  # the recipient before the channel, continuing the prompt's `<|start|>assistant` (gpt-oss-20b)
            ' to=functions.get_current_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}<|call|>',
            None,
            None,
            [("get_current_weather", {"location": "Tokyo"})],
        ),
        (  # the content type without <|constrain|>
            '<|channel|>commentary to=functions.get_current_weather json<|message|>{"location": "Tokyo"}<|call|>',
            None,
            None,
            [("get_current_weather", {"location": "Tokyo"})],
        ),
        (  # as the gpt-oss chat template writes a past call
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Tokyo"}<|call|>',
            None,
            None,
            [TOKYO],
        ),
        (  # the cookbook's pretty-printed arguments, cut at the stop token
            "<|channel|>analysis<|message|>So we should call get_current_weather with location "
            '"San Francisco, CA".<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather '
            '<|constrain|>json<|message|>{\n  "location": "San Francisco, CA"\n}',
            'So we should call get_current_weather with location "San Francisco, CA".',
            None,
            [("get_current_weather", {"location": "San Francisco, CA"})],
        ),
        (  # a preamble on the commentary channel, then the call
            "<|channel|>analysis<|message|>Need to search.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Let me look that up.<|end|><|start|>assistant<|channel|>commentary to=functions.search "
            '<|constrain|>json<|message|>{"query": "test"}<|call|>',
            "Need to search.",
            "Let me look that up.",
            [("search", {"query": "test"})],
        ),
        (  # two thoughts, joined
            "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
            "<|end|><|start|>assistant<|channel|>final<|message|>Done.",
            "First.\nSecond.",
            "Done.",
            [],
        ),
        (  # a header-less first message (gpt-oss under disaggregated prefill), then the answer
            "<|message|>We just give a haiku.<|end|><|start|>assistant<|channel|>final<|message|>Wind whispers",
            None,
            "We just give a haiku.\nWind whispers",
            [],
        ),
        ("Plain text, no harmony.", None, "Plain text, no harmony.", []),
        (  # cut off inside the reasoning (max_tokens)
            "<|channel|>analysis<|message|>Still thinking",
            "Still thinking",
            None,
            [],
        ),
        (  # cut off inside a header: dropped
            "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>fin",
            "Hmm.",
            None,
            [],
        ),
        (  # a built-in tool's call (not one of the request's functions) is not content
            '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
            None,
            None,
            [],
        ),
    ],
)
def test_outputs(text, reasoning, content, calls):
    assert both(text) == (reasoning, content, calls)


def test_calls_without_the_reasoning_parser():
    """`--tool-call-parser openai` alone: the analysis is content, the calls are calls."""
    content, calls = OPENAI.parse(ANALYSIS + CALL)
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == (THOUGHT, [TOKYO])


def test_reasoning_without_tools_passes_calls_on_as_written():
    """Without tools a call stays in the content, in its own spelling (as Hermes's `<tool_call>` does)."""
    assert HARMONY.split(ANALYSIS + CALL) == (THOUGHT, CALL)


# ---------------------------------------------------------------------------------------------------
# Streaming equals parsing


def stream_reasoning(text: str, cuts: list[int]) -> tuple[str, str]:
    return feed_reasoning(HARMONY.stream_parser(), text, cuts)


def stream_calls(text: str, cuts: list[int]):
    return feed_calls(OPENAI.stream_parser(), text, cuts)


def want(text: str):
    reasoning, content = HARMONY.split(text)
    calls_content, calls = OPENAI.parse(text)
    return (reasoning or "", content), (calls_content or "", [(c.name, c.arguments) for c in calls])


EXAMPLES = [
    ANALYSIS + CALL,
    ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
    ' to=functions.f<|channel|>commentary json<|message|> {"a": [1, "<|"]} \n',
    "<|channel|>commentary<|message|>Pre.<|end|><|start|>assistant<|channel|>commentary to=functions.g"
    ' <|constrain|>json<|message|>{"b":\n 2}<|call|><|start|>assistant<|channel|>final<|message|>x',
    "Hi <|start|>assistant<|channel|>analysis<|message|>a<|end|> tail <|ret",
    " t",
    "<|message|>x<|end|><|channel|>final<|message|>y<|channel|>analysis<|message|>z",
]


@pytest.mark.parametrize("text", EXAMPLES)
def test_stream_equals_parse_for_every_split(text):
    reasoning, calls = want(text)
    for cuts in every_split(text, draws=100):
        assert stream_reasoning(text, cuts) == reasoning, cuts
        assert stream_calls(text, cuts) == calls, cuts


PIECES = [
    "<|channel|>",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=browser.x",
    "to=",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|start|>",
    "assistant",
    " json",
    "<|constrain|>",
    '{"a": 1}',
    " ",
    "\n",
    "hi",
    "<|",
]


def test_stream_equals_parse_on_random_outputs():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        reasoning, calls = want(text)
        for _ in range(4):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, min(20, len(text) + 1)))
            assert stream_reasoning(text, cuts) == reasoning, (text, cuts)
            assert stream_calls(text, cuts) == calls, (text, cuts)


def test_stream_is_incremental():
    """Reasoning streams as it is written; a call is announced once its header is complete."""
    parser = HARMONY.stream_parser()
    assert parser.feed("<|channel|>analysis<|mess") == ("", "")
    assert parser.feed("age|>The user") == ("The user", "")
    assert parser.feed(" asks.<|en") == (" asks.", "")
    assert parser.feed("d|><|start|>assistant<|channel|>final<|message|>Sun") == ("", "Sun")
    calls = OPENAI.stream_parser()
    assert calls.feed("<|channel|>commentary to=functions.get_weather <|constrain|>js") == []
    events = calls.feed('on<|message|>{"location"')
    assert collect(events) == ("", [("get_weather", '{"location"')])


# ---------------------------------------------------------------------------------------------------
# Grammar, names

SCHEMA = {  # no free strings: the tiny tokenizer's odd byte tokens would make them unreadable, not invalid
    "type": "object",
    "properties": {"city": {"enum": ["Tokyo", "Paris"]}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = validate_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
    ]
)
HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def test_grammar():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tag = OPENAI.structural_tag(TOOLS, "required", True)
    xgr.StructuralTag.from_json(tag)
    grammar = xgr.Grammar.from_structural_tag(tag)
    assert _is_grammar_accept_string(grammar, HEADER + '{"city": "Tokyo", "days": 2}')
    assert _is_grammar_accept_string(grammar, HEADER.replace("get_weather", "add") + "{}")
    assert not _is_grammar_accept_string(grammar, HEADER + '{"city": "Oslo"}')  # not in the enum
    assert not _is_grammar_accept_string(grammar, HEADER + '{"days": 2}')  # required
    assert not _is_grammar_accept_string(grammar, HEADER.replace("get_weather", "nope") + "{}")
    assert not _is_grammar_accept_string(grammar, "Sure. " + HEADER + '{"city": "Tokyo"}')
    assert not _is_grammar_accept_string(grammar, HEADER + '{"city": "Tokyo"}' + HEADER + '{"city": "Tokyo"}')
    assert (
        OPENAI.structural_tag(TOOLS, "auto", True) is None
    )  # only parsed: harmony's headers are special tokens


def test_names_and_flags():
    assert reasoning_format("openai_gptoss") is reasoning_format("gpt_oss") is HARMONY
    assert HARMONY.keeps_special_tokens and OPENAI.keeps_special_tokens and not OPENAI.grammar_after_reasoning
    assert tool_format("openai") is OPENAI
    assert set(REASONING_FORMATS) >= {"openai_gptoss", "gpt_oss", "deepseek_r1", "qwen3", "granite", "think"}


def test_forced_calls_validate(tiny_model_dir):
    """The tiny random model sampled freely under a forced call: every finished output is one call whose
    arguments validate against its tool's schema."""
    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams
    from motet.grammar.specs import StructuralTagSpec

    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, speculative="off")
    spec = StructuralTagSpec(OPENAI.structural_tag(TOOLS, "required", False))
    params = [
        SamplingParams(temperature=1.0, max_tokens=200, seed=s, grammar=spec)  # held from the first token
        for s in range(8)
    ]
    outs = llm.generate([llm.tokenizer.encode("x")] * len(params), params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2
    schemas = {t.name: t.parameters for t in TOOLS}
    for out in finished:
        reasoning, content, calls = both(out.text)
        assert reasoning is None and content is None and len(calls) == 1
        jsonschema.validate(calls[0][1], schemas[calls[0][0]])
