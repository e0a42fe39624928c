"""Issue 48's tool answers over HTTP, driven by the openai SDK against real servers on loopback (tiny random models):
text that is no call is the answer's content, whole and streamed, as it is without tools; and a forced call from a
reasoning family (Qwen3's `<think>`) comes even where the model would reason to the end of its max_tokens."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.grammar.test_tool_round_trip import ECHOED
from tests.live_server import ThreadServer
from tests.tiny_models import CHAT_TEMPLATE, build_tiny_model

SCHEMA = {  # bounded values: a random model finishes them within max_tokens
    "type": "object",
    "properties": {"location": {"enum": ["Tokyo", "Paris"]}},
    "required": ["location"],
    "additionalProperties": False,
}
# strict: the SDK's stream helper parses the arguments of strict tools only
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}}]
AFTER_RESULT = [  # the conversation after the tool's result, where SmolLM2-135M echoed <tool_response>
    {"role": "user", "content": "What's the weather in Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Tokyo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "The weather in Tokyo is sunny."},
]


def serve(tmp_path_factory, model_dir) -> ThreadServer:
    data = tmp_path_factory.mktemp("data")
    return ThreadServer(
        "--model", str(model_dir), "--data-dir", str(data), "--served-model-name", "tiny",
        "--max-model-len", "2048", "--trust-request-chat-template",
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny_model_dir, tmp_path_factory):
    srv = serve(tmp_path_factory, tiny_model_dir)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    srv.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")
    srv = serve(tmp_path_factory, model)  # the Qwen3 family: the `<think>` reasoning parser, Hermes's calls
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    srv.stop()


def test_text_that_is_no_call_is_the_content(llama):
    """The model writes what SmolLM2-135M wrote after a tool result (held to it by `guided_choice`): with `tools` and
    `tool_choice` auto it is no call, so it is the content, as without tools, whole and through the SDK's stream
    helper."""
    body = dict(
        model="tiny",
        messages=AFTER_RESULT,
        max_tokens=200,
        temperature=0,
        extra_body={"guided_choice": [ECHOED]},
    )
    plain = llama.chat.completions.create(**body).choices[0]
    assert plain.message.content == ECHOED
    whole = llama.chat.completions.create(**body, tools=TOOLS).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (ECHOED, None, "stop")
    with llama.chat.completions.stream(**body, tools=TOOLS) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.message.content, streamed.message.tool_calls, streamed.finish_reason) == (
        ECHOED,
        None,
        "stop",
    )


def test_responses_answer_that_is_no_call_is_its_text(llama):
    """The Responses API runs the same splitter: a JSON answer holding the copied block (`text.format` keeps the model
    to it) is the message's text, not cut where the block was, whole and through the SDK's stream helper."""
    answer = {"type": "object", "properties": {"answer": {"const": ECHOED}}, "required": ["answer"]}
    answer["additionalProperties"] = False
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}]
    body = dict(
        model="tiny",
        input="What's the weather in Tokyo?",
        tools=tools,
        max_output_tokens=300,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": answer, "strict": True}},
        store=False,
    )
    whole = llama.responses.create(**body)
    assert whole.status == "completed" and json.loads(whole.output_text) == {"answer": ECHOED}
    with llama.responses.stream(**body) as stream:
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["message"]
    assert json.loads(streamed.output_text) == {"answer": ECHOED}


# The tiny model's template, opening the reasoning in the prompt (as Qwen3-2507-Thinking's does): the random model
# then reasons from its first token and never writes `</think>` by itself.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
)


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_call_comes_after_a_reasoning_that_would_not_end(qwen3, choice):
    body = dict(
        model="tiny",
        messages=AFTER_RESULT[:1],
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,  # one call, then the output ends (the budget's other half holds one)
        max_tokens=200,
        temperature=0,
        extra_body={"chat_template": THINKING_TEMPLATE},
    )
    whole = qwen3.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert whole.message.reasoning_content  # it reasoned, within its bound
    with qwen3.chat.completions.stream(**body) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    (parsed,) = streamed.message.tool_calls
    assert (parsed.function.name, parsed.function.parsed_arguments) == (
        "get_weather",
        json.loads(call.function.arguments),
    )
