"""The OpenAI Agents SDK's quickstart on the real default model (slow): one function tool, the SDK's default model
settings but `tool_choice="required"` and a seed per run (an extra body field, so that a run's sampling is
reproducible), on a server with its default settings: the sampling is the default model's generation config (issue
57: at its temperature 0.2 alone the 135M model sometimes went on to the end of its context, which the SDK's
Responses model reports as `response.incomplete`, and a run seemed to hang), through its Responses model and its chat completions model pointed at motet,
5 runs of each. Every run must call the tool with arguments its schema accepts (the SDK checks them with pydantic
before calling), then answer: a non-empty final output, asked after the tool's result was sent back, within the SDK's
default turn limit (issue 48: text the model wrote after the result that was no call, such as a `<tool_response>` block
it copied, was dropped, and the agent ended with an empty answer; it is the answer now, as vLLM returns it). The SDK
resets `tool_choice` after the call (its `reset_tool_choice`), so the answer is asked with `tool_choice` unset: the
requests sent are checked too."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI  # noqa: E402

from tests.api.test_api import MODEL  # noqa: E402
from tests.live_server import Server  # noqa: E402

pytestmark = pytest.mark.slow
RUNS = 5


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents-sdk")
    srv = Server(tmp, "--data-dir", str(tmp / "data"))
    yield srv
    srv.stop()


async def quickstart(base_url: str, model_class) -> list[tuple[list[str], object, list[dict]]]:
    """RUNS concurrent runs of the quickstart: for each, the tool's calls, the final output, the requests sent."""
    set_tracing_disabled(True)

    async def run(i: int):
        calls, sent = [], []

        @function_tool
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            calls.append(city)
            return f"The weather in {city} is sunny."

        async def record(request: httpx.Request) -> None:
            sent.append(json.loads(request.content))

        http = httpx.AsyncClient(timeout=600, event_hooks={"request": [record]})
        client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=http)
        agent = Agent(
            name="Assistant",
            instructions="You are a helpful assistant.",
            tools=[get_weather],
            model=model_class(model=MODEL, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", extra_body={"seed": i}),
        )
        async with http:
            result = await Runner.run(agent, "What's the weather in Tokyo?")
        return calls, result.final_output, sent

    return await asyncio.gather(*(run(i) for i in range(RUNS)))


def tool_result_sent(body: dict) -> bool:
    """Whether a request carries a tool's result: a `function_call_output` item (Responses), a `tool` message (chat)."""
    items = body.get("input") if isinstance(body.get("input"), list) else body.get("messages", [])
    return any(i.get("type") == "function_call_output" or i.get("role") == "tool" for i in items)


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_quickstart_completes_a_tool_round_trip(server, model_class):
    runs = asyncio.run(quickstart(f"{server.url}/v1", model_class))
    for calls, final, sent in runs:
        # calls the tool's schema accepts (a parallel second call may name "": a string), one of them Tokyo
        assert calls and all(isinstance(city, str) for city in calls) and "Tokyo" in calls, calls
        assert tool_result_sent(sent[-1])  # the final answer was asked after the tool's result
        assert isinstance(final, str) and final.strip(), final
        assert sent[0]["tool_choice"] == "required"
        assert all(
            "tool_choice" not in body for body in sent[1:]
        )  # reset after the call: the model may answer
