"""Reading a request's JSON body with bounds: size (413), and `motet/json_input.py`'s guard (nesting depth,
valid Unicode, no NaN/Infinity: 400, never a RecursionError's 500); and a multipart form's, bounded in size."""

from __future__ import annotations

from starlette.requests import Request

from motet import json_input
from motet.api.errors import APIError, shorten

# A multipart form's headers and small parts (a file's purpose, an adapter's config file), on top of the limit
# of its files.
FORM_SLACK = 64 << 10
MAX_JSON_DEPTH = json_input.MAX_DEPTH


def check_json(data, limit: int = MAX_JSON_DEPTH) -> None:
    """A request body's bounds (`motet/json_input.py`'s: nesting, valid Unicode): a 400 naming where."""
    try:
        json_input.check(data, limit)
    except json_input.JSONBoundsError as e:
        raise APIError(400, f"request body {e}", e.param) from None


def check_json_type(content_type: str | None) -> None:
    """A JSON body must say so: `text/plain`, form and multipart posts are what a page on another site can
    send without a CORS preflight (415 otherwise; `application/json`, or any `+json` type, with parameters)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        got = f"got {shorten(media, 60)!r}" if media else "none was sent"
        raise APIError(
            415,
            f"request body must be sent with Content-Type: application/json ({got})",
            code="unsupported_media_type",
        )


async def read_json(request: Request, limit: int) -> dict:
    check_json_type(request.headers.get("content-type"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
    try:
        data = json_input.loads(body)
    except ValueError as e:
        raise APIError(400, f"request body is {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    check_json(data)
    return data


def bounded_form(request: Request, max_bytes: int, too_large: APIError, max_files: int, max_fields: int):
    """The request's multipart form (an async context manager, as `Request.form`), its body at most
    `max_bytes` + FORM_SLACK: `too_large` is raised where its content-length says more, or as soon as more has
    been read (so a body without content-length is bounded too)."""
    limit = max_bytes + FORM_SLACK
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    seen = 0

    async def receive():  # counts what is read
        nonlocal seen
        message = await request.receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise too_large
        return message

    return Request(request.scope, receive).form(max_files=max_files, max_fields=max_fields)
