"""A request's own chat template (`chat_template`, under `motet serve --trust-request-chat-template`),
rendered in a helper process within bounds.

A template is a program: Jinja's sandbox (Hugging Face renders every template in one) bounds what it may
touch, not its time or memory (`{{ 'x' * 10**10 }}`, loops nested over range(100000)). The model's own
template is the operator's and renders in-process; a request's renders here, in a helper process that
Hugging Face's `apply_chat_template` runs in (the same rendering as the model's), which caps its own
memory at MEMORY_LIMIT_BYTES, is killed when a render overruns TIMEOUT_S, and returns at most `max_chars`
characters plus one, so that the caller's prompt bound refuses a longer prompt as it does any other. The
helper is started on first use (loading the model's tokenizer takes a few seconds) and answers one request
at a time over pipes, one JSON line each way.
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
from pathlib import Path

MEMORY_LIMIT_BYTES = 2 << 30
TIMEOUT_S = 10.0  # one render
START_TIMEOUT_S = 120.0  # importing transformers and loading the tokenizer, on a busy machine


class TemplateError(ValueError):
    """A request's template that cannot be rendered within the bounds (or at all); the message says why."""


def serve(model_dir: str) -> None:
    """The helper process: load the tokenizer, say ready, then render requests from stdin."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            text = tokenizer.apply_chat_template(
                req["messages"], chat_template=req["template"], tokenize=False, **req["kwargs"]
            )
            resp = {"text": text[: req["max_chars"] + 1]}
        except MemoryError:
            resp = {"error": f"rendering it needs more than {MEMORY_LIMIT_BYTES >> 20} MiB"}
        except Exception as e:  # jinja's and the template's own errors (raise_exception)
            resp = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


class TemplateWorker:
    def __init__(self, model_dir: str, timeout_s: float = TIMEOUT_S):
        self.model_dir = model_dir
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def render(self, messages: list[dict], template: str, kwargs: dict, max_chars: int) -> str:
        """The rendered prompt (at most max_chars + 1 characters), or TemplateError."""
        req = json.dumps(
            {"messages": messages, "template": template, "kwargs": kwargs, "max_chars": max_chars}
        )
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(req.encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                raise TemplateError("the chat template's helper process died") from None
            line = self._read(proc, self.timeout_s)
            if line is None:
                self._kill()
                raise TemplateError(f"rendering it took longer than {self.timeout_s:g} s")
            if not line:
                self._kill()
                raise TemplateError(f"rendering it failed (likely over {MEMORY_LIMIT_BYTES >> 20} MiB)")
        resp = json.loads(line)
        if "error" in resp:
            raise TemplateError(resp["error"])
        return resp["text"]

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        """One line from the helper; None when it gave none within the time."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        return proc.stdout.readline() if ready else None

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so `motet.engine` imports wherever we run
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        code = "import sys; from motet.engine.template_worker import serve; serve(sys.argv[1])"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, self.model_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        t0 = time.monotonic()
        line = self._read(self._proc, START_TIMEOUT_S)
        if not line or line.strip() != b'{"ready": true}':
            self._kill()
            why = "timed out" if line is None else "failed"
            raise TemplateError(
                f"the chat template's helper process {why} starting ({time.monotonic() - t0:.0f} s)"
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


_workers: dict[str, TemplateWorker] = {}
_workers_lock = threading.Lock()


def template_worker(model_dir: str) -> TemplateWorker:
    """The process-wide helper for one model's tokenizer."""
    with _workers_lock:
        if model_dir not in _workers:
            _workers[model_dir] = TemplateWorker(model_dir)
        return _workers[model_dir]
