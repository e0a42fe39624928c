"""A request to the app itself, in process (the Batch API's lines, a fine-tuning job's eval file): the same
validation, the same serving path, the same answers as over HTTP, run as a tenant named in the ASGI scope."""

from __future__ import annotations

import anyio

from motet.api.asgi import BATCH_SCOPE_KEY


async def call_route(app, path: str, body: bytes, tenant: str) -> tuple[int, dict[str, str], bytes]:
    """POST `body` to `path` of the ASGI app, in process, as a batch line of `tenant`: (status, headers, body).
    The scope names the tenant (an HTTP request cannot set a scope key), so the line carries no API key."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
        "client": ("127.0.0.1", 0), "server": ("motet-batch", 0), BATCH_SCOPE_KEY: tenant,
    }  # fmt: skip
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # the "client" never leaves: the request runs to its end

    status, out_headers, chunks = 500, {}, []

    async def send(message):
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, out_headers, b"".join(chunks)
