"""The app `motet serve` builds, served in-process by Starlette's TestClient (no port, no subprocess), for the
fast API tests: the client is handed out once the engine is warm and /health answers 200."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.testclient import TestClient

from motet.api.app import create_app, routes
from motet.api.openapi import document
from motet.api.state import ServerState
from motet.engine.weights.model_store import DEFAULT_MODEL


@functools.cache
def openapi_schema(model: str = DEFAULT_MODEL) -> dict:
    """The OpenAPI document of the app's routes (motet/api/app.py `routes()`), as GET /openapi.json answers it
    for a server serving `model`."""
    return document(routes(), model)


def wait_healthy(client: TestClient, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@contextmanager
def served_app(state: ServerState, *, raise_server_exceptions: bool = True) -> Iterator[TestClient]:
    """`raise_server_exceptions=False`: a handler's exception is answered as a 500 (what a real server does)."""
    with TestClient(create_app(state), raise_server_exceptions=raise_server_exceptions) as client:
        wait_healthy(client)
        yield client
