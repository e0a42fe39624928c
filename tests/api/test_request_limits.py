"""Request bodies that once crashed or escaped their limits (issue 31, findings 3, 5 and 10):

- Responses input items whose `type` or `role` is a list or an object (7 shapes answered 500
  `TypeError: unhashable`) are a 400 naming the item and field, as chat answers the same shapes;
- `tools: []` (what the OpenAI Agents SDK sends for an agent without tools) is "no tools" on Responses, as
  OpenAI reads it; on chat OpenAI refuses an empty `tools` (code `empty_array`) and so does motet;
- `metadata` within OpenAI's limits (16 pairs, keys of 64 characters, values of 512), `safety_identifier`
  within 128 characters;
- an id or any other value an error quotes comes back bounded (a 4 MB id was echoed whole).

In-process on a tiny random model, through the official `openai` SDK where it can send the request.
"""

from __future__ import annotations

import json

import openai
import pytest

from motet.actors.system import ServingSystem
from motet.api.auth import Authenticator
from motet.api.responses.store import ResponseStore
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.served_app import served_app

AUTH = {"Authorization": "Bearer k-alice", "Content-Type": "application/json"}
SMALL = 2000  # bytes: the most an error body may be, whatever the request held


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=8, max_model_len=1024)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = ResponseStore(tmp_path_factory.mktemp("responses"))
    state = ServerState(system, ["tiny"], auth=Authenticator({"k-alice": "alice"}), responses=store,
                        max_body_bytes=16 << 20)  # fmt: skip
    with served_app(state, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="k-alice", http_client=client, max_retries=0
    )


def post(client, path: str, body: dict):
    return client.post(path, content=json.dumps({"model": "tiny", **body}), headers=AUTH)


def refused(r, param: str | None = None, status: int = 400) -> dict:
    assert r.status_code == status, r.text[:500]
    assert len(r.content) < SMALL, len(r.content)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


# -- item and content shapes that are not strings ----------------------------------------------------------
SHAPES = [
    ({"type": ["message"], "role": "user", "content": "x"}, "input[0].type"),
    ({"type": {"a": 1}, "role": "user", "content": "x"}, "input[0].type"),
    ({"type": "message", "role": ["user"], "content": "x"}, "input[0].role"),
    ({"role": {"user": True}, "content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}, "input[0].content[0].type"),
    ({"role": "user", "content": [{"type": {}, "text": "x"}]}, "input[0].content[0].type"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": [1], "text": "x"}]}, "input[0].output[0].type"),
]  # fmt: skip


@pytest.mark.parametrize("item, param", SHAPES, ids=[p for _, p in SHAPES])
def test_unhashable_item_fields_are_400_naming_them(client, item, param):
    err = refused(post(client, "/v1/responses", {"input": [item], "max_output_tokens": 2}), param)
    assert "expected a string" in err["message"]
    if param.endswith((".role", ".content[0].type")):  # the reference: chat refuses a message of this shape
        message = {"role": item["role"], "content": item["content"]}
        refused(post(client, "/v1/chat/completions", {"messages": [message], "max_tokens": 2}))


@pytest.mark.parametrize("kind", [None, 1, True, "computer_call"])
def test_other_item_types_are_400_naming_the_type(client, kind):
    refused(post(client, "/v1/responses", {"input": [{"type": kind, "content": "x"}]}), "input[0].type")


@pytest.mark.parametrize("item", [5, "x", [], None])
def test_items_that_are_not_objects_are_400_naming_them(client, item):
    refused(post(client, "/v1/responses", {"input": [item]}), "input[0]")


def test_odd_items_after_a_good_one_name_their_index(client):
    items = [{"role": "user", "content": "hi"}, {"role": "user", "content": [[]]}]
    refused(post(client, "/v1/responses", {"input": items}), "input[1].content[0]")


# -- empty lists ------------------------------------------------------------------------------------------------
def test_empty_tools_is_no_tools_on_responses(sdk):
    """What the OpenAI Agents SDK sends for an agent without tools (tools [], include [])."""
    r = sdk.responses.create(model="tiny", input="hi", tools=[], include=[], max_output_tokens=2)
    assert r.tools == [] and r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:  # as OpenAI: nothing to require
        sdk.responses.create(model="tiny", input="hi", tools=[], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_empty_tools_is_refused_on_chat_as_openai_does(sdk):
    """OpenAI's chat completions answer `Invalid 'tools': empty array` (code empty_array) to this."""
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[])
    assert e.value.body["param"] == "tools"


def test_empty_stop_is_accepted(sdk):
    r = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stop=[],
                                    max_tokens=2)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


# -- metadata and identifiers within OpenAI's limits --------------------------------------------------------------
@pytest.mark.parametrize(
    "metadata, ok",
    [
        ({f"k{i}": "v" for i in range(16)}, True),
        ({f"k{i}": "v" for i in range(17)}, False),
        ({"k" * 64: "v" * 512}, True),
        ({"k" * 65: "v"}, False),
        ({"k": "v" * 513}, False),
        ({str(i): "v" for i in range(1000)}, False),
    ],
    ids=["16-pairs", "17-pairs", "at-limits", "long-key", "long-value", "1000-pairs"],
)
def test_metadata_within_openai_limits(client, sdk, metadata, ok):
    kw = dict(model="tiny", max_output_tokens=2, metadata=metadata)
    if ok:
        assert sdk.responses.create(input="hi", **kw).metadata == metadata
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    metadata=metadata)  # fmt: skip
    else:
        refused(post(client, "/v1/responses", {"input": "hi", "metadata": metadata}), "metadata")
        refused(post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "metadata": metadata}), "metadata")  # fmt: skip


def test_safety_identifier_within_128_characters(client, sdk):
    sdk.responses.create(model="tiny", input="hi", max_output_tokens=2, safety_identifier="s" * 128)
    refused(
        post(client, "/v1/responses", {"input": "hi", "safety_identifier": "s" * 129}), "safety_identifier"
    )


# -- what an error quotes is bounded ----------------------------------------------------------------------------
HUGE = "x" * (4 << 20)


def test_a_4mb_previous_response_id_is_not_echoed(client):
    refused(
        post(client, "/v1/responses", {"input": "hi", "previous_response_id": HUGE}), "previous_response_id"
    )


def test_long_ids_in_the_path_are_not_echoed(client):
    long_id = "resp_" + "x" * 60_000
    for method in ("GET", "DELETE"):
        err = refused(client.request(method, f"/v1/responses/{long_id}", headers=AUTH), status=404)
        assert len(err["message"]) <= 1000


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": HUGE, "input": "hi"}, None),  # an unknown model, quoted
        ({"input": "hi", HUGE: 1}, None),  # an unknown field, named
        ({"input": [{"role": HUGE, "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": HUGE}]}, "input[0].type"),
        ({"input": "hi", "tool_choice": {"type": HUGE}}, "tool_choice"),
        ({"input": "hi", "metadata": {HUGE: "v"}}, "metadata"),
    ],
    ids=["model", "field", "role", "type", "tool_choice", "metadata-key"],
)
def test_huge_values_are_quoted_short(client, body, param):
    r = client.post("/v1/responses", content=json.dumps({"model": "tiny", **body}), headers=AUTH)
    assert 400 <= r.status_code < 500, r.text[:300]
    err = refused(r, param, status=r.status_code)
    assert len(err["message"]) <= 1000 and len(err["param"] or "") <= 200
