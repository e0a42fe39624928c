"""Every request field is honoured or refused: unknown fields and fields motet cannot honour get a 400
naming them; OpenAI's fields that do not change the output are accepted; vLLM's `structured_outputs`
constrains like the `guided_*` fields (outputs checked with jsonschema / re, not with motet's own code).

In-process (Starlette TestClient) on a tiny random model.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from motet.actors.system import ServingSystem
from motet.api.auth import Authenticator
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.served_app import served_app

AUTH = {"Authorization": "Bearer k1"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8, max_model_len=512)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=64)
    state = ServerState(system, ["tiny"], auth=Authenticator({"k1": "alice"}))
    with served_app(state) as c:
        yield c


def chat(client, **body):
    return client.post(CHAT, json={"model": "tiny", "messages": USER, "max_tokens": 3, **body}, headers=AUTH)


def completion(client, **body):
    return client.post(
        COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 3, **body}, headers=AUTH
    )


def refused(r, param: str, match: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param in err["message"] and (match is None or match in err["message"]), err
    return err


@pytest.mark.parametrize(
    "route, field, value",
    [
        ("chat", "frobnicate", 1),
        ("chat", "guided_whitespace_pattern", " "),
        ("chat", "best_of", 2),  # a completions field, unknown to chat
        ("completions", "messages", USER),
        ("completions", "chat_template_kwargs", {}),
        ("completions", "tools", []),
    ],
)
def test_unknown_fields_are_refused_by_name(client, route, field, value):
    send = chat if route == "chat" else completion
    err = refused(send(client, **{field: value}), field)
    assert err["message"] == f"Unrecognized request argument supplied: {field}"


def test_unknown_nested_fields_are_refused_by_path(client):
    refused(chat(client, stream_options={"include_usage": True, "usage_every_n_chunks": 2}),
            "stream_options.usage_every_n_chunks")  # fmt: skip
    refused(chat(client, structured_outputs={"choice": ["a"], "backend": "x"}), "structured_outputs.backend")
    refused(chat(client, response_format={"type": "json_object", "schema": {}}), "response_format.schema")
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict_mode": True}}
    refused(chat(client, response_format=rf), "response_format.json_schema.strict_mode")


@pytest.mark.parametrize(
    "route, field, value",
    [
        ("chat", "logit_bias", {"5": 10}),
        ("chat", "audio", {"voice": "alloy", "format": "wav"}),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "functions", [{"name": "f"}]),
        ("chat", "function_call", "auto"),
        ("chat", "prediction", {"type": "content", "content": "x"}),
        ("chat", "reasoning_effort", "high"),
        ("chat", "verbosity", "low"),
        ("chat", "web_search_options", {}),
        ("chat", "service_tier", "priority"),
        ("completions", "suffix", "!"),
        ("completions", "best_of", 3),
        ("completions", "logit_bias", {"5": -100}),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused(client, route, field, value):
    send = chat if route == "chat" else completion
    refused(send(client, **{field: value}), field, "not supported")


def test_nested_fields_that_cannot_be_honoured_are_refused(client):
    refused(chat(client, structured_outputs={"json": {}, "whitespace_pattern": "[ ]?"}),
            "structured_outputs.whitespace_pattern", "not supported")  # fmt: skip
    refused(chat(client, structured_outputs={"regex": "a", "disable_fallback": True}),
            "structured_outputs.disable_fallback", "not supported")  # fmt: skip


def test_fields_that_do_not_change_the_output_are_accepted(client):
    no_ops = dict(user="u1", metadata={"k": "v"}, store=True, prompt_cache_key="p", safety_identifier="s",
                  prompt_cache_retention="24h", service_tier="auto", logit_bias=None, modalities=["text"],
                  stream_options=None)  # fmt: skip
    r = chat(client, temperature=0, **no_ops)
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][0]["message"]["content"]
        == chat(client, temperature=0).json()["choices"][0]["message"]["content"]
    )
    r = completion(client, user="u", suffix=None, best_of=1, logit_bias={})
    assert r.status_code == 200, r.text
    r = chat(client, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert r.status_code == 200, r.text
    refused(chat(client, metadata="not an object"), "metadata")


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "n"],
}


def test_structured_outputs_constrain_like_guided_fields(client):
    r = chat(client, max_tokens=40, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in text  # compact JSON

    r = completion(client, max_tokens=8, structured_outputs={"choice": ["alpha", "beta"]})
    assert r.json()["choices"][0]["text"] in ("alpha", "beta")
    r = chat(client, max_tokens=8, structured_outputs={"regex": "[a-c]{3}-[0-9]"})
    assert re.fullmatch("[a-c]{3}-[0-9]", r.json()["choices"][0]["message"]["content"])
    r = chat(client, max_tokens=8, structured_outputs={"grammar": 'root ::= "yes" | "no"'})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = chat(client, max_tokens=60, structured_outputs={"json_object": True})
    assert r.status_code == 200, r.text


def test_structured_outputs_errors_name_their_field(client):
    refused(chat(client, structured_outputs={"json": {"type": "objekt"}}), "structured_outputs.json")
    refused(chat(client, structured_outputs={"choice": []}), "structured_outputs.choice")
    err = refused(
        chat(client, guided_regex="a", structured_outputs={"choice": ["a"]}), "structured_outputs.choice"
    )
    assert "at most one" in err["message"]
