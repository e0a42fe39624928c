"""outlines-core's JSON-schema-to-regex conversion, run in a helper process (motet/helper_process.py).

`build_regex_from_schema` holds the GIL for as long as it runs, and on schemas with many nested
`$ref`s it runs for minutes and builds regexes of gigabytes (Kubernetes schemas in JSONSchemaBench):
in-process, that would freeze every thread of the engine, time limits included. The helper is killed when it
overruns `timeout_s`, and caps its own memory so a blow-up ends in a clean error.
"""

from __future__ import annotations

import threading

from motet.grammar.specs import GrammarError
from motet.helper_process import HelperFailure, HelperProcess, limit_memory
from motet.helper_process import serve as serve_requests

MEMORY_LIMIT_BYTES = 4 << 30
TIMEOUT_S = 20.0


def serve() -> None:
    """The helper process: read requests from stdin, answer on stdout."""
    limit_memory(MEMORY_LIMIT_BYTES)
    from outlines_core import json_schema

    def answer(req: dict) -> dict:
        regex = json_schema.build_regex_from_schema(req["schema"], req["whitespace"], req["depth"])
        if len(regex) > req["max_chars"]:
            return {"error": f"too complex (regex of {len(regex)} chars > {req['max_chars']})"}
        return {"regex": regex}

    serve_requests(answer)


class RegexWorker:
    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self._helper = HelperProcess("from motet.grammar.regex_worker import serve; serve()")

    def build(self, schema: str, whitespace: str, depth: int, max_chars: int) -> str:
        """The regex of a JSON schema (text), or GrammarError("unsupported" / "timeout")."""
        req = {"schema": schema, "whitespace": whitespace, "depth": depth, "max_chars": max_chars}
        try:
            resp = self._helper.ask(req, self.timeout_s)
        except HelperFailure as e:
            if e.kind == "timeout":
                raise GrammarError(
                    f"outlines: converting the JSON schema took longer than {self.timeout_s:g}s", "timeout"
                ) from None
            if e.kind == "died":
                raise GrammarError("outlines: the regex helper process died", "unsupported") from None
            raise GrammarError(
                "outlines: converting the JSON schema crashed (likely out of memory: too complex)",
                "unsupported",
            ) from None
        if "error" in resp:
            raise GrammarError(f"outlines cannot convert this JSON schema: {resp['error']}", "unsupported")
        return resp["regex"]

    def close(self) -> None:
        """Stop the helper process."""
        self._helper.close()


_worker: RegexWorker | None = None
_worker_lock = threading.Lock()


def regex_worker() -> RegexWorker:
    """The process-wide helper."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = RegexWorker()
        return _worker


def shutdown() -> None:
    """Stop the helper if one was started (for processes that leave with os._exit)."""
    if _worker is not None:
        _worker.close()
