"""A helper process for work that must not run in the server's own: work that holds the GIL for minutes or
may need unbounded memory (outlines' schema-to-regex conversion, a request's own chat template).

The helper is a Python process started on first use that answers one request at a time over pipes, one JSON
line each way; it caps its own memory (`serve`), and the server's side (`HelperProcess`) kills it when an
answer overruns its time, so a blow-up ends in a clean error and a fresh helper serves the next request.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

READY = {"ready": True}  # what a helper that prepares first (`serve(..., ready=True)`) says once it has


def first_line(e: BaseException) -> str:
    """An exception's message as one short line, for the error a helper answers."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def limit_memory(nbytes: int) -> None:
    """Cap this process's address space (in the helper, before it imports its library)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def serve(answer: Callable[[dict], dict], ready: bool = False) -> None:
    """The helper's loop: each request line from stdin answered on stdout, an exception as {"error": its first
    line}; with `ready`, READY first (once the caller has prepared)."""
    if ready:
        sys.stdout.write(json.dumps(READY) + "\n")
        sys.stdout.flush()
    for line in sys.stdin:
        try:
            resp = answer(json.loads(line))
        except Exception as e:
            resp = {"error": first_line(e)}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


class HelperFailure(Exception):
    """No answer from the helper (it was killed, and the next request starts a fresh one). `kind`: "died" (it
    was gone before the request reached it), "timeout" (no answer in time), "crashed" (it exited instead of
    answering: likely its memory cap), "start_timeout" / "start_failed" (it did not say ready in time / exited or
    said something else first)."""

    def __init__(self, kind: str, seconds: float = 0.0):
        super().__init__(kind)
        self.kind = kind
        self.seconds = seconds  # starting: how long it was waited for


class HelperProcess:
    """The server's side of a helper: `code` run by this Python with `args` (the repository on its path, so
    motet imports wherever the server runs); with `start_timeout_s`, the helper must say READY within it."""

    def __init__(self, code: str, args: Sequence[str] = (), start_timeout_s: float | None = None):
        self.code = code
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def ask(self, request: dict, timeout_s: float) -> dict:
        """The helper's answer to `request` (its {"error": ...} included), or HelperFailure."""
        line = json.dumps(request).encode() + b"\n"
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                raise HelperFailure("died") from None
            answer = self._read(proc, timeout_s)
            if not answer:
                self._kill()
                raise HelperFailure("timeout" if answer is None else "crashed")
        return json.loads(answer)

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        """One line from the helper (b"" where it exited); None when it gave none within the time."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        return proc.stdout.readline() if ready else None

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self.code, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        if self.start_timeout_s is not None:
            t0 = time.monotonic()
            line = self._read(self._proc, self.start_timeout_s)
            if not line or line.strip() != json.dumps(READY).encode():
                self._kill()
                raise HelperFailure(
                    "start_timeout" if line is None else "start_failed", time.monotonic() - t0
                )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the helper (it also exits by itself when our end of its stdin closes)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._kill()
