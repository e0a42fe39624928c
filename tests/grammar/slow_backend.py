"""A grammar backend that compiles only when the test lets it, for the compile cache's timeouts, caps and
per-tenant budgets (no model, no tokenizer). The `slow_backend` fixture (tests/grammar/conftest.py) installs it."""

from __future__ import annotations

import threading

from motet.grammar.backend import Backend, CompiledGrammar


class FakeTokenizer:
    key = "fake"
    stop_token_ids = [0]


class SlowBackend(Backend):
    """Compiles regex "fast" at once and fails on regex "boom"; anything else only once `release` is set."""

    name = "slow"
    release = threading.Event()

    def __init__(self, tokenizer):
        pass

    def compile(self, spec):
        pattern = getattr(spec, "pattern", "")
        if pattern == "boom":
            raise RuntimeError("C++ exception: bad things")
        if pattern != "fast":
            self.release.wait(10)
        return SlowCompiled()


class SlowCompiled(CompiledGrammar):
    backend = "slow"

    def matcher(self):
        raise NotImplementedError
