"""The Batch API's JSONL formats (OpenAI's, which `vllm run-batch` reads too), shared by the server's batches
and `motet run-batch`.

An input line is `{"custom_id", "method": "POST", "url", "body"}`. An answered line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`: 2xx responses go
to the output file, the others (a body the endpoint refuses, with its 4xx and OpenAI error body) to the error
file. A line that could not be sent at all (not JSON, no custom_id, a custom_id used before, another url or
method, a body past a request body's bounds: `motet/json_input.py`'s) is answered in the error file as
`{"response": null, "error": {"code", "message"}}`, as are lines a cancelled or expired batch never ran
(`batch_cancelled`, `batch_expired`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from motet import json_input
from motet.api.errors import MESSAGE_CHARS, APIError, echo, shorten

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LINES = 50_000  # requests in one batch, as OpenAI's
MAX_CUSTOM_ID_CHARS = 512
RETRIED_STATUSES = frozenset({429, 503, 507})  # the server is busy, starting, draining or out of space: not
# the line's fault, so it is sent again later instead of answered
_LINE_KEYS = ("custom_id", "method", "url", "body")

CANCELLED = ("batch_cancelled", "This request was not executed because the batch was cancelled.")
EXPIRED = ("batch_expired", "This request could not be executed before the completion window expired.")


@dataclass
class Line:
    number: int  # its line in the file, from 1
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: tuple[str, str] | None = None  # (code, message): refused as written, never sent


def parse_lines(raw: Iterable[bytes], endpoint: str | None = None) -> Iterator[Line]:
    """The file's non-blank lines, each checked: sent to `endpoint` (None: to any of ENDPOINTS), with a
    custom_id no earlier line used."""
    seen: dict[str, int] = {}
    for number, data in enumerate(raw, 1):
        if not data.strip():
            continue
        line = _parse(number, data, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen:
                line.error = (
                    "duplicate_custom_id",
                    f"line {number}: custom_id {echo(line.custom_id)} is already used by line {seen[line.custom_id]}; "
                    "each request of a batch needs its own",
                )
            else:
                seen[line.custom_id] = number
        yield line


def _parse(number: int, data: bytes, endpoint: str | None) -> Line:
    def refused(code: str, message: str, custom_id: str | None = None) -> Line:
        return Line(number, custom_id, error=(code, f"line {number}: {message}"))

    try:  # read as a request body is (a line nested past what the parser can recurse is refused, not raised)
        obj = json_input.loads(data)
    except ValueError as e:
        return refused("invalid_json_line", str(e))
    if not isinstance(obj, dict):
        return refused("invalid_json_line", "not a JSON object")
    custom_id = obj.get("custom_id")
    if (
        not isinstance(custom_id, str)
        or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS
        or not _unicode(custom_id)
    ):
        return refused(
            "invalid_custom_id",
            f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters of valid Unicode",
        )
    if extra := [k for k in obj if k not in _LINE_KEYS]:
        return refused("invalid_request", f"unrecognized field {echo(extra[0])} (a line has {', '.join(_LINE_KEYS)})",
                       custom_id)  # fmt: skip
    if obj.get("method") != "POST":
        return refused("invalid_method", f"method must be 'POST', not {echo(obj.get('method'))}", custom_id)
    url = obj.get("url")
    allowed = (endpoint,) if endpoint is not None else ENDPOINTS
    if url not in allowed:
        return refused(
            "invalid_url", f"url must be {' or '.join(map(repr, allowed))}, not {echo(url)}", custom_id
        )
    if not isinstance(obj.get("body"), dict):
        return refused("invalid_body", "body must be a JSON object (the request)", custom_id)
    try:  # the body's bounds are a request body's (nesting, Unicode): refused here, named by its line
        json_input.check(obj["body"])
    except json_input.JSONBoundsError as e:
        at = f" (at body.{e.param})" if e.param and e.param not in str(e) else ""
        return refused("invalid_body", f"request body {e}{at}", custom_id)
    return Line(number, custom_id, url, obj["body"])


def _unicode(text: str) -> bool:
    try:
        json_input.check(text)  # (a lone surrogate escape parses, but no answer line could hold it)
    except ValueError:
        return False
    return True


# A line may ask for at most this many logprob entries (n x max_tokens x (1 + top_logprobs), and its prompt's
# with prompt_logprobs): each writes ~80 bytes, so a 6-line input asking for n=4, 128 tokens and 20 top
# logprobs wrote 4,976,028 bytes. Refused when the batch is created, before anything runs.
MAX_LINE_LOGPROB_ENTRIES = 8192
MAX_TOP_LOGPROBS = 20


def _count(value, default: int, high: int) -> int:
    """A request's count field as the bound reads it (validation refuses what is not an integer later)."""
    return min(max(value, 0), high) if isinstance(value, int) and not isinstance(value, bool) else default


def logprob_entries(line: Line, max_model_len: int) -> tuple[int, str]:
    """The most logprob entries `line`'s answer may hold, and how that count is made (for the 400)."""
    body = line.body or {}
    n = _count(body.get("n"), 1, 128)
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                  if body.get(k) is not None), None)  # fmt: skip
    tokens = _count(limit, max_model_len, max_model_len)  # omitted: the rest of the context
    logprobs = body.get("logprobs")
    if line.url == "/v1/completions":
        top = _count(logprobs, 0, MAX_TOP_LOGPROBS) if logprobs is not None else None
    else:
        top = _count(body.get("top_logprobs"), 0, MAX_TOP_LOGPROBS) if logprobs else None
    entries, how = 0, []
    if top is not None:
        entries += n * tokens * (1 + top)
        how.append(f"n ({n}) x max_tokens ({tokens}) x (1 + top_logprobs {top})")
    prompt_top = body.get("prompt_logprobs")
    if prompt_top is not None:  # a prompt has no more tokens than its request has bytes
        prompt = min(len(json.dumps(body)), max_model_len)
        entries += n * prompt * (1 + _count(prompt_top, 0, MAX_TOP_LOGPROBS))
        how.append(f"the prompt's (up to {prompt} tokens) x (1 + prompt_logprobs {prompt_top})")
    return entries, " + ".join(how)


def check_line_size(lines: Iterable[Line], max_model_len: int) -> APIError | None:
    """The 400 for the first line that asks for more logprob entries than a batch line may."""
    for line in lines:
        if line.body is None:
            continue
        entries, how = logprob_entries(line, max_model_len)
        if entries > MAX_LINE_LOGPROB_ENTRIES:
            return APIError(
                400,
                f"line {line.number}: {how} = {entries} logprob entries, over the {MAX_LINE_LOGPROB_ENTRIES} "
                "a batch line may ask for; lower n, max_tokens or top_logprobs",
                param="input_file_id",
                code="line_too_large",
            )
    return None


def refusal(body: dict) -> APIError | None:
    """What a batch refuses of a body that the endpoint itself would accept."""
    if body.get("stream") not in (None, False):
        return APIError(
            400, "stream: a batch request is answered whole; it cannot be streamed", param="stream"
        )
    return None


def response_line(custom_id: str | None, status: int, body) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, code: str, message: str) -> dict:
    """A line answered without a response; its message is bounded as an APIError's (it counts against the
    tenant's files quota, and may quote what the line held)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": shorten(message, MESSAGE_CHARS)},
    }


def succeeded(result: dict) -> bool:
    """Whether an answered line belongs in the output file (else: the error file)."""
    response = result.get("response")
    return response is not None and 200 <= response["status_code"] < 300


@dataclass
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def of(cls, result: dict) -> Usage:
        """The tokens an answered line used (chat and completions' usage, or the Responses API's)."""
        body = (result.get("response") or {}).get("body")
        u = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(u, dict):
            return cls()
        if "input_tokens" in u:
            return cls(
                u.get("input_tokens") or 0,
                (u.get("input_tokens_details") or {}).get("cached_tokens") or 0,
                u.get("output_tokens") or 0,
                (u.get("output_tokens_details") or {}).get("reasoning_tokens") or 0,
            )
        return cls(
            u.get("prompt_tokens") or 0,
            (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            u.get("completion_tokens") or 0,
        )

    def object(self) -> dict:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def compact(obj) -> str:
    """JSON as a JSONL line holds it (no newline)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def dumps(obj) -> bytes:
    """One JSONL line."""
    return compact(obj).encode() + b"\n"
