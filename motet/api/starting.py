"""`motet serve`'s app while it starts: the port answers within a second of the command, the model loading beside it
(as llama.cpp's server does, issue 65).

`motet serve` checks what the flags and the model's config decide (motet/api/server.py `check_model`, the port bound,
`prepare`: each refusal one line and exit 2, before anything answers), then runs uvicorn on a `StartingApp` at once.
Its lifespan builds the API in a worker thread (`build`: the engine's and the API's modules, the stores, the serving system), then starts the
built app's own lifespan (the serving system starts; the engine loads on its thread) and hands every request to it.
Until then it answers itself, without the API's modules: GET /health and /ping 503 with llama.cpp's body and the
start-up's phase (`loading_body`), /version its version, every other route 503 "Loading model" with a Retry-After.
Once the built app answers, its own routes say the same while the engine loads (motet/api/state.py
`check_loaded`). A build that fails is logged in one line and ends the server (`on_failure`), never a 503 for ever.

This module imports no more than uvicorn needs (anyio): it runs before the API's modules are imported.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from motet.engine.weights import load_progress

LOADING_MESSAGE = "Loading model"  # llama.cpp's, with its type and code
LOADING_TYPE = "unavailable_error"
RETRY_AFTER_S = 5  # what a 503 while loading asks a client to wait (the openai SDK honours it)
STOP_TIMEOUT_S = 15.0  # the built app's shutdown (its serving system stopping), at most
PROBES = ("/health", "/ping")  # answered with the start-up's progress


def loading_body(progress: bool = False) -> dict:
    """The 503 body while the model loads: llama.cpp's error (`{"error": {"code": 503, "message": "Loading model",
    "type": "unavailable_error"}}`, with OpenAI's `param`), and for the health probes (`progress`) the start-up's
    phase ("loading the weights 12/30") and that phase's fraction done (null where it counts nothing)."""
    body: dict[str, Any] = {
        "error": {"message": LOADING_MESSAGE, "type": LOADING_TYPE, "param": None, "code": 503}
    }
    if progress:
        at = load_progress.current()
        body.update(status="loading", phase=str(at), fraction=at.fraction)
    return body


ASGIApp = Callable[..., Any]


class StartingApp:
    """The ASGI app uvicorn runs: `build()` (in a daemon thread of its own) makes the API's app, whose lifespan
    this one runs once built; `on_failure(error)` is told if either fails (the server then ends)."""

    def __init__(self, build: Callable[[], ASGIApp], on_failure: Callable[[BaseException], None]):
        self.build, self.on_failure = build, on_failure
        self.app: ASGIApp | None = None  # the built app, once its lifespan has started: it answers everything
        self._to_app: Any = None  # the built app's lifespan: its receive stream, and what it sent
        self._from_app: Any = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            return await self._answer(scope, send)
        if scope["type"] == "websocket":  # (the API has none)
            await send({"type": "websocket.close", "code": 1013})

    async def _answer(self, scope, send) -> None:
        path = scope.get("path", "")
        if path == "/version":
            from motet.version import __version__

            status, body, headers = 200, {"version": __version__}, []
        else:
            status, body = 503, loading_body(progress=path in PROBES)
            headers = [(b"retry-after", str(RETRY_AFTER_S).encode())]
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()), *headers]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    async def _lifespan(self, scope, receive, send) -> None:
        """uvicorn's lifespan: started at once (the port answers), the built app's started and stopped within it."""
        await receive()  # lifespan.startup
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._start, scope)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            with anyio.move_on_after(STOP_TIMEOUT_S, shield=True):
                await self._stop()
            tg.cancel_scope.cancel()  # a build under way is left to its thread (the process is ending)
        await send({"type": "lifespan.shutdown.complete"})

    async def _built(self) -> ASGIApp:
        """`build()`'s app, built in a daemon thread of its own (a server stopped meanwhile ends without waiting
        for it: anyio's worker threads would hold the process until it returned)."""
        token, done, box = anyio.lowlevel.current_token(), anyio.Event(), {}

        def work() -> None:
            try:
                box["app"] = self.build()
            except BaseException as e:
                box["error"] = e
            with contextlib.suppress(RuntimeError):  # (the loop is gone: the server stopped meanwhile)
                anyio.from_thread.run_sync(done.set, token=token)

        threading.Thread(target=work, name="motet-build", daemon=True).start()
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box["app"]

    async def _start(self, scope) -> None:
        try:
            app = await self._built()
        except Exception as e:
            self.on_failure(e)
            return
        self._to_app, app_receive = anyio.create_memory_object_stream(2)
        app_send, self._from_app = anyio.create_memory_object_stream(2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._run_lifespan, app, {**scope, "state": {}}, app_receive, app_send)
            await self._to_app.send({"type": "lifespan.startup"})
            answer = await self._from_app.receive()
            if answer["type"] != "lifespan.startup.complete":
                self.on_failure(RuntimeError(answer.get("message") or "the app's start-up failed"))
                return
            self.app = app

    async def _run_lifespan(self, app, scope, receive, send) -> None:
        async def receive_():
            return await receive.receive()

        async def send_(message):
            await send.send(message)

        try:
            await app(scope, receive_, send_)
        except Exception as e:  # (a lifespan that raises instead of sending .failed)
            await send.send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})

    async def _stop(self) -> None:
        """The built app's lifespan shutdown (its serving system stops), where it started."""
        if self.app is None or self._to_app is None:
            return
        await self._to_app.send({"type": "lifespan.shutdown"})
        while (await self._from_app.receive())["type"] not in (
            "lifespan.shutdown.complete",
            "lifespan.shutdown.failed",
        ):
            pass
