"""/metrics under --api-keys (issue 31, finding 7): it names every tenant's running adapters, so only an admin
key reads it. A real server on loopback (the tiny model, the flags `motet serve` parses) while tenant alice's
adapter runs: no key or an unknown one is 401, a tenant's key (bob's, and alice's own) 403, the admin key reads
everything, parsed by prometheus_client's parser; an admin-only key runs no requests. And the keys file's
shapes, with errors naming the file."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motet.api.auth import Authenticator
from motet.api.errors import APIError
from motet.kernels import cpu_native
from tests.live_server import ThreadServer, keys_file
from tests.peft_adapters import make_adapter

KEYS = {
    "sk-alice": "alice",
    "sk-bob": "bob",
    "sk-scrape": {"admin": True},  # what Prometheus scrapes with
    "sk-ops": {"tenant": "ops", "admin": True},
}
ADAPTER = "alices-secret-adapter"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-access")
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--api-keys", keys_file(tmp, KEYS),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--num-kv-blocks", "256", "--max-loras", "1",
    )  # fmt: skip
    path = make_adapter(tiny_model_dir, tmp / "adapter", seed=1)
    files = [
        ("files", (f, (path / f).read_bytes())) for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = httpx.post(f"{srv.url}/v1/adapters", data={"name": ADAPTER}, files=files, headers=bearer("sk-alice"))
    assert r.status_code == 200, r.text
    yield srv
    srv.stop()


def lora_labels(text: str) -> dict:
    """The labels of vLLM's LoRA info series, read with prometheus_client's parser."""
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert any(s.name.startswith("motet_") for s in samples)
    (info,) = [s for s in samples if s.name == "vllm:lora_requests_info"]
    return info.labels


def test_only_an_admin_key_reads_metrics_while_another_tenants_adapter_runs(server):
    body = {
        "model": ADAPTER,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=bearer("sk-alice")) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        while '"content":""' in (line := next(lines)) or not line:  # to the first token: it runs now
            pass

        for headers in ({}, bearer("sk-nobody"), {"Authorization": "Basic sk-scrape"}):
            r = client.get("/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        for key in ("sk-bob", "sk-alice"):  # a tenant's key sees nothing, its own tenant's figures included
            r = client.get("/metrics", headers=bearer(key))
            assert r.status_code == 403, r.text
            assert ADAPTER not in r.text and r.json()["error"]["code"] == "admin_key_required"

        for key in ("sk-scrape", "sk-ops"):
            r = client.get("/metrics", headers=bearer(key))
            assert r.status_code == 200, r.text
            labels = lora_labels(r.text)
            assert labels["model_name"] == "tiny"  # as on every other vLLM series: dashboards filter on it
            in_use = labels["running_lora_adapters"].split(",") + labels["waiting_lora_adapters"].split(",")
            assert ADAPTER in in_use, labels


def test_a_tenant_keys_403_names_the_route_it_asked_for(server):
    """Issue 48, finding 5: a tenant's key on GET /v1/usage was told that "GET /metrics needs an admin key"."""
    for path, params in (("/v1/usage", {"start_time": 0}), ("/metrics", {})):
        r = httpx.get(f"{server.url}{path}", params=params, headers=bearer("sk-bob"), timeout=10)
        error = r.json()["error"]
        assert r.status_code == 403 and error["code"] == "admin_key_required", r.text
        other = "/metrics" if path == "/v1/usage" else "/v1/usage"
        assert f"GET {path} needs an admin key" in error["message"] and other not in error["message"]


def test_admin_only_key_runs_no_requests_and_an_admin_tenant_key_does(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=bearer("sk-scrape"), timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key", r.text
    assert "/v1/usage" in r.json()["error"]["message"]  # what an admin key is for: all of it
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=bearer("sk-ops"), timeout=60)
    assert r.status_code == 200, r.text
    models = httpx.get(f"{server.url}/v1/models", headers=bearer("sk-ops"), timeout=10).json()
    assert ADAPTER not in [m["id"] for m in models["data"]]  # ops is a tenant of its own


def test_auth_off_leaves_metrics_open():
    Authenticator().check_admin(None, "GET /metrics")  # no keys: nothing to check, as before


@pytest.mark.parametrize(
    "value",
    [
        {"admin": False},
        {},
        {"tenant": ""},
        {"tenant": 3},
        {"admin": "yes"},
        {"tenant": "a", "role": "x"},
        5,
        "",
    ],
)
def test_bad_key_entries_name_the_file(tmp_path, value):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-x": value}))
    with pytest.raises(ValueError, match=r"--api-keys .*keys\.json: each key maps to a tenant name"):
        Authenticator.from_file(path)


def test_keys_nested_too_deeply_are_one_line(tmp_path):
    """A keys file nested 200,000 deep: the one line of a file that does not read, not a RecursionError."""
    path = tmp_path / "keys.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=r"--api-keys .*keys\.json: cannot read a JSON object"):
        Authenticator.from_file(path)


def test_key_entries():
    auth = Authenticator({"a": "alice", "b": {"tenant": "bob"}, "c": {"admin": True}})
    assert auth.tenant("Bearer a") == "alice" and auth.tenant("bearer b") == "bob"
    with pytest.raises(APIError) as e:
        auth.check_admin("Bearer b", "GET /metrics")
    assert e.value.status == 403
    auth.check_admin("Bearer c", "GET /metrics")


def calls_made(fn) -> int:
    """How many Python and C functions `fn()` calls (sys.setprofile's call events): work, not wall time."""
    import sys

    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_a_requests_key_lookup_does_not_grow_with_the_keys():
    """Issue 48, finding 4: each request compared its key with every key (and the Batch API's runner looked for a
    tenant's key through that, per key: 10,000 keys stalled the event loop 25 s). A request's work is the same
    with 10,000 keys as with 10, and so is finding a tenant's key."""

    def auth_of(count: int) -> Authenticator:
        keys = {f"sk-{i:05d}": f"tenant-{i}" for i in range(count)} | {"sk-ops": {"admin": True}}
        return Authenticator(keys)

    def per_request(auth: Authenticator, last: int) -> int:
        key, tenant = f"sk-{last:05d}", f"tenant-{last}"

        def request():
            assert auth.tenant(f"Bearer {key}") == tenant  # the middleware's lookup, then the route's
            assert auth.caller(f"Bearer {key}").tenant == tenant
            auth.check_admin("Bearer sk-ops", "GET /v1/usage")
            assert auth.key_of(tenant) == key  # the key a tenant's batch lines are sent with
            with pytest.raises(APIError):
                auth.principal("Bearer sk-nobody")

        return calls_made(request)

    few, many = auth_of(10), auth_of(10_000)
    assert per_request(many, 9_999) == per_request(few, 9)


def test_metrics_name_the_native_cpu_kernels_tier(server):
    """The native CPU step's instruction-set tier (docs/cpu.md) as an info series; none where the step does not
    run (no compiler here)."""
    r = httpx.get(f"{server.url}/metrics", headers=bearer("sk-scrape"), timeout=10)
    samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
    info = [(s.labels, s.value) for s in samples if s.name == "motet_cpu_kernels_info"]
    assert info == ([({"isa": cpu_native.isa()}, 1.0)] if cpu_native.library() is not None else [])
