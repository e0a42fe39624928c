"""Tool-call formats beside Hermes (motet/grammar/tool_formats/): Mistral's `[TOOL_CALLS]`, Llama 3.x's JSON,
pythonic, Phi-4-mini's `functools[...]`, Granite's `<|tool_call|>[...]` (GPT-OSS's harmony: tests/grammar/test_harmony.py). Outputs as the models write them (vLLM's parser tests, the model cards) parse into the expected calls;
the streamed parser equals the whole one for every split; each grammar accepts well-formed calls and refuses
malformed ones; the served format is picked from --tool-call-parser or the chat template."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from motet.grammar.tool_call_parser import ContentDelta, ToolCallArguments, ToolCallStart
from motet.grammar.tool_calls import validate_tools
from motet.grammar.tool_formats import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    OPENAI,
    PHI4_MINI,
    PYTHONIC,
    TOOL_FORMATS,
    tool_format,
)
from motet.grammar.tool_prompt import render_messages
from tests.grammar.streaming import every_split, feed_calls
from tests.grammar.test_tool_calls import tool_call_turns

MODEL_DIR = Path(os.path.expanduser("~/.cache/motet/models/SmolLM2-135M-Instruct"))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["location"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


def calls_of(fmt, text):
    content, calls = fmt.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}

# ---------------------------------------------------------------------------------------------------
# Outputs as the models write them


MISTRAL_OUTPUTS = [  # vLLM's tests/tool_use/test_mistral_tool_parser.py
    ("This is a test", "This is a test", []),
    (
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
        None,
        [("add", {"a": 3.5, "b": 4})],
    ),
    (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", '
        '"unit": "celsius"}}]',
        None,
        [("get_current_weather", SF)],
    ),
    (
        '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
        '"name": "get_current_weather"}]',
        None,
        [("get_current_weather", SF)],
    ),
    (
        '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
        None,
        [("get_age", {"name": "John Doe"})],
    ),
    (
        '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
        None,
        [("add", {"a": 3, "b": 4})],
    ),
    (  # the second object's closing brace missing, as in vLLM's streaming test
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
        '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}]',
        None,
        [("add", {"a": 3.5, "b": 4}), ("get_current_weather", SF)],
    ),
    # the v11 tokenizer's form (Mistral Small 3.2): name then arguments, one call per marker
    ('[TOOL_CALLS]add{"a": 3.5, "b": 4}', None, [("add", {"a": 3.5, "b": 4})]),
    (
        '[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
        None,
        [("get_current_weather", SF)],
    ),
    (
        '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}',
        None,
        [("add", {"a": 1}), ("add", {"a": 2})],
    ),
    # Mistral v0.3's chat template writes an id into each call; the id is not an argument
    (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}]',
        None,
        [("add", {"a": 1})],
    ),
    ('Let me add. [TOOL_CALLS][{"name": "add", "arguments": {}}]', "Let me add.", [("add", {})]),
    ("[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", []),
    # the special token dropped by the detokenizer (skip_special_tokens): the list alone
    ('[{"name": "add", "arguments": {"a": 1}}]', None, [("add", {"a": 1})]),
    ('Let me add. [{"name": "add", "arguments": {}}]', "Let me add.", [("add", {})]),
    ('  [ {"arguments": {}, "name": "add"}]', None, [("add", {})]),
    ("[1] is a citation", "[1] is a citation", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
]


LLAMA3_JSON_OUTPUTS = [  # vLLM's tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
    (
        '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
        None,
        [("searchTool", {"query": "test query", "limit": 10})],
    ),
    (
        "This is just some text without any tool calls",
        "This is just some text without any tool calls",
        [],
    ),
    ('{"name": "searchTool", "arguments": {"query": "test"}}', None, [("searchTool", {"query": "test"})]),
    *(  # three calls, separated with and without spaces around the semicolon
        (
            separator.join(
                [
                    '{"name": "searchTool", "parameters": {"query": "test1"}}',
                    '{"name": "getOpenIncidentsTool", "parameters": {}}',
                    '{"name": "searchTool", "parameters": {"query": "test2"}}',
                ]
            ),
            None,
            [
                ("searchTool", {"query": "test1"}),
                ("getOpenIncidentsTool", {}),
                ("searchTool", {"query": "test2"}),
            ],
        )
        for separator in ("; ", " ; ")
    ),
    (  # vLLM drops the text around the calls; motet keeps it as content, as Hermes does
        'Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
        "Here are the results:  Would you like to know more?",
        [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})],
    ),
    (
        '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
        None,
        [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})],
    ),
    (
        '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": '
        '"more {brackets}"}}}',
        None,
        [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})],
    ),
    (
        '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
        None,
        [("parserTool", {"text": 'He said "Hello {world}"'})],
    ),
    # Llama 3.1's model card: built-in and custom tools after <|python_tag|>
    (
        '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ('{"parameters": {"a": 1}, "name": "f"}', None, [("f", {"a": 1})]),
    ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
]


PYTHONIC_OUTPUTS = [  # vLLM's tests/entrypoints/openai/tool_parsers/test_pythonic_tool_parser.py
    (
        "[get_weather(city='San Francisco', metric='celsius')]",
        None,
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})],
    ),
    (
        "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
        "role=None, passed_test=True, aliases=['John', 'Johnny'])]",
        None,
        [
            (
                "register_user",
                {
                    "name": "John Doe",
                    "age": 37,
                    "address": {"city": "San Francisco", "state": "CA"},
                    "role": None,
                    "passed_test": True,
                    "aliases": ["John", "Johnny"],
                },
            )
        ],
    ),
    ("[do_something_cool()]", None, [("do_something_cool", {})]),
    (
        "[get_weather(city='Martha\\'s Vineyard', metric='\"cool units\"')]",
        None,
        [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})],
    ),
    (
        "[get_weather(city='LA', metric='C'), register_user(name='Doe', age=9)]",
        None,
        [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})],
    ),
    # Llama 4 wraps them
    ("<|python_start|>[get_weather(city='LA')]<|python_end|>", None, [("get_weather", {"city": "LA"})]),
    ("[1] is a citation", "[1] is a citation", []),
    ("Sure: [f(a=1)]", "Sure: [f(a=1)]", []),  # not at the start: text
    ("[f(1)]", "[f(1)]", []),  # positional arguments have no names
]


TOKYO = ("get_weather", {"city": "Tokyo"})
VARIOUS = {
    "string_field": "hello",
    "int_field": 42,
    "float_field": 3.14,
    "bool_field": True,
    "null_field": None,
    "array_field": ["a", "b", "c"],
    "object_field": {"nested": "value"},
    "empty_array": [],
    "empty_object": {},
}
VARIOUS_TEXT = json.dumps({"name": "test_function", "arguments": VARIOUS}, indent=2)
NO_CALLS = "This is a regular response without any tool calls."


def json_list_outputs(opening: str) -> list:
    """The cases vLLM's Phi-4-mini and Granite parser tests share: a JSON list of calls opened by `opening`."""
    return [
        (NO_CALLS, NO_CALLS, []),
        (opening + '{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', None, [TOKYO]),
        (
            opening + '\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n'
            '  {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n]',
            None,
            [TOKYO, ("get_time", {"timezone": "Asia/Tokyo"})],
        ),
        (opening + '{"name": "refresh", "arguments": {}}]', None, [("refresh", {})]),
    ]


PHI4_MINI_OUTPUTS = [  # vLLM's tests/tool_parsers/test_phi4mini_tool_parser.py
    *json_list_outputs("functools["),
    (f"functools[{VARIOUS_TEXT}]", None, [("test_function", VARIOUS)]),
    # vLLM drops the text around the calls; motet keeps it as content, as for the other formats
    (
        'Let me check the weather for you.\nfunctools[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]',
        "Let me check the weather for you.",
        [TOKYO],
    ),
    ("Use functools.partial here.", "Use functools.partial here.", []),
    ('functools[{"name": "func"}]', 'functools[{"name": "func"}]', []),
]


GRANITE_OUTPUTS = [  # vLLM's tests/tool_parsers/test_granite_tool_parser.py
    *json_list_outputs("<|tool_call|> ["),
    (f"<tool_call> [{VARIOUS_TEXT}]", None, [("test_function", VARIOUS)]),  # Granite 3.1's string
    (  # Granite's streaming test: arguments before the name
        '<|tool_call|> [{"arguments": {"city": "Tokyo"}, "name": "get_weather"}, '
        '{"arguments": {"timezone": "Asia/Tokyo"}, "name": "get_time"}]',
        None,
        [TOKYO, ("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    (
        'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": '
        '{"city": "Tokyo"}}]\nI\'ll get that information.',
        "Let me check the weather for you.\n\nI'll get that information.",
        [TOKYO],
    ),
    # Granite 3.3's model card: the special token dropped from the text (skip_special_tokens), the list alone
    (
        '[{"name": "get_current_weather", "arguments": {"city": "Boston"}}]',
        None,
        [("get_current_weather", {"city": "Boston"})],
    ),
    # vLLM's malformed inputs: no calls
    (
        '<|tool_call|> {"name": "func", "arguments": {}}',
        '<|tool_call|> {"name": "func", "arguments": {}}',
        [],
    ),
    (
        '[{"name": "func", "arguments": "not a dict"}]',
        '[{"name": "func", "arguments": "not a dict"}]',
        [],
    ),
    ('Some text [{"name": "func"}]', 'Some text [{"name": "func"}]', []),
    ('<tool_call>\n{"name": "f"}', '<tool_call>\n{"name": "f"}', []),  # Hermes' shape: not Granite 3's
]

OUTPUTS = {  # outputs as the models write them: each parses into the expected (content, calls)
    MISTRAL: MISTRAL_OUTPUTS,
    LLAMA3_JSON: LLAMA3_JSON_OUTPUTS,
    PYTHONIC: PYTHONIC_OUTPUTS,
    PHI4_MINI: PHI4_MINI_OUTPUTS,
    GRANITE: GRANITE_OUTPUTS,
}


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        pytest.param(f, *case, id=f"{f.name}-{i}")
        for f, cases in OUTPUTS.items()
        for i, case in enumerate(cases)
    ],
)
def test_outputs(fmt, text, content, calls):
    assert calls_of(fmt, text) == (content, calls)


def test_truncated_arguments_are_kept_as_written():
    """As Hermes: a call cut off by max_tokens keeps the arguments written so far (OpenAI does the same)."""
    content, calls = MISTRAL.parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": [1, ')
    assert (content, [(c.name, c.arguments) for c in calls]) == (None, [("add", '{"a": [1,')])
    content, calls = LLAMA3_JSON.parse('{"name": "f", "parameters": {"q": "ab ')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"q": "ab')]
    content, calls = PHI4_MINI.parse('functools[{"name": "func", "arguments": {')  # vLLM's malformed input
    assert (content, [(c.name, c.arguments) for c in calls]) == (None, [("func", "{")])


# ---------------------------------------------------------------------------------------------------
# Streaming equals parsing


def stream(fmt, text, cuts):
    return feed_calls(fmt.stream_parser(), text, cuts)


def expected(fmt, text):
    content, calls = fmt.parse(text)
    return content or "", [(c.name, c.arguments) for c in calls]


EXAMPLES = {
    MISTRAL: [
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
        'Sure. [TOOL_CALLS] [{"arguments":{"name": "J}"}, "name": "get_age"}, {"name": "f", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "g", "arguments":{"c": "S"}]',
        '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul{"b": [2, {"c": 3}]} done',
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, ',
        "[TOOL_CALLS] hmm [TOOL_CALLS][] x [TOOL_",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, 42] tail',
        '[TOOL_CALLS]{"name": "f", "arguments": {"s": "]}"}}',
        "just text \u00e9 ",
        ' [{"arguments": {"a": 1}, "name": "f"}] and [{"name": "g", "arguments": {"b": "]"}}]',
        "[1] [ [{",
    ],
    LLAMA3_JSON: [
        ' {"name": "searchTool", "parameters": {"query": "t}1"}} ; {"name": "g", "parameters": {}}',
        'Here: {"name": "f", "parameters": {"a": 1}}; tail',
        '<|python_tag|>{"arguments": {"a": 1}, "name": "f"}; {"name": "g", "parameters": {"b": "x"}} ok',
        '{"a": 1} then {"name": "f", "parameters": {}} and {"name": "g"}',
        '<|python_tag|>code() {"name',
        '{"name": "f", "parameters": {"q": "ab ',
        "no calls { here }",
    ],
    PYTHONIC: [
        "[get_weather(city='San Francisco', metric='celsius'), f(x=[1, (2, 3)])]",
        "  <|python_start|>[f(a='x]')]<|python_end|> then text",
        "[1] is a citation [f(a=1)]",
        "[f(a=1)",
        "text <|python_start|>[g()] <|python_",
    ],
    PHI4_MINI: [
        'functools[{"name": "get_weather", "arguments": {"city": "Tok]yo"}}, {"arguments": {}, "name": "g"}]',
        'Sure. functools[{"name": "f", "arguments": {"a": [1, ',
        "functools.partial and functools[] and functools[1]",
        'text functools[{"name": "f", "arguments": {}}] more functools',
    ],
    GRANITE: [
        '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}, {"name": "g", "arguments": {}}]',
        ' [{"arguments": {"x": "]"}, "name": "f"}] after',
        'Hi <tool_call>[{"name": "f", "arguments": {"a": 1}}] <|tool_ca',
        '<|tool_call|>{"name": "f", "arguments": {}} [{"name": "g", "arguments": {}}]',
    ],
}


@pytest.mark.parametrize("fmt, text", [(f, t) for f, texts in EXAMPLES.items() for t in texts])
def test_stream_equals_parse_for_every_split(fmt, text):
    want = expected(fmt, text)
    for cuts in every_split(text, draws=100):
        assert stream(fmt, text, cuts) == want, cuts


PIECES = {
    MISTRAL: [
        "[TOOL_CALLS]",
        "[TOOL_",
        "[",
        "]",
        " ",
        "ok",
        '{"name": "f", "arguments": {"a": "}"}}',
        ", ",
        "add",
        "[ARGS]",
        '{"b": 1}',
        '{"arguments": {}, "name": "h"}',
        '[TOOL_CALLS][{"name": "g", "arguments": {"x": [1]}}',
        '[TOOL_CALLS]f{"y": "}"}',
    ],
    LLAMA3_JSON: [
        "<|python_tag|>",
        '{"name": "',
        "f",
        '", "parameters": ',
        '{"a": [1]}',
        "}",
        ";",
        " ",
        "hi",
        "{",
        '{"name": "g", "arguments": {}}',
    ],
    PYTHONIC: [
        "[",
        "]",
        "f(",
        "a=1",
        ")",
        ", ",
        "'x'",
        "<|python_start|>",
        "<|python_end|>",
        "hey",
        " ",
        "[f(a=1)]",
        "[g(b='x]'), h()]",
        "<|python_start|>[f()]",
    ],
    PHI4_MINI: [
        "functools[",
        "functools",
        "[",
        "]",
        ", ",
        " ",
        "ok",
        '{"name": "f", "arguments": {"a": "]"}}',
        "{",
    ],
    GRANITE: [
        "<|tool_call|>",
        "<tool_call>",
        "<|tool_",
        "[",
        "]",
        ", ",
        " ",
        "hi",
        '{"name": "f", "arguments": {"a": "]"}}',
        '{"arguments": {}, "name": "h"}',
    ],
}


@pytest.mark.parametrize("fmt", list(PIECES))
def test_stream_equals_parse_on_random_outputs(fmt):
    rng = random.Random(fmt.name)
    for _ in range(300):
        text = "".join(rng.choice(PIECES[fmt]) for _ in range(rng.randint(1, 10)))
        want = expected(fmt, text)
        for _ in range(4):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, min(20, len(text) + 1)))
            assert stream(fmt, text, cuts) == want, (text, cuts)


def test_stream_is_incremental():
    """A call is announced once its name is known and its arguments stream as they come."""
    parser = MISTRAL.stream_parser()
    assert parser.feed("Checking. [TOOL_") == [ContentDelta("Checking.")]
    assert parser.feed('CALLS][{"name": "get_weather", "arguments": ') == []
    assert parser.feed('{"location": "Par') == [
        ToolCallStart(0, "get_weather"),
        ToolCallArguments(0, '{"location": "Par'),
    ]
    assert parser.feed('is"}') == [ToolCallArguments(0, 'is"}')]
    assert parser.feed('}, {"name": "add", "arguments": {"a": 1') == [
        ToolCallStart(1, "add"),
        ToolCallArguments(1, '{"a": 1'),
    ]
    assert parser.feed("}}]") == [ToolCallArguments(1, "}")]
    assert parser.finish() == []
    parser = LLAMA3_JSON.stream_parser()
    assert parser.feed('{"name": "f", "parameters": {"q": 1') == [
        ToolCallStart(0, "f"),
        ToolCallArguments(0, '{"q": 1'),
    ]


# ---------------------------------------------------------------------------------------------------
# Grammars


@pytest.fixture(scope="module")
def accepts():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tools = validate_tools([WEATHER, ADD])

    def accepts(fmt, mode, parallel, text, only=None, max_calls=None):
        tag = fmt.structural_tag(only or tools, mode, parallel, max_calls=max_calls)
        xgr.StructuralTag.from_json(tag)  # its pydantic check
        return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), text)

    return accepts


MW = '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "c"}}'
MA = '{"name": "add", "arguments": {"a": 1, "b": 2.5}}'


def test_mistral_grammar(accepts):
    one, two = f"[TOOL_CALLS][{MW}]", f"[TOOL_CALLS][{MW}, {MA}]"
    for parallel in (False, True):
        assert accepts(MISTRAL, "required", parallel, one)
        assert not accepts(MISTRAL, "required", parallel, "")
        assert not accepts(MISTRAL, "required", parallel, "Sure. " + one)
        assert not accepts(MISTRAL, "required", parallel, one.replace("get_weather", "get_time"))
        assert not accepts(MISTRAL, "required", parallel, one.replace('"c"', '"k"'))  # not in the enum
        assert not accepts(
            MISTRAL, "required", parallel, one.replace('"location": "Paris", ', "")
        )  # required
        assert not accepts(MISTRAL, "required", parallel, one[:-1])  # unclosed list
        assert not accepts(MISTRAL, "required", parallel, one.replace("[TOOL_CALLS]", ""))
        assert accepts(MISTRAL, "auto", parallel, "Just text.")
        assert accepts(MISTRAL, "auto", parallel, "Let me see. " + one)
        assert not accepts(MISTRAL, "auto", parallel, "Let me see. [TOOL_CALLS][{not json}]")
        assert not accepts(MISTRAL, "auto", parallel, one + " more")  # the calls end the output
    assert accepts(MISTRAL, "required", True, two) and not accepts(MISTRAL, "required", False, two)
    assert accepts(MISTRAL, "auto", True, "x " + two)
    assert not accepts(MISTRAL, "required", True, f"[TOOL_CALLS][{MW}, {MA}, {MW}]", max_calls=2)
    assert accepts(MISTRAL, "required", True, two, max_calls=2)
    only = validate_tools([ADD])  # a named function
    assert accepts(MISTRAL, "required", False, f"[TOOL_CALLS][{MA}]", only=only)
    assert not accepts(MISTRAL, "required", False, one, only=only)


LW = '{"name": "get_weather", "parameters": {"location": "Paris"}}'
LA = '{"name": "add", "parameters": {"a": 1}}'


def test_llama3_json_grammar(accepts):
    for parallel in (False, True):
        assert accepts(LLAMA3_JSON, "required", parallel, LW)
        assert not accepts(LLAMA3_JSON, "required", parallel, "I will call. " + LW)
        assert not accepts(LLAMA3_JSON, "required", parallel, LW.replace("parameters", "arguments"))
        assert not accepts(LLAMA3_JSON, "required", parallel, LW.replace('"Paris"', "7"))
        assert not accepts(LLAMA3_JSON, "required", parallel, LW[:-1])
        assert accepts(LLAMA3_JSON, "auto", parallel, "Plain answer.")
        assert accepts(LLAMA3_JSON, "auto", parallel, LA)
        assert not accepts(LLAMA3_JSON, "auto", parallel, '{"name": "nope", "parameters": {}}')
    assert accepts(LLAMA3_JSON, "required", True, f"{LW}; {LA}")
    assert not accepts(LLAMA3_JSON, "required", False, f"{LW}; {LA}")
    assert not accepts(LLAMA3_JSON, "required", True, f"{LW}; {LA}; {LA}", max_calls=2)
    assert PYTHONIC.structural_tag(validate_tools([ADD]), "required", True) is None  # parsed only


@pytest.mark.parametrize("fmt, opening", [(PHI4_MINI, "functools["), (GRANITE, "<|tool_call|>[")])
def test_marker_list_grammars(accepts, fmt, opening):
    one, two = f"{opening}{MW}]", f"{opening}{MW}, {MA}]"
    for parallel in (False, True):
        assert accepts(fmt, "required", parallel, one)
        assert not accepts(fmt, "required", parallel, "Sure. " + one)
        assert not accepts(fmt, "required", parallel, one.replace('"c"', '"k"'))  # not in the enum
        assert not accepts(fmt, "required", parallel, one.replace(opening, "["))
        assert not accepts(fmt, "required", parallel, one[:-1])
        assert accepts(fmt, "auto", parallel, "Just text.")
        assert accepts(fmt, "auto", parallel, "Let me see. " + one)
        assert not accepts(fmt, "auto", parallel, f"Let me see. {opening}{{not json}}]")
        assert not accepts(fmt, "auto", parallel, one + " more")
    assert accepts(fmt, "required", True, two) and not accepts(fmt, "required", False, two)
    assert not accepts(fmt, "required", True, f"{opening}{MW}, {MA}, {MW}]", max_calls=2)


@pytest.mark.parametrize("fmt", [MISTRAL, LLAMA3_JSON, PHI4_MINI, GRANITE])
def test_grammar_with_tokenizer(fmt):
    """Compiled against the default model's vocabulary: the tokens of calls written by `calls_text` are accepted
    to the end and parse back; text where a call must be is refused."""
    if not MODEL_DIR.exists():
        pytest.skip("SmolLM2 tokenizer not in the local cache")
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tools = validate_tools([WEATHER, ADD])
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer), cache_enabled=False)
    compiled = compiler.compile_structural_tag(json.dumps(fmt.structural_tag(tools, "required", True)))
    calls = [("get_weather", {"location": "Oslo"}), ("add", {"a": 4})]
    text = fmt.calls_text(calls)
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    assert calls_of(fmt, text) == (None, [("get_weather", {"location": "Oslo"}), ("add", {"a": 4})])
    bad = xgr.GrammarMatcher(compiled)
    assert not all(bad.accept_token(t) for t in tokenizer.encode("Hello", add_special_tokens=False))


# ---------------------------------------------------------------------------------------------------
# Prompts and selection


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3_JSON, PYTHONIC, PHI4_MINI, GRANITE, OPENAI])
def test_calls_text_parses_back(fmt):
    calls = [("get_weather", {"location": 'Martha\'s "Vineyard"', "n": [1, 2.5, None, True]}), ("add", {})]
    assert calls_of(fmt, fmt.calls_text(calls)) == (None, calls)


def test_render_history_in_each_format():
    history = [{"role": "user", "content": "Weather in Paris?"}]
    history += tool_call_turns("c1", "get_weather", '{"location": "Paris"}', "Sunny.")
    tools = validate_tools([WEATHER])
    assert render_messages(history, tools, "tool", HERMES) == render_messages(history, tools)  # unchanged
    mistral = render_messages(history, tools, "tool", MISTRAL)
    assert mistral[2] == {
        "role": "assistant",
        "content": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}}]',
    }
    assert "[TOOL_CALLS]" in mistral[0]["content"] and '"get_weather"' in mistral[0]["content"]
    llama = render_messages(history, tools, "tool", LLAMA3_JSON)
    assert llama[2]["content"] == '{"name": "get_weather", "parameters": {"location": "Paris"}}'
    assert (
        render_messages(history, tools, "tool", PYTHONIC)[2]["content"] == "[get_weather(location='Paris')]"
    )


def test_format_selection():
    assert {name: fmt.name for name, fmt in TOOL_FORMATS.items()} == {
        "hermes": "hermes",
        "mistral": "mistral",
        "llama3_json": "llama3_json",
        "llama4_json": "llama3_json",
        "pythonic": "pythonic",
        "llama4_pythonic": "pythonic",
        "phi4_mini_json": "phi4_mini_json",
        "granite": "granite",
        "openai": "openai",
    }
    assert tool_format("mistral", "{{ '<tool_call>' }}") is MISTRAL  # the flag wins
    assert tool_format(None, None) is HERMES
    assert tool_format(None, "{%- if tools %}<tool_call>{% endif %}") is HERMES
    assert tool_format(None, "{{- '[TOOL_CALLS] [' }}") is MISTRAL
    assert tool_format(None, "{{- '<|python_tag|>' + tool_call.name }}") is LLAMA3_JSON
    # the templates' own words (gpt-oss's, Phi-4-mini-instruct's, vLLM's phi4 example, Granite 3.3's)
    assert tool_format(None, "{{- '<|start|>assistant to=' }}...{{- '<|channel|>commentary ' }}") is OPENAI
    assert (
        tool_format(
            None,
            "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}",
        )
        is PHI4_MINI
    )
    assert tool_format(None, "prefix function calls with functools marker") is PHI4_MINI
    assert (
        tool_format(None, "respond only with <|tool_call|> followed by a JSON list of tools used") is GRANITE
    )
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_format("xlam", None)
