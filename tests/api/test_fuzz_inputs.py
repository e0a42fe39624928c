"""Property-based tests of the inputs issue 31 found crashing the server: Responses input items, and vLLM's
load/unload_lora_adapter paths. Any JSON gets a 2xx or an OpenAI-shaped 4xx, never a 5xx.

hypothesis draws nearly valid bodies (the right shape, with any JSON value in any field: lists and objects
where strings belong, unknown item types, content parts of every kind) and server paths (NUL bytes, over-long
components, links out of the load directory, FIFOs, `..`, relative and `~` paths), in-process on a tiny random
model. Bounded in examples, as tests/api/test_fuzz.py is, so the suite stays in CI's time.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motet.actors.system import ServingSystem
from motet.api.adapters.store import AdapterStore
from motet.api.auth import Authenticator
from motet.api.responses.store import ResponseStore
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.peft_adapters import make_adapter
from tests.served_app import served_app

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
AUTH = {"Authorization": "Bearer k1", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The app, a first stored response (so previous_response_id can find one), and a load directory with
    an adapter, links out of it, a FIFO and a file where a directory belongs."""
    tmp = tmp_path_factory.mktemp("fuzz-inputs")
    load = tmp / "load"
    make_adapter(tiny_model_dir, load / "real", seed=0)
    make_adapter(tiny_model_dir, tmp / "outside", seed=1)
    os.symlink(tmp / "outside", load / "escape")
    (load / "links").mkdir()
    (load / "fifo").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.symlink(tmp / "outside" / name, load / "links" / name)
    os.mkfifo(load / "fifo" / "adapter_config.json")
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=8, max_model_len=1024,
                       max_lora_rank=8)  # fmt: skip
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    adapters = AdapterStore(system, tmp / "data", reserved=("tiny",), max_bytes=1 << 20, load_dirs=(load,))
    state = ServerState(system, ["tiny"], auth=Authenticator({"k1": "alice"}), adapters=adapters,
                        responses=ResponseStore(tmp / "data"))  # fmt: skip
    with served_app(state, raise_server_exceptions=False) as c:
        first = c.post(
            "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2}, headers=AUTH
        )
        assert first.status_code == 200, first.text
        c.load_dir, c.first_id = load, first.json()["id"]
        yield c
        assert c.get("/health").status_code == 200


def never_5xx(r) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:500]


def send(server, path: str, body) -> None:
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    never_5xx(server.post(path, content=data, headers=AUTH))


# -- Responses input items ------------------------------------------------------------------------------------
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def odd(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `valid`, sometimes any JSON value (a list or an object where a string belongs, ...)."""
    return st.one_of(valid, valid, json_value)


part = st.fixed_dictionaries(
    {
        "type": odd(
            st.sampled_from(["input_text", "output_text", "refusal", "summary_text", "input_image", "x"])
        )
    },
    optional={
        "text": odd(st.text(max_size=20)),
        "refusal": odd(st.text(max_size=8)),
        "annotations": json_value,
        "logprobs": json_value,
        "detail": json_value,
    },
)
content = odd(st.text(max_size=30) | st.lists(odd(part), max_size=3))
item = st.fixed_dictionaries(
    {},
    optional={
        "type": odd(st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search_call"])),
        "role": odd(st.sampled_from(["user", "system", "developer", "assistant", "tool"])),
        "content": content,
        "call_id": odd(st.sampled_from(["c1", "c2"])),
        "name": odd(st.sampled_from(["f", "g"])),
        "arguments": odd(st.sampled_from(["{}", '{"a": 1}', "not json"])),
        "output": content,
        "id": odd(st.text(max_size=8)),
        "status": odd(st.sampled_from(["completed", "in_progress"])),
        "summary": json_value,
        "encrypted_content": json_value,
        "phase": json_value,
        "cache_control": json_value,
    },
)  # fmt: skip
tool = st.fixed_dictionaries(
    {"type": odd(st.just("function")), "name": odd(st.sampled_from(["f", "g", ""]))},
    optional={
        "parameters": odd(st.just({"type": "object"})),
        "strict": json_value,
        "description": json_value,
    },
)


@st.composite
def responses_body(draw) -> dict:
    body = {
        "model": "tiny",
        "input": draw(odd(st.text(min_size=1, max_size=20) | st.lists(odd(item), min_size=1, max_size=4))),
        "max_output_tokens": draw(st.integers(1, 3)),
    }
    optional = {
        "instructions": odd(st.text(max_size=20)),
        "tools": odd(st.lists(tool, max_size=2)),
        "tool_choice": odd(st.sampled_from(["auto", "none", "required"])),
        "previous_response_id": st.sampled_from(["first", "resp_nope"]) | json_value,
        "text": odd(st.fixed_dictionaries({"format": odd(st.fixed_dictionaries({"type": odd(st.just("text"))}))})),
        "metadata": odd(st.dictionaries(st.text(max_size=70), st.text(max_size=10), max_size=18)),
        "store": odd(st.booleans()),
        "include": odd(st.just([])),
    }  # fmt: skip
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        body[key] = draw(optional[key])
    return body


@given(body=responses_body())
@settings(max_examples=150, **SETTINGS)
def test_responses_bodies_never_answer_5xx(server, body):
    if body.get("previous_response_id") == "first":
        body["previous_response_id"] = server.first_id
    send(server, "/v1/responses", body)


# -- load / unload paths -----------------------------------------------------------------------------------------
component = st.one_of(
    st.sampled_from(["real", "links", "escape", "fifo", "missing", "..", ".", "", "adapter_config.json"]),
    st.text(max_size=10),
    st.text(alphabet="a\x00é/~\udc80", max_size=8),
    st.integers(250, 300).map(lambda n: "x" * n),  # around NAME_MAX
)


@st.composite
def server_path(draw):
    kind = draw(st.sampled_from(["under", "under", "absolute", "relative", "home", "json"]))
    if kind == "json":
        return draw(json_value)
    parts = draw(st.lists(component, max_size=4))
    tail = "/".join(parts)
    return {"under": f"{{load}}/{tail}", "absolute": f"/{tail}", "relative": tail, "home": f"~{tail}"}[kind]


names = odd(st.sampled_from(["a", "b.c", "tiny", "..", ""]) | st.text(max_size=70))


@given(
    lora_name=names,
    lora_path=server_path(),
    extra=st.dictionaries(st.sampled_from(["load_inplace", "base_model_name"]), json_value, max_size=1),
)
@settings(max_examples=150, **SETTINGS)
def test_load_lora_adapter_never_answers_5xx(server, lora_name, lora_path, extra):
    if isinstance(lora_path, str):
        lora_path = lora_path.replace("{load}", str(server.load_dir))
    send(server, "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, **extra})
    send(server, "/v1/unload_lora_adapter", {"lora_name": lora_name})  # fmt: skip


@given(
    body=st.dictionaries(
        st.sampled_from(["lora_name", "lora_path", "lora_int_id", "x"]), json_value, max_size=3
    )
)
@settings(max_examples=50, **SETTINGS)
def test_any_load_or_unload_body_never_answers_5xx(server, body):
    send(server, "/v1/load_lora_adapter", body)
    send(server, "/v1/unload_lora_adapter", body)
