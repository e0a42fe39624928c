"""The Responses API through the official `openai` SDK (its types parse every response and event), in-process
on a tiny random model: text, function tools with tool_choice, `text.format` json_schema strict, typed
streaming events, conversation state through previous_response_id, tenant scope, and fields refused by
name. References: the SDK's parsing, jsonschema, and the chat completions endpoint (the same request as
chat messages must give the same prompt and, greedy, the same text).

The live-server companions (a restart, LoRA adapters, metrics) are in test_responses_live.py.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
)
from pydantic import BaseModel, Field

from motet.actors.system import ServingSystem
from motet.api.auth import Authenticator
from motet.api.responses.store import ResponseStore
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.served_app import served_app

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the forecast",
    "parameters": CITY,
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]},
}


@pytest.fixture(scope="module")
def app_client(tiny_model_dir, tmp_path_factory):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, max_num_seqs=8, max_model_len=2048,
                       max_num_batched_tokens=2048)  # fmt: skip
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = ResponseStore(tmp_path_factory.mktemp("responses"))
    auth = Authenticator({"k-alice": "alice", "k-bob": "bob"})
    state = ServerState(system, ["tiny"], auth=auth, responses=store)
    with served_app(state) as c:
        yield c


def sdk(app_client, key: str = "k-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=app_client, max_retries=0)


@pytest.fixture(scope="module")
def alice(app_client):
    return sdk(app_client)


@pytest.fixture(scope="module")
def bob(app_client):
    return sdk(app_client, "k-bob")


def chat_reference(client: openai.OpenAI, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_text_is_the_chat_answer_to_the_same_messages(alice):
    r = alice.responses.create(model="tiny", instructions="Be brief.", input="Hello there", max_output_tokens=8,
                               temperature=0)  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    (message,) = r.output
    assert (
        message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    )
    ref = chat_reference(
        alice, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 8
    )
    assert r.output_text == ref.choices[0].message.content
    assert (
        r.usage.input_tokens == ref.usage.prompt_tokens
        and r.usage.output_tokens == ref.usage.completion_tokens
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if ref.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    assert alice.responses.retrieve(r.id).output_text == r.output_text  # stored


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_with_tool_choice(alice, tool_choice):
    r = alice.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice=tool_choice,
                               parallel_tool_calls=False, max_output_tokens=300, temperature=0)  # fmt: skip
    assert r.status == "completed", r.output
    (call,) = r.output
    assert isinstance(call, ResponseFunctionToolCall) and call.call_id and call.status == "completed"
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    if isinstance(tool_choice, dict):
        assert call.name == "get_weather"
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]


class Trip(BaseModel):
    # Bounded, so a random tiny model's string cannot run past max_output_tokens (motet enforces maxLength)
    city: str = Field(max_length=16)
    days: int


def test_text_format_json_schema_strict(alice):
    fmt = {"type": "json_schema", "name": "trip", "schema": CITY, "strict": True}
    r = alice.responses.create(model="tiny", input="Plan a trip", text={"format": fmt}, max_output_tokens=200,
                               temperature=0)  # fmt: skip
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    parsed = alice.responses.parse(model="tiny", input="Plan a trip", text_format=Trip, max_output_tokens=200,
                                   temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, Trip)  # the SDK's own strict schema for the model, parsed back


def test_stream_events_parse_as_the_sdks_typed_events(alice):
    fmt = {"type": "json_schema", "name": "trip", "schema": CITY, "strict": True}
    with alice.responses.stream(model="tiny", input="Plan a trip", text={"format": fmt}, max_output_tokens=200,
                                temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    assert isinstance(events[0], ResponseCreatedEvent) and isinstance(events[-1], ResponseCompletedEvent)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert deltas and "".join(e.delta for e in deltas) == final.output_text
    assert [type(e) for e in events if "output_item" in e.type] == [
        ResponseOutputItemAddedEvent,
        ResponseOutputItemDoneEvent,
    ]
    jsonschema.validate(json.loads(final.output_text), CITY)
    stored = alice.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == "completed"


def test_streamed_function_call_arguments(alice):
    with alice.responses.stream(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=300, temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    fragments = [e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    (call,) = final.output
    assert "".join(fragments) == call.arguments
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert call.parsed_arguments == json.loads(call.arguments)  # the SDK parsed it against the strict tool


def test_previous_response_id_continues_the_conversation(alice):
    first = alice.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = alice.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=6, temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    ref = chat_reference(alice, [{"role": "user", "content": "My name is Ada."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 6)  # fmt: skip
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    assert second.output_text == ref.choices[0].message.content


def test_a_function_call_output_continues_after_the_call(alice):
    first = alice.responses.create(model="tiny", input="Weather?", tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=300, temperature=0)  # fmt: skip
    first_id, (prev,) = first.id, first.output
    result = {"type": "function_call_output", "call_id": prev.call_id, "output": "sunny, 21 C"}
    r = alice.responses.create(model="tiny", input=[result], previous_response_id=first_id, tools=[WEATHER],
                               max_output_tokens=4, temperature=0)  # fmt: skip
    tool_call = {
        "id": prev.call_id,
        "type": "function",
        "function": {"name": prev.name, "arguments": prev.arguments},
    }
    ref = alice.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                  {"role": "tool", "tool_call_id": prev.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=4, temperature=0,
    )  # fmt: skip
    assert r.usage.input_tokens == ref.usage.prompt_tokens


@pytest.mark.parametrize("text", ['{"city": "\\ud800"}', "[" * 100_000 + "]" * 100_000])
def test_json_text_in_function_call_items_is_read_as_a_body_is(alice, text):
    """A function_call's `arguments` and a function_call_output's `output`, JSON text the prompt reads as JSON: a
    lone surrogate escape inside (no valid Unicode) or nesting past the parser's recursion was a 500; a 400
    naming the item's field, and the same items with valid JSON are served."""

    def items(arguments: str, output: str) -> list[dict]:
        call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments}
        result = {"type": "function_call_output", "call_id": "c1", "output": output}
        return [{"role": "user", "content": "Weather?"}, call, result]

    for arguments, output, param in [
        (text, "sunny", "input[1].arguments"),
        ('{"city": "Oslo"}', text, "input[2].output"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            alice.responses.create(
                model="tiny", input=items(arguments, output), tools=[WEATHER], max_output_tokens=2
            )
        assert e.value.body["param"] == param, e.value.body
    r = alice.responses.create(model="tiny", input=items('{"city": "Oslo"}', '{"sky": "\\u00e9"}'), tools=[WEATHER],
                               max_output_tokens=2)  # fmt: skip
    assert r.status in ("completed", "incomplete")


def test_tenants_never_see_each_others_responses(alice, bob):
    r = alice.responses.create(model="tiny", input="secret", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(model="tiny", input="x", previous_response_id=r.id, max_output_tokens=2)
    assert (
        e.value.body["param"] == "previous_response_id"
        and e.value.body["code"] == "previous_response_not_found"
    )
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    assert alice.responses.retrieve(r.id).id == r.id  # untouched by bob's attempts
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


def test_store_false_is_not_stored(alice):
    r = alice.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "shape": 1}}},
            "text.format.shape",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
            "text.format.schema",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x", "cache_control": {}}]}, "input[0].cache_control"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "detail": 1}]}]},
            "input[0].content[0].detail",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(alice, fields, param):
    body = {"input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model="tiny", extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_openai_no_op_fields_are_accepted(alice):
    r = alice.responses.create(model="tiny", input="hi", max_output_tokens=2, user="u", metadata={"k": "v"},
                               safety_identifier="s", prompt_cache_key="p", service_tier="auto", truncation="disabled",
                               reasoning={}, include=[])  # fmt: skip
    assert r.metadata == {"k": "v"} and r.user == "u"
