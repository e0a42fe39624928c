"""The Responses API on the real default model through the openai SDK (slow): an answer, a required tool call,
a strict json_schema parsed by the SDK into its pydantic model, and a typed stream."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseCompletedEvent, ResponseTextDeltaEvent
from pydantic import BaseModel

from tests.api.test_api import MODEL
from tests.live_server import Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-real")
    srv = Server(tmp, "--data-dir", str(tmp / "data"))
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
    srv.stop()


def test_answer_and_a_follow_up(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24,
                                temperature=0)  # fmt: skip
    assert "Paris" in r.output_text
    follow = client.responses.create(model=MODEL, input="Repeat that city's name.", previous_response_id=r.id,
                                     max_output_tokens=16, temperature=0)  # fmt: skip
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


def test_required_tool_call(client):
    r = client.responses.create(model=MODEL, input="What's the weather in Paris, in celsius?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                temperature=0)  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


class Capital(BaseModel):
    country: str
    capital: str


def test_strict_json_schema_parsed_by_the_sdk(client):
    r = client.responses.parse(model=MODEL, input="Name the capital of France as JSON.", text_format=Capital,
                               max_output_tokens=60, temperature=0)  # fmt: skip
    assert r.status == "completed" and isinstance(r.output_parsed, Capital)


def test_typed_stream(client):
    with client.responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert deltas == last.response.output_text
    if isinstance(last, ResponseCompletedEvent):
        assert client.responses.retrieve(last.response.id).output_text == deltas
