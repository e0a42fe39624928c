"""Slow clients (issue 31, finding 9): raw sockets against a real server on loopback (the tiny model, the
uvicorn server `motet serve` builds), with 1 s limits. A client whose request head trickles in, or never
comes, or comes slowly on a kept-alive connection, gets 408 and its connection closed; so does one whose body
trickles or stalls (and its request is over: counted as a 408); a body sent with short pauses is served.
Both of uvicorn's HTTP parsers (httptools, h11) get the header limit.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from motet.api.slow_clients import header_timeout_protocol
from motet.evals.server import free_port
from tests.live_server import ThreadServer

SAFETY_S = 60  # a test waits at most this long for the server to act (it acts after ~1 s)
CHAT = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
).encode()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--threads", "1", "--num-kv-blocks", "64",
        "--request-header-timeout", "1", "--request-body-timeout", "1", "--request-body-min-rate", "1000",
    )  # fmt: skip
    yield srv
    srv.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=SAFETY_S)
    sock.settimeout(0.2)
    return sock


def trickle_until_closed(sock: socket.socket, drip: bytes | None) -> bytes:
    """Sends `drip` (one byte; None: nothing) every 0.2 s until the server closes; what it answered."""
    answer = b""
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if drip is not None:
                with contextlib.suppress(OSError):  # closed by the server while we dripped
                    sock.sendall(drip)
            continue
        except ConnectionResetError:
            break
        if not data:
            return answer  # EOF: the server closed the connection
        answer += data
    raise AssertionError(f"the server kept the slow connection open for {SAFETY_S} s; it answered {answer!r}")


def assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error", error


def count_408(server) -> float:
    return sum(
        v for k, v in server_metrics(server).items() if k.startswith("motet_requests_total{") and '"408"' in k
    )


def server_metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_trickled_headers_get_408_and_close(server):
    sock = connect(server.port)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
    assert_408(trickle_until_closed(sock, b"a"))


def test_a_connection_that_sends_nothing_is_closed(server):
    assert_408(trickle_until_closed(connect(server.port), None))


def test_slow_head_of_a_second_request_on_a_kept_alive_connection(server):
    sock = connect(server.port)
    sock.settimeout(SAFETY_S)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 "), first
    sock.settimeout(0.2)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
    assert_408(trickle_until_closed(sock, b"a"))


@pytest.mark.parametrize("drip", [b" ", None], ids=["trickled", "stalled"])
def test_slow_body_gets_408_and_ends_the_request(server, drip):
    before = count_408(server)
    sock = connect(server.port)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(CHAT) + 1000, CHAT[:10])
    )
    assert_408(trickle_until_closed(sock, drip))
    assert count_408(server) == before + 1  # the request's task is over


def test_a_body_with_short_pauses_is_served(server):
    sock = connect(server.port)
    sock.settimeout(SAFETY_S)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(CHAT)
    )
    for i in range(0, len(CHAT), 16):
        time.sleep(0.05)
        sock.sendall(CHAT[i : i + 16])
    answer = b""
    while data := sock.recv(65536):
        answer += data
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["object"] == "chat.completion"


def test_h11_parser_gets_the_header_limit_too():
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    port = free_port()
    config = uvicorn.Config(app, port=port, log_level="warning", http=header_timeout_protocol(1, H11Protocol))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SAFETY_S
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "ok"
        sock = connect(port)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        assert_408(trickle_until_closed(sock, b"a"))
    finally:
        srv.should_exit = True
        thread.join(30)
