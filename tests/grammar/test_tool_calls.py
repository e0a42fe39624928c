"""Hermes tool calling: validation, prompt rendering, the xgrammar structural tag, parsing and the
streaming parser (whose events must add up to `parse_tool_calls` for every split of an output)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from motet.grammar.tool_call_parser import (
    ContentDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
)
from motet.grammar.tool_calls import (
    Tool,
    ToolError,
    resolve_tool_choice,
    tool_call_structural_tag,
    validate_tools,
)
from motet.grammar.tool_prompt import format_call, render_messages, template_supports_tools
from tests.dev_sets import dev_set, read_jsonl
from tests.grammar.streaming import every_split, feed_calls

MODEL_DIR = Path(os.path.expanduser("~/.cache/motet/models/SmolLM2-135M-Instruct"))
BFCL, _ = dev_set("bfcl")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["location"],
        },
    },
}
SUM = {  # BFCL style: bare function dict, Python type names
    "name": "math.sum",
    "description": "Add numbers.",
    "parameters": {
        "type": "dict",
        "properties": {"numbers": {"type": "array", "items": {"type": "float"}}},
        "required": ["numbers"],
    },
}


def error(tools) -> ToolError:
    with pytest.raises(ToolError) as e:
        validate_tools(tools)
    return e.value


# ---------------------------------------------------------------------------------------------------
# validate_tools


def test_validate_openai_and_bfcl_shapes():
    weather, total = validate_tools([WEATHER, SUM])
    assert weather == Tool("get_weather", "Current weather.", WEATHER["function"]["parameters"])
    assert total.name == "math.sum"
    assert total.parameters == {
        "type": "object",
        "properties": {"numbers": {"type": "array", "items": {"type": "number"}}},
        "required": ["numbers"],
    }


def test_validate_defaults():
    (tool,) = validate_tools([{"type": "function", "function": {"name": "now"}}])
    assert tool == Tool("now", "", {"type": "object", "properties": {}})
    (tool,) = validate_tools([{"name": "f", "parameters": {"properties": {"a": {"type": "int"}}}}])
    assert tool.parameters == {"type": "object", "properties": {"a": {"type": "integer"}}}
    flat = {"type": "function", "name": "f", "parameters": {"type": "object"}}  # Responses API shape
    assert validate_tools([flat]) == [Tool("f", "", {"type": "object"})]
    names = ["a", "A-b_c.d", "x" * 64, "9"]
    assert [t.name for t in validate_tools([{"name": n} for n in names])] == names


@pytest.mark.parametrize(
    "tools, param, words",
    [
        (None, "tools", "non-empty list"),
        ([], "tools", "non-empty list"),
        ({"name": "f"}, "tools", "non-empty list"),
        ([WEATHER, "f"], "tools[1]", "got str"),
        ([{"type": "retrieval"}], "tools[0].type", "'retrieval'"),
        ([{}], "tools[0].function", "expected an object"),
        ([{"type": "function"}], "tools[0].function", "expected an object"),
        ([{"type": "function", "function": "f"}], "tools[0].function", "expected an object"),
        ([{"type": "function", "function": {}}], "tools[0].function.name", "got None"),
        ([{"name": "a b"}], "tools[0].name", "'a b'"),
        ([{"name": ""}], "tools[0].name", "1 to 64"),
        ([{"name": "f\n"}], "tools[0].name", "1 to 64"),
        ([{"name": "x" * 65}], "tools[0].name", "1 to 64"),
        ([{"name": 3}], "tools[0].name", "got 3"),
        ([{"name": "f", "description": 3}], "tools[0].description", "string"),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            "tools[0].function.strict",
            "boolean",
        ),
        ([{"name": "f", "parameters": "{}"}], "tools[0].parameters", "got str"),
        ([{"name": "f", "parameters": {"type": "string"}}], "tools[0].parameters", "'object', got 'string'"),
        ([{"name": "f", "parameters": {"type": "array"}}], "tools[0].parameters", "top-level type"),
    ],
)
def test_validate_errors(tools, param, words):
    e = error(tools)
    assert e.param == param
    assert words in str(e)
    assert str(e).startswith(f"Invalid '{param}': ")


def test_validate_duplicate_names():
    e = error([WEATHER, {"name": "math.sum"}, {"type": "function", "function": {"name": "get_weather"}}])
    assert e.param == "tools[2].function.name"
    assert "duplicate tool name 'get_weather' (also tools[0])" in str(e)


def test_validate_meta_schema_errors_name_the_path():
    bad_type = {"type": "object", "properties": {"a": {"type": "strnig"}}}
    e = error([WEATHER, {"type": "function", "function": {"name": "f", "parameters": bad_type}}])
    assert e.param == "tools[1].function.parameters"
    assert "properties/a/type" in str(e) and "strnig" in str(e)
    e = error([{"name": "f", "parameters": {"type": "object", "required": "a"}}])
    assert e.param == "tools[0].parameters"
    assert "at required" in str(e)


def test_validate_bfcl_sample():
    import xgrammar as xgr

    count = 0
    for case in read_jsonl(BFCL)[:30]:
        functions = case["function"]
        tools = validate_tools(functions)
        wrapped = validate_tools([{"type": "function", "function": f} for f in functions])
        assert tools == wrapped
        for tool in tools:
            assert tool.parameters["type"] == "object"
            text = json.dumps(tool.parameters)
            assert '"type": "dict"' not in text and '"type": "float"' not in text
        count += len(tools)
        xgr.Grammar.from_structural_tag(tool_call_structural_tag(tools, "auto", True))  # xgrammar takes them
    assert count >= 30


# ---------------------------------------------------------------------------------------------------
# resolve_tool_choice


def test_resolve_tool_choice():
    tools = validate_tools([WEATHER, SUM])
    assert resolve_tool_choice(None, tools) == ("auto", tools)
    assert resolve_tool_choice("auto", tools) == ("auto", tools)
    assert resolve_tool_choice(None, []) == ("none", [])
    assert resolve_tool_choice("auto", []) == ("none", [])
    assert resolve_tool_choice("none", tools) == ("none", [])
    assert resolve_tool_choice("none", []) == ("none", [])
    assert resolve_tool_choice("required", tools) == ("required", tools)
    named = {"type": "function", "function": {"name": "math.sum"}}
    assert resolve_tool_choice(named, tools) == ("required", [tools[1]])


@pytest.mark.parametrize(
    "choice, tools, words",
    [
        ("required", [], "needs a non-empty 'tools'"),
        ({"type": "function", "function": {"name": "f"}}, [], "no 'tools'"),
        ({"type": "function", "function": {"name": "nope"}}, None, "'get_weather', 'math.sum'"),
        ({"type": "function", "function": {}}, None, '{"type": "function"'),
        ({"type": "tool", "function": {"name": "get_weather"}}, None, '{"type": "function"'),
        ({"function": {"name": "get_weather"}}, None, '{"type": "function"'),
        ("any", None, "'none', 'auto', 'required'"),
        (3, None, "got 3"),
    ],
)
def test_resolve_tool_choice_errors(choice, tools, words):
    tools = validate_tools([WEATHER, SUM]) if tools is None else tools
    with pytest.raises(ToolError) as e:
        resolve_tool_choice(choice, tools)
    assert e.value.param == "tool_choice"
    assert words in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Rendering


@pytest.fixture(scope="module")
def tokenizer():
    if not MODEL_DIR.exists():
        pytest.skip("SmolLM2 tokenizer not in the local cache")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def hermes_prompt(tool_lines: str) -> str:
    return (
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
        "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
        "about what values to plug into functions. Here are the available tools:\n<tools>\n"
        + tool_lines
        + "\n</tools>\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and 1+2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "math.sum", "arguments": '{"numbers": [1, 2]}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
    {"role": "assistant", "content": "18C; the sum is 3."},
    {"role": "user", "content": "And in Rome?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "oops"}}
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "c",
        "content": [{"type": "text", "text": "2"}, {"type": "text", "text": "0C"}],
    },
]


def test_render_history_chatml(tokenizer):
    tools = validate_tools([{"type": "function", "function": {"name": "now", "description": "Time."}}, SUM])
    text = tokenizer.apply_chat_template(
        render_messages(HISTORY, tools), tokenize=False, add_generation_prompt=True
    )
    tool_lines = (
        '{"type": "function", "function": {"name": "now", "description": "Time.", '
        '"parameters": {"type": "object", "properties": {}}}}\n'
        '{"type": "function", "function": {"name": "math.sum", "description": "Add numbers.", '
        '"parameters": {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "number"}}}, '
        '"required": ["numbers"]}}}'
    )
    expected = (
        "<|im_start|>system\nYou are terse.\n\n" + hermes_prompt(tool_lines) + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris, and 1+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "math.sum", "arguments": {"numbers": [1, 2]}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n"
        '{"name": "get_weather", "content": "18C"}\n</tool_response>\n<tool_response>\n'
        '{"name": "math.sum", "content": "3"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n18C; the sum is 3.<|im_end|>\n"
        "<|im_start|>user\nAnd in Rome?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": "oops"}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>tool\n<tool_response>\n{"name": "get_weather", "content": "20C"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert text == expected


def test_render_without_tools_keeps_template_default(tokenizer):
    messages = render_messages(HISTORY[1:5], [])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert (
        '<tool_response>\n{"name": "get_weather", "content": "18C"}\n</tool_response>\n'
        '<tool_response>\n{"name": "math.sum", "content": "3"}\n</tool_response>'
    ) in text


def test_render_inserts_system_and_round_trips():
    tools = validate_tools([WEATHER])
    messages = render_messages([{"role": "user", "content": "hi"}], tools)
    assert messages[0] == {"role": "system", "content": hermes_prompt(json.dumps(WEATHER))}
    assert messages[1] == {"role": "user", "content": "hi"}
    # An empty system message is replaced; the rendered calls parse back to what was sent.
    messages = render_messages([{"role": "system", "content": ""}, *HISTORY[1:3]], tools)
    assert messages[0]["content"] == hermes_prompt(json.dumps(WEATHER))
    content, calls = parse_tool_calls(messages[2]["content"])
    assert content is None
    assert calls == [
        ToolCall("get_weather", '{"location": "Paris"}'),
        ToolCall("math.sum", '{"numbers": [1, 2]}'),
    ]
    assert format_call("f", {"a": "é"}) == '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>'


def test_render_errors():
    with pytest.raises(ToolError) as e:
        render_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], [])
    assert e.value.param == "messages[0].content"
    with pytest.raises(ToolError) as e:
        render_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], [])
    assert e.value.param == "messages[0].tool_calls[0]"


def test_template_supports_tools(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)
    assert not template_supports_tools(None)
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


# ---------------------------------------------------------------------------------------------------
# Structural tag


@pytest.fixture(scope="module")
def accepts():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tools = validate_tools([WEATHER, SUM])

    def accepts(mode: str, parallel: bool, text: str, only=None, max_calls=None) -> bool:
        tag = tool_call_structural_tag(only or tools, mode, parallel, max_calls=max_calls)
        return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), text)

    return accepts


W = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "c"}}\n</tool_call>'
S = '<tool_call>\n{"name": "math.sum", "arguments": {"numbers": [1, 2.5]}}\n</tool_call>'


def test_structural_tag_required(accepts):
    for parallel in (False, True):
        assert accepts("required", parallel, W)
        assert accepts("required", parallel, S)
        assert accepts("required", parallel, W.replace(', "unit": "c"', ""))
        assert not accepts("required", parallel, "")
        assert not accepts("required", parallel, "Sure. " + W)
        assert not accepts("required", parallel, W + " done")
        assert not accepts("required", parallel, W.replace("get_weather", "get_time"))
        assert not accepts("required", parallel, W.replace('"c"', '"k"'))  # not in the enum
        assert not accepts("required", parallel, S.replace("2.5", '"2"'))  # wrong item type
        assert not accepts("required", parallel, W.replace('"location": "Paris", ', ""))  # required
        assert not accepts("required", parallel, W.replace('"c"}', '"c", "x": 1}'))  # no extras
        assert not accepts("required", parallel, W.replace('"Paris"', '     "Paris"'))  # bounded whitespace
        assert not accepts("required", parallel, W[:-3])
    assert not accepts("required", False, W + "\n" + S)
    assert accepts("required", True, W + "\n" + S)
    assert accepts("required", True, S + "\n" + S + "\n" + W)
    assert not accepts("required", True, W + S)
    assert not accepts("required", True, W + "\nand\n" + S)


def test_structural_tag_bounds_the_number_of_calls(accepts):
    for n in (1, 2, 3):
        assert accepts("required", True, "\n".join([W, S, W][:n]), max_calls=3)
    assert not accepts("required", True, "\n".join([W, S, W, S]), max_calls=3)
    assert not accepts("required", True, W + "\n", max_calls=3)
    assert not accepts("required", True, "", max_calls=3)
    assert accepts("required", True, W, max_calls=1) and not accepts(
        "required", True, W + "\n" + S, max_calls=1
    )
    assert accepts("auto", True, "text only", max_calls=2)
    assert accepts("auto", True, "a " + W + " b " + S, max_calls=2)
    assert not accepts("auto", True, W + "\n" + S + "\n" + W, max_calls=2)
    assert not accepts("auto", True, W + "\n" + S + " more text", max_calls=2)  # the last call ends it


def test_structural_tag_named(accepts):
    only = validate_tools([SUM])
    assert accepts("required", False, S, only=only)
    assert not accepts("required", False, W, only=only)


@pytest.mark.parametrize(
    "tool_choice, parallel_tool_calls, several",
    [
        ({"type": "function", "function": {"name": "get_weather"}}, None, False),  # OpenAI: exactly one call
        ({"type": "function", "function": {"name": "get_weather"}}, False, False),
        ({"type": "function", "function": {"name": "get_weather"}}, True, True),
        ("required", None, True),  # one or more (parallel_tool_calls defaults to true)
        ("required", False, False),
    ],
)
def test_a_requests_tool_choice_bounds_its_calls(accepts, tool_choice, parallel_tool_calls, several):
    """Issue 57: a named tool_choice repeated its call until max_tokens (two calls, finish_reason "length"): its
    grammar allowed several. A named function is one call of it, then the answer ends, unless the request sets
    parallel_tool_calls true; "required" is one or more unless parallel_tool_calls is false."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from motet.api.completions.protocol import ChatCompletionRequest
    from motet.grammar.structure import structured_output

    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )
    grammar = xgr.Grammar.from_structural_tag(structured_output(req).spec.tag)
    assert _is_grammar_accept_string(grammar, W)
    assert _is_grammar_accept_string(grammar, W + "\n" + W.replace("Paris", "Rome")) == several


def test_structural_tag_auto(accepts):
    for parallel in (False, True):
        assert accepts("auto", parallel, "")
        assert accepts("auto", parallel, "Just text, no call.")
        assert accepts("auto", parallel, W)
        assert accepts("auto", parallel, "Let me check.\n" + W)
        assert not accepts("auto", parallel, "Let me check.\n" + W.replace("get_weather", "nope"))
        assert not accepts("auto", parallel, "x <tool_call>\nnot json")
        assert not accepts("auto", parallel, W.replace('"Paris"', "Paris"))
    assert not accepts("auto", False, W + "\n" + S)
    assert not accepts("auto", False, W + " and more")
    assert accepts("auto", True, W + "\n" + S)
    assert accepts("auto", True, "a " + W + " b " + S + " c")


def test_structural_tag_shape_and_errors():
    import xgrammar as xgr

    tools = validate_tools([WEATHER, SUM])
    for mode in ("auto", "required"):
        for parallel in (False, True):
            xgr.StructuralTag.from_json(tool_call_structural_tag(tools, mode, parallel))  # pydantic check
    tag = tool_call_structural_tag(tools[:1], "required", False, max_whitespace=None)
    assert tag == {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": tools[0].parameters},
            "end": "}\n</tool_call>",
        },
    }
    with pytest.raises(ValueError):
        tool_call_structural_tag(tools, "none", True)
    with pytest.raises(ValueError):
        tool_call_structural_tag([], "required", True)


def test_structural_tag_with_tokenizer(tokenizer):
    """Compile against the real vocabulary, drive a matcher with the tokens of rendered calls, parse."""
    import xgrammar as xgr

    tools = validate_tools([WEATHER, SUM])
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer), cache_enabled=False)
    compiled = compiler.compile_structural_tag(json.dumps(tool_call_structural_tag(tools, "required", True)))
    calls = [format_call("get_weather", {"location": "Oslo"}), format_call("math.sum", {"numbers": [4]})]
    text = "\n".join(calls)
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()
    assert parse_tool_calls(text) == (
        None,
        [ToolCall("get_weather", '{"location": "Oslo"}'), ToolCall("math.sum", '{"numbers": [4]}')],
    )
    bad = xgr.GrammarMatcher(compiled)
    assert not all(bad.accept_token(t) for t in tokenizer.encode("Hello", add_special_tokens=False))


# ---------------------------------------------------------------------------------------------------
# parse_tool_calls


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("", None, []),
        ("  Hello there.\n", "Hello there.", []),
        (call("f", '{"a": 1}'), None, [("f", '{"a": 1}')]),
        (
            "Sure.\n" + call("f", "{}") + "\n" + call("g", '{"b": [1, {"c": "}"}]}'),
            "Sure.",
            [
                ("f", "{}"),
                ("g", '{"b": [1, {"c": "}"}]}'),
            ],
        ),
        ("A\n" + call("f", "{}") + "\nB ", "A\n\nB", [("f", "{}")]),
        ('<tool_call>{"name":"f","parameters":{"x":"\\"}"}}</tool_call>', None, [("f", '{"x":"\\"}"}')]),
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', None, [("f", '{"a": 1}')]),
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "f", "id": 3}</tool_call>', None, [("f", '{"a": 1}')]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", '{"a": 1}')]),  # no close tag
        (
            '<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g", "arguments": {}}',
            None,
            [
                ("f", "{}"),
                ("g", "{}"),
            ],
        ),
        ('<tool_call>{"name": "\\u0066", "arguments": {}}</tool_call>', None, [("f", "{}")]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>', None, [("f", '{"a": 1}')]),
        # Cut off by max_tokens after the name: still a call, with the arguments as written.
        ('Hi <tool_call>\n{"name": "f", "arguments": {"a": [1, ', "Hi", [("f", '{"a": [1,')]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', None, [("f", '{"a": 1}')]),
        # Malformed blocks stay in the content, as written.
        ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
        (
            'x <tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
            'x <tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": 1, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 1, "arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
        ('<tool_call>{"arguments": {}, "name": "f"', '<tool_call>{"arguments": {}, "name": "f"', []),
        (
            '<tool_call>{"arguments": {}, "name": "f", "name": "g"}',
            '<tool_call>{"arguments": {}, "name": "f", "name": "g"}',
            [],
        ),
        ("a <tool_call>", "a <tool_call>", []),
        ("</tool_call> <tool_call", "</tool_call> <tool_call", []),  # no call: content as written (vLLM)
    ],
)
def test_parse_tool_calls(text, content, calls):
    assert parse_tool_calls(text) == (content, [ToolCall(n, a) for n, a in calls])
    assert stream(text, [len(text)]) == (content or "", calls)  # one delta


def bfcl_tool(name: str, description: str, **properties: dict) -> dict:
    """A function as BFCL writes one (parameters of type "dict"), every property required."""
    parameters = {"type": "dict", "properties": properties, "required": list(properties)}
    return {"name": name, "description": description, "parameters": parameters}


def tool_call_turns(call_id: str, name: str, arguments: str, result: str) -> list[dict]:
    """A past tool call as chat messages: the assistant's turn calling `name`, then the tool's answer."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


# ---------------------------------------------------------------------------------------------------
# ToolCallStreamParser


def stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    return feed_calls(ToolCallStreamParser(), text, cuts)


def expected(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content or "", [(c.name, c.arguments) for c in calls]


EXAMPLES = [
    "Plain answer.",
    "  \n",
    call("get_weather", '{"location": "Paris"}'),
    "I'll look.\n\n" + call("f", '{"q": "a}b\\"}", "n": {"m": []}}') + "\n" + call("g", "{}") + "\n",
    "A " + call("f", '{ "x" : 1 } ') + " B\n" + call("g", '{"y": "<tool_call>"}') + " C",
    '<tool_call>{"arguments": {"k": "v"}, "name": "late"}</tool_call>\n' + call("f", "{}"),
    "text <tool_call>broken</tool_call> more " + call("f", '{"a": 1}'),
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    'Hi <tool_call>\n{"name": "f", "arguments": {"a": [1, ',
    'x < y <tool_ <tool_call>\n{"name": "f", "parameters": {}}\n</tool_call> </tool_call>',
    call("f", '{"a": 1}')[:-3],
    '<tool_call> {"name": "f", "arguments": {"a": "\\\\"}, "extra": {"b": 2}} </tool_call>',
    '<tool_call>{"name": "f", "arguments": "nope"}</tool_call>tail',
    "<tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": {"b": 1}} junk ] </tool_call> end',
    "a\u00a0" + call("f", '{"s": "\u00e9 "}') + "\u00a0b",
]


@pytest.mark.parametrize("text", EXAMPLES)
def test_stream_equals_parse_for_every_split(text):
    want = expected(text)
    for cuts in every_split(text, draws=200):
        assert stream(text, cuts) == want, cuts


def test_stream_equals_parse_on_random_outputs():
    """Random mixes of content, well-formed calls and malformed blocks, randomly split."""
    rng = random.Random(0)
    pieces = [
        "Sure",
        " ",
        "\n",
        "ok.",
        "<",
        "<tool",
        "</tool_call>",
        "<tool_call>",
        call("f", '{"a": "x}"}'),
        call("get_weather", '{"location": "Paris", "unit": "c"}'),
        '<tool_call>{"name": "g", "arguments": {"n": [1, {"m": null}]}}</tool_call>',
        '<tool_call>{"arguments": {}, "name": "h"}</tool_call>',
        "<tool_call>oops</tool_call>",
        '{"name": "x"}',
    ]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        want = expected(text)
        for _ in range(5):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, min(20, len(text) + 1)))
            assert stream(text, cuts) == want, (text, cuts)


def test_stream_is_incremental():
    parser = ToolCallStreamParser()
    assert parser.feed("Let me check") == [ContentDelta("Let me check")]
    assert parser.feed(". \n<tool") == [ContentDelta(".")]  # whitespace and partial tag held back
    assert parser.feed('_call>\n{"name": "get_weather"') == []
    assert parser.feed(', "arguments": ') == []
    assert parser.feed('{"location": "Par') == [
        ToolCallStart(0, "get_weather"),
        ToolCallArguments(0, '{"location": "Par'),
    ]
    assert parser.feed('is"') == [ToolCallArguments(0, 'is"')]
    assert parser.feed("}") == [ToolCallArguments(0, "}")]  # the arguments object is closed
    assert parser.feed("}\n</tool_") == []
    assert parser.feed("call>\n") == []
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "f", "arguments": {"a": {"b": 1}') == [
        ToolCallStart(1, "f"),
        ToolCallArguments(1, '{"a": {"b": 1'),  # "}" held back: it might close the call
    ]
    assert parser.feed(" ") == []
    assert parser.feed("}") == [ToolCallArguments(1, "} }")]
    assert parser.feed("}\n</tool_call>") == []
    assert parser.feed(" Done <") == [ContentDelta(" \n\n Done")]  # inner whitespace is kept
    assert parser.finish() == [ContentDelta(" <")]


def test_stream_holds_unannounced_blocks_whole():
    parser = ToolCallStreamParser()
    assert parser.feed('<tool_call>{"arguments": {"a": 1}, ') == []
    assert parser.feed('"name": "f"}') == []
    assert parser.feed("</tool_call>") == [ToolCallStart(0, "f"), ToolCallArguments(0, '{"a": 1}')]
    assert parser.feed("<tool_call>[1, 2]") == []
    assert parser.feed("</tool_call>") == [ContentDelta("<tool_call>[1, 2]</tool_call>")]
    assert parser.finish() == []
