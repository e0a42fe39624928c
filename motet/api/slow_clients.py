"""Time limits for clients that send their request slowly (slowloris): each such connection holds a socket,
a parser and, once its headers are in, a task, so without a limit a few trickling clients exhaust the server.

- Headers: uvicorn times out idle keep-alive connections but not a request's head. `header_timeout_protocol`
  subclasses uvicorn's HTTP protocol (httptools or h11, whichever uvicorn picked) with a timer, armed when a
  connection opens or the first byte of a later request arrives, and disarmed once the request's headers are
  complete: when it fires the client gets `408 Request Timeout` and the connection is closed.
- Bodies: `BodyTimeout`, an ASGI middleware, bounds the time the app waits in `receive()` for the body (the
  time the app itself takes between reads is not the client's): `timeout` seconds, plus one second for each
  `min_rate` bytes received, so a large body sent at a fair rate passes and a trickle does not. Over it, the
  read raises a 408 APIError (the handlers answer it like any error) with `Connection: close`.
"""

from __future__ import annotations

import functools
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

# anyio and motet.api.errors (starlette, pydantic) are imported where used: `motet serve --help` reads the
# defaults below and stays fast.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_MIN_RATE = 10_000  # bytes/s: a request body slower than this on average times out


def request_timeout(message: str):
    """The 408 APIError, closing the connection (what is left of the request is never read)."""
    from motet.api.errors import APIError

    return APIError(
        408, message, type="invalid_request_error", code="request_timeout", headers={"Connection": "close"}
    )


def header_timeout_protocol(timeout: float, base: type[asyncio.Protocol] | None = None) -> type:
    """uvicorn's HTTP protocol class (`base`, default: the one uvicorn picks) with a limit on request heads."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol

    @functools.cache
    def response() -> bytes:  # (made at the first timeout: the server answers before the API's modules load)
        body = json.dumps(
            request_timeout(f"the request's headers did not arrive within {timeout:g} s").body()
        ).encode()
        return (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )

    class HeaderTimeoutProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        def _between_requests(self) -> bool:
            # uvicorn's protocols hold the current request's cycle: none yet, or its response sent.
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._header_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.write(response())
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete: its app task runs
                self._disarm()
            if self._between_requests() and not self.transport.is_closing():
                self._arm()  # bytes of the next request's head (a no-op when the timer runs already)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


class BodyTimeout:
    """Pure ASGI middleware: the time spent waiting for a request's body is bounded (see the module doc)."""

    def __init__(self, app, timeout: float = DEFAULT_BODY_TIMEOUT_S, min_rate: float = DEFAULT_BODY_MIN_RATE):
        self.app, self.timeout, self.min_rate = app, timeout, min_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        import anyio

        waited, received, complete = 0.0, 0, False

        async def bounded_receive():
            nonlocal waited, received, complete
            if complete:  # the body is in: what follows is a wait for the disconnect, unbounded
                return await receive()
            budget = self.timeout + received / self.min_rate - waited
            start = time.monotonic()
            with anyio.move_on_after(budget) as wait:
                message = await receive()
            waited += time.monotonic() - start
            if wait.cancelled_caught:
                raise request_timeout(
                    f"the request body arrived too slowly: {received} bytes in {waited:.0f} s (the limit: "
                    f"{self.timeout:g} s plus 1 s per {self.min_rate:g} bytes)"
                )
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        return await self.app(scope, bounded_receive, send)
