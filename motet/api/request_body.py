"""Reading a request's JSON body with bounds: size (413), nesting depth, valid Unicode, no NaN/Infinity
(400, never a RecursionError's 500); and a multipart form's, bounded in size."""

from __future__ import annotations

import json

from starlette.requests import Request

from motet.api.errors import APIError, shorten

# A multipart form's headers and small parts (a file's purpose, an adapter's config file), on top of the limit
# of its files.
FORM_SLACK = 64 << 10
MAX_JSON_DEPTH = 64  # nesting of a request body; JSONSchemaBench's deepest schema nests 22 levels
KEY_CHARS = 40  # of each key where an error names a place in the body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_json(data, limit: int = MAX_JSON_DEPTH) -> None:
    """Bounded nesting, and text that is valid Unicode (a lone surrogate escape such as \\ud800 parses
    into a str that no tokenizer can encode, nor any file name hold). An explicit stack: deep input cannot
    recurse us. Errors name where (`param`, as `messages[0].content`)."""
    stack: list[tuple[object, int, tuple | None]] = [(data, 1, None)]  # (value, depth, where: (parent, key))
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = _param(where)
                at = f" at {param}" if param else ""
                raise APIError(
                    400, f"request body holds invalid Unicode (a lone surrogate escape){at}", param
                ) from None
        elif isinstance(value, dict | list):
            if depth > limit:
                raise APIError(400, f"request body is nested more than {limit} levels deep", _param(where))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                stack.append((key, depth, where))  # a key is checked as part of its object
                stack.append((child, depth + 1, (where, key)))


def _param(where: tuple | None) -> str | None:
    """A location on check_json's stack as a param (`input[0].content`), built only for an error, with
    each key readable (escaped) and short."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    out = ""
    for key in reversed(keys):
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            text = shorten(key.encode("utf-8", "backslashreplace").decode("utf-8"), KEY_CHARS)
            out += f".{text}" if out else text
    return out or None


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
        data = parse_json(body)
    except ValueError as e:
        raise APIError(400, f"request body is {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    check_json(data)
    return data


def parse_json(text: bytes | str):
    """JSON text parsed as a request body is: NaN and Infinity refused, and input nested deeper than the
    parser can recurse (about 1,000 levels) refused as nested past the limit rather than a RecursionError. A
    ValueError says why ("not valid JSON: ...", "nested more than 64 levels deep"). The nesting within the
    limit is `check_json`'s to check, on the part that is a request body."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)  # NaN, Infinity: not JSON
    except RecursionError:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not valid JSON: {e}") from None


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
