"""outlines-core's JSON-schema-to-regex conversion, run in a helper process.

`build_regex_from_schema` holds the GIL for as long as it runs, and on schemas with many nested
`$ref`s it runs for minutes and builds regexes of gigabytes (Kubernetes schemas in JSONSchemaBench):
in-process, that would freeze every thread of the engine, time limits included. The helper process
is started on first use, answers one request at a time over pipes (one JSON line each way), is
killed when it overruns `timeout_s`, and caps its own memory so a blow-up ends in a clean error.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from motet.grammar.specs import GrammarError

MEMORY_LIMIT_BYTES = 4 << 30
TIMEOUT_S = 20.0


def serve() -> None:
    """The helper process: read requests from stdin, answer on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    from outlines_core import json_schema

    for line in sys.stdin:
        req = json.loads(line)
        try:
            regex = json_schema.build_regex_from_schema(req["schema"], req["whitespace"], req["depth"])
            if len(regex) > req["max_chars"]:
                resp = {"error": f"too complex (regex of {len(regex)} chars > {req['max_chars']})"}
            else:
                resp = {"regex": regex}
        except Exception as e:
            resp = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


class RegexWorker:
    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def build(self, schema: str, whitespace: str, depth: int, max_chars: int) -> str:
        """The regex of a JSON schema (text), or GrammarError("unsupported" / "timeout")."""
        req = json.dumps({"schema": schema, "whitespace": whitespace, "depth": depth, "max_chars": max_chars})
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(req.encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                raise GrammarError("outlines: the regex helper process died", "unsupported") from None
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            if not ready:
                self._kill()
                raise GrammarError(
                    f"outlines: converting the JSON schema took longer than {self.timeout_s:g}s", "timeout"
                )
            line = proc.stdout.readline()
            if not line:
                self._kill()
                raise GrammarError(
                    "outlines: converting the JSON schema crashed (likely out of memory: too complex)",
                    "unsupported",
                )
        resp = json.loads(line)
        if "error" in resp:
            raise GrammarError(f"outlines cannot convert this JSON schema: {resp['error']}", "unsupported")
        return resp["regex"]

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ)
            root = str(Path(__file__).resolve().parents[2])  # so `motet.grammar` imports wherever we run
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from motet.grammar.regex_worker import serve; serve()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the helper process (it also exits by itself when our end of its stdin closes)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._kill()


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
