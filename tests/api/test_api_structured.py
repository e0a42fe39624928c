"""Structured output over HTTP: response_format, guided_*, tools, reasoning; streamed and not.

Real `motet serve` subprocesses on the default model, driven by the openai SDK; outputs are checked
with jsonschema and `re`, streamed tool calls and reasoning with the SDK's own accumulation.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.api.test_api import MODEL
from tests.grammar.test_tool_calls import tool_call_turns
from tests.live_server import Server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {  # BFCL-style types: normalized by the server
                "type": "dict",
                "properties": {"a": {"type": "float"}, "b": {"type": "float"}},
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {
    "get_weather": TOOLS[0]["function"]["parameters"],
    "add": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
}
ASK = [{"role": "user", "content": "What is 3 plus 4? And the weather in Rome?"}]
FEW_SHOT_THINK = [
    {"role": "system", "content": "You think first inside <think></think> tags, then answer."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>2 plus 2 is 4.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 5?"},
    {"role": "assistant", "content": "<think>3 plus 5 is 8.</think>The answer is 8."},
    {"role": "user", "content": "What is 6 plus 1?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("structured"), "--grammar-timeout", "3", "--max-num-seqs", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, messages=ASK, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def streamed(client, **kw):
    state = ChatCompletionStreamState()
    for chunk in chat(client, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, [{"role": "user", "content": "Describe a person as JSON."}], response_format=fmt, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    s = streamed(
        client, messages=[{"role": "user", "content": "Describe a person as JSON."}], response_format=fmt
    )
    assert s.choices[0].message.content == r.choices[0].message.content
    r = chat(
        client, [{"role": "user", "content": "List three colors."}], response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_extras_on_chat_and_completions(client):
    r = chat(client, extra_body={"guided_regex": r"[A-Z][a-z]+ [0-9]{2}"}, max_tokens=16)
    assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", r.choices[0].message.content)
    r = chat(client, extra_body={"guided_choice": ["seven", "eight", "nine"]}, max_tokens=8)
    assert r.choices[0].message.content in {"seven", "eight", "nine"}
    r = chat(client, extra_body={"guided_grammar": 'root ::= "The answer is " [0-9]+ "."'}, max_tokens=16)
    assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].message.content)
    c = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_json": PERSON},
    )
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)
    # The outlines backend, chosen per request, follows the same constraint.
    r = chat(client, extra_body={"guided_choice": ["seven", "eight"], "guided_decoding_backend": "outlines"})
    assert r.choices[0].message.content in {"seven", "eight"}


def test_tool_choice_required_named_and_auto(client):
    r = chat(client, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, args in calls_of(choice.message):
        jsonschema.validate(args, SCHEMAS[name])
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)

    # A named function is exactly one call of it, and the answer ends there (OpenAI's forced function), with
    # parallel_tool_calls left at its default: issue 57's default model wrote a second call until max_tokens.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=TOOLS, tool_choice=named)
    (call,) = calls_of(r.choices[0].message)
    assert r.choices[0].finish_reason == "tool_calls" and call[0] == "get_weather"
    jsonschema.validate(call[1], SCHEMAS["get_weather"])

    # max_tool_calls bounds a parallel response (the default model would otherwise repeat calls).
    loop = [{"role": "user", "content": "Weather in Rome, Paris, Oslo, Lima, Kyiv and Doha?"}]
    r = chat(
        client, loop, tools=TOOLS, tool_choice="required", max_tokens=200, extra_body={"max_tool_calls": 2}
    )
    assert r.choices[0].finish_reason == "tool_calls" and 1 <= len(r.choices[0].message.tool_calls) <= 2

    # auto: the model may answer or call; what it writes is parsed either way.
    r = chat(client, tools=TOOLS)
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
    else:
        assert m.content and "<tool_call>" not in m.content


def test_streamed_tool_calls_accumulate_to_the_non_streamed_response(client):
    for kw in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False}):
        whole = chat(client, tools=TOOLS, **kw).choices[0]
        acc = streamed(client, tools=TOOLS, **kw).choices[0]
        assert acc.finish_reason == whole.finish_reason == "tool_calls"
        assert calls_of(acc.message) == calls_of(whole.message)
        raw = [c.function.arguments for c in acc.message.tool_calls]
        assert raw == [c.function.arguments for c in whole.message.tool_calls]
        assert (acc.message.content or None) == whole.message.content


def test_tool_history_renders_back_into_the_prompt(client):
    history = ASK + tool_call_turns("call_1", "add", '{"a": 3, "b": 4}', "7")
    r = chat(client, history, tools=TOOLS, tool_choice="none", max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    bare = chat(client, ASK, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 100  # the tools and the call are in the prompt


@pytest.mark.parametrize(
    "kw, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}},
                }
            },
            "response_format",
        ),
        (
            {  # strict promises validity: a keyword the grammar does not enforce is refused
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "properties": {"xs": {"uniqueItems": True}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "extra_body": {"max_tool_calls": 0}}, "max_tool_calls"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {  # xgrammar 0.2.9 compiles it in ~15 s (2-core Zen 3): past the server's --grammar-timeout of 3 s.
                # (Long maxLength strings took as long in 0.2.8; 0.2.9 compiles them in 0.2 s.)
                "extra_body": {
                    "guided_json": {
                        "type": "object",
                        "properties": {
                            f"p{i}": {
                                "type": "string",
                                "pattern": f"^([a-z]{{2,9}}[0-9]{{1,7}}){{1,{30 + i}}}$",
                            }
                            for i in range(30)
                        },
                        "required": [f"p{i}" for i in range(30)],
                    }
                }
            },
            "guided_json",
        ),
    ],
)
def test_bad_structured_requests_get_400_and_the_server_carries_on(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=5, **kw)
    assert e.value.body["param"] == param and e.value.body["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"


def test_reasoning_is_split_streamed_and_constraints_start_after_it(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "think")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)
        whole = chat(client, FEW_SHOT_THINK, max_tokens=40).choices[0].message
        assert whole.reasoning_content and "7" in whole.reasoning_content
        assert whole.content and "<think>" not in whole.content
        acc = streamed(client, messages=FEW_SHOT_THINK, max_tokens=40).choices[0].message
        assert (acc.content, acc.model_extra.get("reasoning_content")) == (
            whole.content,
            whole.reasoning_content,
        )

        choice = chat(
            client, FEW_SHOT_THINK, max_tokens=40, extra_body={"guided_choice": ["Seven.", "Eight."]}
        )
        m = choice.choices[0].message
        assert m.reasoning_content and m.content in ("Seven.", "Eight.")
    finally:
        s.stop()
