"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from motet.actors.serving_errors import ServingError

if (
    TYPE_CHECKING
):  # (only its type: errors.py is imported by every module of the API, the grammar's checks by few)
    from motet.grammar.structure import StructureError

log = logging.getLogger("motet.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


RETRY_AFTER_503_S = 5
UNSUPPORTED_FIELD = "unsupported_field"  # the validation error type of a field motet cannot honour

# Bounds on what an error sends back: a request's value is echoed in at most ECHO_CHARS characters, and a
# whole message or param in at most MESSAGE_CHARS / PARAM_CHARS (a 4 MB id or key is never sent back).
ECHO_CHARS = 100
MESSAGE_CHARS = 1000
PARAM_CHARS = 200
ELLIPSIS = "…"


def shorten(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, its middle replaced by an ellipsis (the head names the
    value, the tail ends the sentence)."""
    if len(text) <= limit:
        return text
    tail = limit // 5
    return text[: limit - tail - 1] + ELLIPSIS + text[len(text) - tail :]


def echo(value) -> str:
    """A request's value as an error message quotes it: its repr, at most ECHO_CHARS characters."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 1] + ELLIPSIS


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message = shorten(message, MESSAGE_CHARS)  # whatever a message quotes, it stays small
        param = None if param is None else shorten(param, PARAM_CHARS)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        if status == 503 and "Retry-After" not in (headers or {}):  # a 503 always says when to come back
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_503_S)}
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_serving_error(e: ServingError) -> APIError:
    retry_after = getattr(e, "retry_after", None)  # QueueFull, ServerBusy
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return APIError(e.status, e.message, e.param, e.code, e.type, headers)


def from_validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    field = (err.get("ctx") or {}).get("field") if err["type"] == UNSUPPORTED_FIELD else None
    loc = err["loc"] + ((field,) if field else ())  # a field validator's own location names the field
    param = ".".join(str(p) for p in loc) or None
    if err["type"] == "extra_forbidden":  # OpenAI's wording: a field is never silently ignored
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{err['msg']}", param=param)


def from_structure_error(e: StructureError) -> APIError:
    """A request's structured-output or tool field that is wrong (motet/grammar/structure.py): 400 naming it."""
    return APIError(400, e.message, param=e.param, code=e.code)


def from_value_error(e: ValueError, fields=()) -> APIError:
    """Engine ValueErrors start with the parameter they are about ("temperature must be >= 0 ...")."""
    message = str(e)
    first = message.split(" ", 1)[0].rstrip(":,")
    return APIError(400, message, param=first if first in fields else None)


def to_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, ServingError):
        return from_serving_error(exc).response()
    if isinstance(exc, ValidationError):
        return from_validation_error(exc).response()
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, exc.detail or "error", headers=exc.headers).response()
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}").response()


async def handle_exception(request: Request, exc: Exception) -> JSONResponse:
    return to_response(exc)
