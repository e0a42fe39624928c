"""A keyless server (the quick start) cannot be driven from another web page: the requests a hostile page can
send without a CORS preflight (text/plain and multipart POSTs from a foreign Origin) and DNS rebinding (a
foreign Host) are refused, the page's own requests and non-browser clients pass, and `--allowed-origins` /
`--allowed-hosts` open exactly what they name. `motet serve` on loopback (tests/live_server.py), driven by
httpx with the headers a browser would send."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.live_server import ThreadServer
from tests.peft_adapters import make_adapter

EVIL = "http://attacker.example"


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loadable")
    make_adapter(tiny_model_dir, root / "a1", seed=1)
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dir, tmp_path_factory):
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-model-len", "256",
        "--data-dir", str(tmp_path_factory.mktemp("data")), "--lora-load-dir", str(adapter_dir),
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(tiny_model_dir, tmp_path_factory):
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-model-len", "256",
        "--data-dir", str(tmp_path_factory.mktemp("data")),
        "--allowed-origins", "http://app.example", "--allowed-hosts", "motet.internal",
    )  # fmt: skip
    yield srv
    srv.stop()


def models(srv) -> list[str]:
    return [m["id"] for m in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]]


def refused(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err["message"]


def test_cross_site_text_plain_post_cannot_unload_an_adapter(server, adapter_dir):
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "a1", "lora_path": str(adapter_dir / "a1")},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "a1" in models(server)
    body = json.dumps({"lora_name": "a1"})
    # A page's <form enctype="text/plain"> or fetch(..., {mode: "no-cors"}): a simple request, no preflight.
    page = {"Content-Type": "text/plain", "Origin": EVIL}
    message = refused(
        httpx.post(f"{server.url}/v1/unload_lora_adapter", content=body, headers=page), 403, "invalid_origin"
    )
    assert "--allowed-origins" in message
    # Without an Origin (a page cannot drop it; a script would be told what to send)
    message = refused(
        httpx.post(
            f"{server.url}/v1/unload_lora_adapter", content=body, headers={"Content-Type": "text/plain"}
        ),
        415,
        "unsupported_media_type",
    )
    assert "application/json" in message
    assert "a1" in models(server)  # nothing changed
    # The server's own page (same origin) and clients that send no Origin still work
    own = {"Origin": server.url}
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=own, timeout=60)
    assert r.status_code == 200, r.text
    assert "a1" not in models(server)


def test_cross_site_multipart_posts_are_refused(server):
    files = {"file": ("in.jsonl", b'{"custom_id": "1"}\n', "application/octet-stream")}
    r = httpx.post(f"{server.url}/v1/files", data={"purpose": "batch"}, files=files, headers={"Origin": EVIL})
    refused(r, 403, "invalid_origin")
    r = httpx.post(f"{server.url}/v1/adapters", data={"name": "x"}, files=files, headers={"Origin": "null"})
    refused(r, 403, "invalid_origin")  # a sandboxed frame or a file:// page
    assert httpx.get(f"{server.url}/v1/files").json()["data"] == []


def test_rebound_host_cannot_read(server):
    port = server.port
    message = refused(
        httpx.get(f"{server.url}/v1/files", headers={"Host": f"rebind.attacker.example:{port}"}),
        403,
        "invalid_host",
    )
    assert "--allowed-hosts rebind.attacker.example" in message
    # Same-origin to the rebound name is still the rebound name: refused on the Host
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={
            "Host": f"rebind.attacker.example:{port}",
            "Origin": f"http://rebind.attacker.example:{port}",
        },
    )
    refused(r, 403, "invalid_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", f"10.1.2.3:{port}"):
        assert httpx.get(f"{server.url}/v1/files", headers={"Host": host}).status_code == 200, host
    # Probes hold no data and are called by whatever name an orchestrator uses
    assert httpx.get(f"{server.url}/health", headers={"Host": "motet.svc.cluster.local"}).status_code == 200


def test_same_origin_page_and_sdk_clients_pass(server):
    import openai

    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Origin": server.url},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "access-control-allow-origin" not in r.headers  # CORS off unless configured
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.choices[0].message is not None


def test_static_page_has_the_pages_security_headers(server):
    for path in ("/", "/static/index.html"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"], path
        assert r.headers["x-content-type-options"] == "nosniff"


def test_allowed_origins_get_cors_and_others_do_not(open_server):
    url = open_server.url
    pre = httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Origin": "http://app.example"}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    refused(
        httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Origin": EVIL}), 403, "invalid_origin"
    )
    host = f"motet.internal:{open_server.port}"
    assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200
    refused(httpx.get(f"{url}/v1/models", headers={"Host": "other.internal"}), 403, "invalid_host")


def test_vllm_json_list_form_of_the_flags():
    from motet.api.cli import build_parser
    from motet.api.origin_guard import flat_list

    args = build_parser().parse_args(
        ["serve", "--allowed-origins", '["http://a.example", "http://b.example"]']
    )
    assert flat_list(args.allowed_origins) == ["http://a.example", "http://b.example"]
    with pytest.raises(ValueError, match="--allowed-origins"):
        flat_list(["[1, 2"], "--allowed-origins")
