"""A request's own chat template (`chat_template`, under `motet serve --trust-request-chat-template`),
rendered in a helper process within bounds.

A template is a program: Jinja's sandbox (Hugging Face renders every template in one) bounds what it may
touch, not its time or memory (`{{ 'x' * 10**10 }}`, loops nested over range(100000)). The model's own
template is the operator's and renders in-process; a request's renders here, in a helper process that
Hugging Face's `apply_chat_template` runs in (the same rendering as the model's), which caps its own
memory at MEMORY_LIMIT_BYTES, is killed when a render overruns TIMEOUT_S, and returns at most `max_chars`
characters plus one, so that the caller's prompt bound refuses a longer prompt as it does any other. The
helper (motet/helper_process.py) is started on first use (loading the model's tokenizer takes a few seconds)
and answers one request at a time over pipes, one JSON line each way.
"""

from __future__ import annotations

import threading

from motet.helper_process import HelperFailure, HelperProcess, limit_memory
from motet.helper_process import serve as serve_requests

MEMORY_LIMIT_BYTES = 2 << 30
TIMEOUT_S = 10.0  # one render
START_TIMEOUT_S = 120.0  # importing transformers and loading the tokenizer, on a busy machine


class TemplateError(ValueError):
    """A request's template that cannot be rendered within the bounds (or at all); the message says why."""


def serve(model_dir: str) -> None:
    """The helper process: load the tokenizer, say ready, then render requests from stdin."""
    limit_memory(MEMORY_LIMIT_BYTES)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)

    def answer(req: dict) -> dict:  # jinja's and the template's own errors (raise_exception): their message
        try:
            text = tokenizer.apply_chat_template(
                req["messages"], chat_template=req["template"], tokenize=False, **req["kwargs"]
            )
        except MemoryError:
            return {"error": f"rendering it needs more than {MEMORY_LIMIT_BYTES >> 20} MiB"}
        return {"text": text[: req["max_chars"] + 1]}

    serve_requests(answer, ready=True)


class TemplateWorker:
    def __init__(self, model_dir: str, timeout_s: float = TIMEOUT_S):
        self.model_dir = model_dir
        self.timeout_s = timeout_s
        code = "import sys; from motet.engine.template_worker import serve; serve(sys.argv[1])"
        self._helper = HelperProcess(code, [model_dir], start_timeout_s=START_TIMEOUT_S)

    def render(self, messages: list[dict], template: str, kwargs: dict, max_chars: int) -> str:
        """The rendered prompt (at most max_chars + 1 characters), or TemplateError."""
        req = {"messages": messages, "template": template, "kwargs": kwargs, "max_chars": max_chars}
        try:
            resp = self._helper.ask(req, self.timeout_s)
        except HelperFailure as e:
            raise TemplateError(_FAILURES[e.kind].format(self=self, e=e)) from None
        if "error" in resp:
            raise TemplateError(resp["error"])
        return resp["text"]

    def close(self) -> None:
        """Stop the helper."""
        self._helper.close()


_FAILURES = {  # HelperFailure kind -> TemplateError message
    "died": "the chat template's helper process died",
    "timeout": "rendering it took longer than {self.timeout_s:g} s",
    "crashed": f"rendering it failed (likely over {MEMORY_LIMIT_BYTES >> 20} MiB)",
    "start_timeout": "the chat template's helper process timed out starting ({e.seconds:.0f} s)",
    "start_failed": "the chat template's helper process failed starting ({e.seconds:.0f} s)",
}


_workers: dict[str, TemplateWorker] = {}
_workers_lock = threading.Lock()


def template_worker(model_dir: str) -> TemplateWorker:
    """The process-wide helper for one model's tokenizer."""
    with _workers_lock:
        if model_dir not in _workers:
            _workers[model_dir] = TemplateWorker(model_dir)
        return _workers[model_dir]
