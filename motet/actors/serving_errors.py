"""Errors a request can fail with inside the actors; the API maps each to its HTTP status.

Why a request itself cannot be served (its fields, its adapter, its grammar, its chat template) is decided here,
wherever it is found: by `request_refusal` for the ingress preparing it (motet/actors/input_processor.py) and the
engine taking it (motet/actors/executor.py), by `model_not_found` for a replica whose shared store no longer has
its adapter (motet/cluster/replica.py). The refusals of load and lifecycle (a full queue's 429, a stopping
server's 503, no replica taking it) are raised where the queue, the system or the router is."""

from __future__ import annotations

import logging
import os

from motet.engine.request_checks import RequestError
from motet.grammar.specs import GrammarError
from motet.lora.adapter import AdapterError
from motet.lora.manager import AdapterRef, files_version

log = logging.getLogger("motet.adapters")


class ServingError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(ServingError):
    status = 400
    type = "invalid_request_error"


class QueueFull(ServingError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message, code="queue_full")
        self.retry_after = retry_after


class Unavailable(ServingError):
    """The server cannot take the request now (503)."""

    status = 503
    type = "service_unavailable"


class ServerBusy(Unavailable):
    """Too many grammar compilations are running past their time limit; try again shortly."""


class ShuttingDown(Unavailable):
    """The server is shutting down."""


class EngineFailure(ServingError):
    """The executor raised while running this request's batch (the others in it were re-run); a 500 server_error."""


class ModelNotFound(ServingError):
    """The request's adapter was deleted before the request was admitted."""

    status = 404
    type = "not_found_error"


def request_refusal(
    error: Exception, adapter: AdapterRef | None = None, param: str | None = None
) -> ServingError:
    """Why a request cannot be served, as its client should hear it, wherever it is refused (the ingress
    validating it, rendering its chat, loading its adapter or compiling its grammar; the engine taking it): its
    adapter's fault (404 or 400, `_adapter_refusal`), its grammar's (400 naming `param`; 503 where the tenant's own
    compilations past their time limit still run), the request's own (400: a RequestError names its field; another
    ValueError is `param`'s), else the server's (500)."""
    if isinstance(error, AdapterError) and adapter is not None:
        return _adapter_refusal(adapter, error)
    if isinstance(error, GrammarError):
        if error.reason == "busy":
            return ServerBusy(str(error), param=param)
        return InvalidRequest(f"{param}: {error}" if param else str(error), param=param)
    if isinstance(error, RequestError):
        return InvalidRequest(str(error), param=error.param, code=error.code)
    if isinstance(error, ValueError):
        return InvalidRequest(str(error), param=param)
    return EngineFailure(f"the request could not be started: {error}")


def model_not_found(model: str) -> ModelNotFound:
    """The 404 of a request whose adapter (the client's name for it: `model`) was deleted or replaced since the
    request named it."""
    return ModelNotFound(f"the model {model!r} does not exist", param="model", code="model_not_found")


def _adapter_refusal(ref: AdapterRef, error: AdapterError) -> ServingError:
    """Why a request's adapter does not load, as its tenant should hear it: 404 where it was deleted or replaced
    since the request named it; else 400 with the reason, the adapter's own fault (stored for another base model
    in a data directory the operator shares, over the server's rank or memory), never a 500 whose reason only
    the server's log knows. The reason names the adapter's files, not where the server keeps them."""
    if files_version(ref.path) != ref.version:
        return model_not_found(ref.model)
    where = str(ref.path)
    reason = str(error).replace(where + os.sep, "").replace(where, ref.model)
    log.warning("adapter %s does not load from %s: %s", ref.name, where, error)
    return InvalidRequest(
        f"the adapter {ref.model!r} cannot be served with this server's base model and limits: {reason}",
        param="model",
        code="adapter_mismatch",
    )
