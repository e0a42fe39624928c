"""The families' tool-call and reasoning formats as the API returns them: each family's output, written as the model
writes it, becomes an OpenAI chat message (checked with the openai SDK's own types, the arguments with jsonschema),
and its stream, cut anywhere, accumulates (with the SDK's own stream state) to the same message. Then GPT-OSS's
formats served in-process: a forced call on the tiny model, whole and streamed."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall

from motet.api.completions.chat_output import ChatOutput
from motet.grammar.reasoning import reasoning_format
from motet.grammar.tool_formats import tool_format

WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location"],
}
SCHEMAS = {"get_weather": WEATHER, "get_current_weather": WEATHER}
ANALYSIS = '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use get_weather tool.<|end|>'

# family: (reasoning parser, tool-call parser, started, output, reasoning, content, calls)
FAMILIES = {
    "Qwen3": (
        "qwen3",
        "hermes",
        False,
        "<think>\nThe user wants the weather in Tokyo. I'll call get_weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>',
        "The user wants the weather in Tokyo. I'll call get_weather.",
        None,
        [("get_weather", {"location": "Tokyo"})],
    ),
    "Qwen3-2507-Thinking": (  # its template opened <think>: the output begins inside it
        "qwen3",
        "hermes",
        True,
        "The user wants Tokyo's weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}}\n</tool_call>',
        "The user wants Tokyo's weather.",
        None,
        [("get_weather", {"location": "Tokyo", "unit": "celsius"})],
    ),
    "DeepSeek-R1": (
        "deepseek_r1",
        "hermes",
        False,
        "Okay, the user asks for 2 + 2, which is 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2 + 2, which is 4.",
        "The answer is **4**.",
        [],
    ),
    "GPT-OSS call": (
        "openai_gptoss",
        "openai",
        False,
        ANALYSIS
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location":"Tokyo"}<|call|>',
        'User asks: "What is the weather in Tokyo?" We need to use get_weather tool.',
        None,
        [("get_weather", {"location": "Tokyo"})],
    ),
    "GPT-OSS answer": (
        "openai_gptoss",
        "openai",
        False,
        "<|channel|>analysis<|message|>The tool says sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is sunny in Tokyo.<|return|>",
        "The tool says sunny.",
        "It is sunny in Tokyo.",
        [],
    ),
    "Phi-4-mini": (
        None,
        "phi4_mini_json",
        False,
        'functools[{"name": "get_weather", "arguments": {"location": "Tokyo"}}]',
        None,
        None,
        [("get_weather", {"location": "Tokyo"})],
    ),
    "Granite 3.2": (
        "granite",
        "granite",
        False,
        "Here is my thought process:\nThe user needs the current weather.\nHere is my response:\n"
        '<|tool_call|>[{"name": "get_current_weather", "arguments": {"location": "Boston", "unit": "fahrenheit"}}]',
        "The user needs the current weather.",
        None,
        [("get_current_weather", {"location": "Boston", "unit": "fahrenheit"})],
    ),
    "Mistral": (
        None,
        "mistral",
        False,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Tokyo"}}]',
        None,
        None,
        [("get_weather", {"location": "Tokyo"})],
    ),
    "Llama 3.1": (
        None,
        "llama3_json",
        False,
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Tokyo"}}',
        None,
        None,
        [("get_weather", {"location": "Tokyo"})],
    ),
    "Llama 3.2 / Gemma 3 pythonic": (
        None,
        "pythonic",
        False,
        "[get_weather(location='Tokyo', unit='celsius')]",
        None,
        None,
        [("get_weather", {"location": "Tokyo", "unit": "celsius"})],
    ),
}


def output_of(family) -> ChatOutput:
    reasoning, tools, started, *_ = FAMILIES[family]
    return ChatOutput(reasoning_format(reasoning), started, tools=True, tool_format=tool_format(tools))


def check_calls(message: ChatCompletionMessage, calls) -> None:
    got = []
    for call in message.tool_calls or []:
        ChatCompletionMessageToolCall.model_validate(call.model_dump())
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        got.append((call.function.name, args))
    assert got == calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole(family):
    _, _, _, text, reasoning, content, calls = FAMILIES[family]
    out, finish = output_of(family).message(text, "stop")
    message = ChatCompletionMessage.model_validate(out.model_dump())
    assert finish == ("tool_calls" if calls else "stop")
    assert (message.content, out.reasoning_content) == (content, reasoning)
    check_calls(message, calls)


def streamed(family: str, cuts: list[int]):
    """The chat chunks of the output cut at `cuts`, accumulated by the SDK; and the reasoning deltas joined."""
    text = FAMILIES[family][3]
    output, state, reasoning, prev = output_of(family), ChatCompletionStreamState(), [], 0

    def chunk(delta: dict, finish: str | None = None) -> None:
        reasoning.append(delta.get("reasoning_content") or "")
        body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
        state.handle_chunk(ChatCompletionChunk.model_validate(body))

    chunk({"role": "assistant"})
    for cut in [*sorted(cuts), len(text)]:
        for delta in output.feed(text[prev:cut]):
            chunk(delta)
        prev = cut
    last, finish = output.finish("stop")
    for delta in last:
        chunk(delta)
    chunk({}, finish)
    choice = state.get_final_completion().choices[0]
    return choice, "".join(reasoning) or None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_for_any_split(family):
    _, _, _, text, reasoning, content, calls = FAMILIES[family]
    rng = random.Random(family)
    for cuts in [[], list(range(1, len(text)))] + [
        rng.sample(range(len(text) + 1), rng.randint(1, 12)) for _ in range(40)
    ]:
        choice, got_reasoning = streamed(family, cuts)
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        assert (choice.message.content or None, got_reasoning) == (content, reasoning), cuts
        check_calls(choice.message, calls)


# ---------------------------------------------------------------------------------------------------
# GPT-OSS's formats served in-process


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from motet.actors.system import ServingSystem
    from motet.api.state import ServerState
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from tests.served_app import served_app

    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=4, speculative="off")
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=8)
    state = ServerState(system, ["tiny"], reasoning_parser="openai_gptoss", tool_call_parser="openai")
    with served_app(state) as client:
        yield state, client


SMALL = {  # bounded values: a random model finishes them within max_tokens
    "type": "object",
    "properties": {"location": {"enum": ["Tokyo", "Paris"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location"],
    "additionalProperties": False,
}
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Weather in Tokyo?"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SMALL}}],
    "tool_choice": "required",
    "max_tokens": 200,
    "temperature": 0,
}


def test_served_forced_call(served):
    """`--tool-call-parser openai --reasoning-parser openai_gptoss`: the forced call is held from the first token,
    comes back as an OpenAI tool call whose arguments follow the schema, and streams to the same call."""
    _, client = served
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    whole = ChatCompletion.model_validate(r.json()).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SMALL)

    state = ChatCompletionStreamState()
    with client.stream("POST", "/v1/chat/completions", json=BODY | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(line[6:])))
    acc = state.get_final_completion().choices[0]
    assert acc.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in acc.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_served_formats_keep_special_tokens(served):
    """Harmony's markers are special tokens in GPT-OSS's vocabulary: its requests keep them in the text, and the
    engine's gate is off for the forced call (held from the first token) but on for a JSON answer."""
    from motet.api.completions import protocol as P
    from motet.api.completions.generation import chat_spec

    state, _ = served
    spec, structure, _, _ = chat_spec(state, "t", None, P.ChatCompletionRequest.model_validate(BODY), "r")
    assert structure.reasoning.name == "openai_gptoss" and structure.tool_format.name == "openai"
    assert spec.params[0].skip_special_tokens is False and spec.params[0].reasoning is None
    answer = {k: v for k, v in BODY.items() if k not in ("tools", "tool_choice")}
    answer["response_format"] = {"type": "json_schema", "json_schema": {"name": "w", "schema": SMALL}}
    spec, _, _, _ = chat_spec(state, "t", None, P.ChatCompletionRequest.model_validate(answer), "r")
    assert spec.params[0].skip_special_tokens is False and spec.params[0].reasoning == "openai_gptoss"


def test_formats_picked_by_flag_then_family_then_template():
    from types import SimpleNamespace

    from motet.api.completions.generation import served_formats
    from motet.models import get

    def names(arch, template=None, tool=None, reasoning=None):
        model = SimpleNamespace(family=get(arch))
        state = SimpleNamespace(
            system=SimpleNamespace(model=model), tool_call_parser=tool, reasoning_parser=reasoning
        )
        fmt, thinking = served_formats(state, template)
        return fmt.name, thinking and thinking.name

    assert names("Qwen3ForCausalLM") == ("hermes", "think")  # qwen3: the <think> format
    assert names("Qwen3MoeForCausalLM") == ("hermes", "think")
    assert names("GptOssForCausalLM") == ("openai", "openai_gptoss")
    assert names("LlamaForCausalLM", "{{ '<|im_start|>' }}") == ("hermes", None)  # SmolLM2's
    assert names("LlamaForCausalLM", "{{- '<|python_tag|>' }}") == ("llama3_json", None)
    granite_32 = (
        "Write your thoughts after 'Here is my thought process:' ... respond only with <|tool_call|> followed"
    )
    assert names("GraniteForCausalLM", granite_32) == ("granite", "granite")
    assert names("Phi3ForCausalLM", "{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}") == (
        "phi4_mini_json",
        None,
    )
    # a flag wins; "none" turns the family's reasoning off
    assert names("Qwen3ForCausalLM", reasoning="none") == ("hermes", None)
    assert names("GptOssForCausalLM", tool="hermes", reasoning="deepseek_r1") == ("hermes", "deepseek_r1")


def test_family_declarations_name_known_formats():
    from motet.grammar.reasoning import REASONING_FORMATS
    from motet.grammar.tool_formats import TOOL_FORMATS
    from motet.models import DECLARATIONS

    for decl in DECLARATIONS:
        assert decl.tool_format is None or decl.tool_format in TOOL_FORMATS, decl.name
        assert decl.reasoning_format is None or decl.reasoning_format in REASONING_FORMATS, decl.name
