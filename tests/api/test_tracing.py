"""OpenTelemetry traces (`--otlp-traces-endpoint`): every request of a mixed run (chat, stream, completions,
responses, an adapter, a JSON schema, errors) has one server span with the tenant and model, the successful ones
their queue / prefill / decode children inside it (and adapter_load / grammar_compile where the request has an
adapter or a grammar), and a client's W3C `traceparent` is continued. The spans are
exported by the real OTLP/HTTP exporter to a real receiver started by the test (OTLP protobuf over HTTP,
decoded with opentelemetry-proto)."""

from __future__ import annotations

import httpx
import openai

from motet.evals.otlp_receiver import OTLPReceiver
from tests.live_server import Server, keys_file
from tests.peft_adapters import make_adapter

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or v.bool_value
    return out


def test_every_request_has_one_span_with_its_phases(tiny_model_dir, tmp_path):
    receiver = OTLPReceiver()
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=5)
    files = [("files", (f.name, f.read_bytes())) for f in sorted(adapter.iterdir()) if f.name != "README.md"]
    srv = Server(
        tmp_path,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp_path, KEYS),
        "--data-dir", str(tmp_path / "data"), "--threads", "1", "--max-model-len", "1024",
        "--otlp-traces-endpoint", receiver.url,
        start_timeout=120,
    )  # fmt: skip
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        alice = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-alice", max_retries=0, timeout=120)
        bob = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-bob", max_retries=0, timeout=120)
        r = httpx.post(f"{srv.url}/v1/adapters", data={"name": "ad"}, files=files,
                       headers={"Authorization": "Bearer sk-alice"}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        msg = [{"role": "user", "content": "hi"}]
        alice.chat.completions.create(
            model=MODEL, messages=msg, max_tokens=3,
            extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )  # fmt: skip
        list(alice.chat.completions.create(model="ad", messages=msg, max_tokens=3, stream=True))
        bob.completions.create(model=MODEL, prompt="one two", max_tokens=2)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        bob.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})  # fmt: skip
        bob.responses.create(model=MODEL, input="hello", max_output_tokens=2)
        alice.chat.completions.create(model=MODEL, messages=msg, max_tokens=2, tools=[{"type": "function",
                                      "function": {"name": "f", "parameters": {"type": "object"}}}])  # fmt: skip
        for bad in ({"model": "nope"}, {"model": MODEL, "temperature": -1}):  # 404, 400
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": msg, **bad},
                           headers={"Authorization": "Bearer sk-alice"})  # fmt: skip
            assert r.status_code in (400, 404)
    finally:
        srv.stop()  # the exporter sends what is left when the server stops
    receiver.shutdown()
    roots = [s for s in receiver.spans if s.name.startswith("POST ")]
    assert len(roots) == 8
    children = [s for s in receiver.spans if not s.name.startswith("POST ")]
    by_parent: dict[bytes, list] = {}
    for s in children:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    statuses, ingress_phases = [], []
    for root in roots:
        a = attrs(root)
        statuses.append(a["http.response.status_code"])
        if a["http.response.status_code"] != 200:
            assert root.span_id not in by_parent
            continue
        assert a["motet.tenant"] in ("alice", "bob") and a["gen_ai.request.model"] in (MODEL, "ad")
        assert a["gen_ai.usage.output_tokens"] >= 1
        engine = {"queue", "prefill", "decode"}
        mine = by_parent[root.span_id]
        assert all(p.trace_id == root.trace_id for p in mine)
        ingress = sorted(p.name for p in mine if p.name not in engine)
        ingress_phases.append((a["gen_ai.request.model"], ingress))
        for p in mine:  # inside the request's span
            assert root.start_time_unix_nano <= p.start_time_unix_nano <= p.end_time_unix_nano
        phases = sorted((p for p in mine if p.name in engine), key=lambda s: s.start_time_unix_nano)
        assert [p.name for p in phases] == ["queue", "prefill", "decode"]
        assert root.start_time_unix_nano - 50_000_000 <= phases[0].start_time_unix_nano
        assert phases[-1].end_time_unix_nano <= root.end_time_unix_nano + 50_000_000
    assert sorted(statuses) == [200] * 6 + [400, 404]
    # The adapter's request read its files (not cached: the first use); the schema's compiled its grammar.
    assert ("ad", ["adapter_load"]) in ingress_phases
    assert sum(names == ["grammar_compile"] for _, names in ingress_phases) >= 1
    loads = [s for s in children if s.name == "adapter_load"]
    assert [attrs(s).get("motet.adapter.cached", False) for s in loads] == [False]
    continued = [s for s in roots if s.trace_id.hex() == trace_id]
    assert len(continued) == 1 and continued[0].parent_span_id.hex() == parent_id
    assert {attrs(s)["gen_ai.request.model"] for s in roots if "gen_ai.request.model" in attrs(s)} == {
        MODEL,
        "ad",
    }
