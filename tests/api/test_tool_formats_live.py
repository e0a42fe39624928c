"""`motet serve --tool-call-parser mistral|llama3_json|phi4_mini_json|granite|openai` on the default model, driven by the openai SDK: forced
calls come back as OpenAI tool calls whose arguments follow the schemas, streamed deltas accumulate to the
same calls, and a history with past calls is served (their spelling is checked in tests/grammar/test_tool_formats.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.api.test_api import MODEL
from tests.api.test_api_structured import ASK, SCHEMAS, TOOLS
from tests.grammar.test_tool_calls import tool_call_turns
from tests.live_server import Server

pytestmark = pytest.mark.slow


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("parser", ["mistral", "llama3_json", "phi4_mini_json", "granite", "openai"])
def test_forced_calls_streamed_and_rendered_back(tmp_path_factory, parser):
    s = Server(tmp_path_factory.mktemp(parser), "--tool-call-parser", parser, "--enable-auto-tool-choice")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=120)

        def chat(messages=ASK, **kw):
            return client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=80, tools=TOOLS, **kw
            )

        for kw in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False}):
            whole = chat(**kw).choices[0]
            assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
            assert whole.message.content is None
            for name, args in calls_of(whole.message):
                jsonschema.validate(args, SCHEMAS[name])
            state = ChatCompletionStreamState()
            for chunk in chat(stream=True, **kw):
                state.handle_chunk(chunk)
            acc = state.get_final_completion().choices[0]
            assert acc.finish_reason == "tool_calls"
            assert [c.function.arguments for c in acc.message.tool_calls] == [
                c.function.arguments for c in whole.message.tool_calls
            ]
            assert [c.function.name for c in acc.message.tool_calls] == [
                c.function.name for c in whole.message.tool_calls
            ]

        named = {"type": "function", "function": {"name": "get_weather"}}
        (call,) = calls_of(chat(tool_choice=named, parallel_tool_calls=False).choices[0].message)
        assert call[0] == "get_weather"

        history = ASK + tool_call_turns("call_1", "add", '{"a": 3, "b": 4}', "7")
        r = client.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
        assert (
            r.usage.prompt_tokens > bare.usage.prompt_tokens + 100
        )  # the tools and the call are in the prompt
    finally:
        s.stop()
