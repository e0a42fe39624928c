"""Errors a request can fail with inside the actors; the API maps each to its HTTP status."""

from __future__ import annotations


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
