"""Pieces the pure ASGI middlewares share (motet/api/app.py, origin_guard.py, rate_limits.py, tracing.py,
usage.py)."""

from __future__ import annotations

# Set in the ASGI scope of the Batch API's lines (motet/api/in_process.py): the batch's tenant, named there rather
# than by a key (motet/api/batches/runner.py)
BATCH_SCOPE_KEY = "motet.batch"


def request_headers(scope) -> dict[str, str]:
    """A request's headers by lower-case name (ASGI gives them lower-cased, as bytes)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class StatusRecorder:
    """`send`, remembering the response's status (500 until one is sent: the app failed before answering)."""

    def __init__(self, send):
        self.send, self.status = send, 500

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)
