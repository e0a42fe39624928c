"""The compile cache: compile each (backend, spec, tokenizer) once per owner, with a time limit and fallback.

Entries are kept per owner (the tenant): a tenant whose schema compiles at once would otherwise learn
that another tenant had used the same schema, from the time its request took.

Compilation runs in a daemon worker thread and the caller stops waiting after `timeout_s`; a Python
thread cannot be killed, so a compilation that overruns keeps running, and its result still lands
in the cache when it finishes. Concurrent requests for the same key share one compilation.

Overrunning compilations are a per-owner resource (the owner is the tenant that sent the request):
each counts against the owner whose request started it, and an owner with `max_stuck` of them still
running is refused new ones ("busy") until one finishes, so a flood of pathological schemas cannot
take every core, and one tenant's cannot lock the others out. An owner may start at most one more
compilation per thread waiting on them before the first overruns (the ingress bounds those threads).
Deterministic failures (invalid or unsupported specs) are cached too. Synchronous: callers on an event
loop run it in a worker thread.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from motet.grammar.backend import Backend, CompiledGrammar, GrammarTokenizer
from motet.grammar.specs import BACKEND_NAMES, DEFAULT_BACKEND, GrammarError, GrammarSpec, short_error
from motet.serial_imports import first_imports

# Each backend's class, by module and name: a module (and its library: xgrammar, llguidance, outlines-core) is
# imported at its backend's first use (the vocabulary's build or the first grammar), not with the engine.
_CLASSES = {
    "xgrammar": ("motet.grammar.xgrammar_backend", "XGrammarBackend"),
    "llguidance": ("motet.grammar.llguidance_backend", "LLGuidanceBackend"),
    "outlines": ("motet.grammar.outlines_backend", "OutlinesBackend"),
}
BACKENDS: dict[str, tuple[str, str]] = {name: _CLASSES[name] for name in BACKEND_NAMES}  # fallback order


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called `name` (one of BACKENDS), its module imported."""
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


DEFAULT_TIMEOUT_S = 10.0


class GrammarCache:
    def __init__(self, max_entries: int = 512, max_stuck: int = 2):
        self.max_entries = max_entries
        self.max_stuck = max_stuck  # overrunning compilations one owner may have running
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._started_by: dict[tuple, Hashable] = {}  # in-flight key -> the owner whose request started it
        self._stuck: dict[tuple, Hashable] = {}  # overrunning key -> that owner
        self._backends: dict[tuple[str, str], Backend] = {}

    def backend(self, name: str, tokenizer: GrammarTokenizer) -> Backend:
        if name not in BACKENDS:
            raise GrammarError(f"unknown grammar backend {name!r} (known: {', '.join(BACKENDS)})")
        with self._lock:
            b = self._backends.get((name, tokenizer.key))
            if b is None:
                # (the backend's library, imported here the first time: motet/serial_imports.py)
                with first_imports():
                    b = self._backends[(name, tokenizer.key)] = backend_class(name)(tokenizer)
            return b

    def compile(
        self,
        spec: GrammarSpec,
        tokenizer: GrammarTokenizer,
        backend: str = DEFAULT_BACKEND,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        owner: Hashable = None,
    ) -> CompiledGrammar:
        """Compile with one backend (cached); GrammarError when it cannot within `timeout_s`, or
        ("busy") when `owner` already has `max_stuck` compilations running past their limit."""
        b = self.backend(backend, tokenizer)
        try:
            key = (backend, tokenizer.key, owner, spec.key())
        except RecursionError:  # json cannot write it: deeper than any limit lets through
            raise GrammarError(f"the {spec.kind} is nested too deeply") from None
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                self.hits += 1
                if isinstance(hit, GrammarError):
                    raise GrammarError(str(hit), hit.reason)
                return hit
            fut = self._inflight.get(key)
            if fut is None:
                stuck = self._overrunning(owner)
                if stuck >= self.max_stuck:
                    raise GrammarError(
                        f"{stuck} grammar compilations of this requester are still running past their time"
                        " limit; try again later",
                        "busy",
                    )
                self.misses += 1
                fut = self._inflight[key] = Future()
                self._started_by[key] = owner
                threading.Thread(
                    target=self._run, args=(key, b, spec, fut), daemon=True, name="grammar-compile"
                ).start()
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            with self._lock:
                if not fut.done():  # counted against whoever started it, not against this waiter
                    self._stuck[key] = self._started_by[key]
            raise GrammarError(
                f"{backend}: grammar compilation took longer than {timeout_s:g}s", "timeout"
            ) from None

    def compile_with_fallback(
        self,
        spec: GrammarSpec,
        tokenizer: GrammarTokenizer,
        backend: str = DEFAULT_BACKEND,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        owner: Hashable = None,
    ) -> CompiledGrammar:
        """Compile with `backend`; if it cannot, try the others within the same overall time limit.
        An invalid spec is refused at once (no backend would help), and so is a busy owner."""
        order = [backend] + [n for n in BACKENDS if n != backend]
        deadline = time.monotonic() + timeout_s
        errors: list[GrammarError] = []
        for name in order:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors.append(GrammarError(f"{name}: not tried, time limit reached", "timeout"))
                break
            try:
                return self.compile(spec, tokenizer, name, remaining, owner)
            except GrammarError as e:
                if e.reason == "invalid" or (e.reason == "busy" and not errors):
                    raise
                errors.append(e)
        reasons = {e.reason for e in errors}
        reason = next(r for r in ("unsupported", "timeout", "busy") if r in reasons)
        raise GrammarError("; ".join(str(e) for e in errors), reason)

    def _run(self, key: tuple, backend: Backend, spec: GrammarSpec, fut: Future) -> None:
        try:
            result: CompiledGrammar | GrammarError = backend.compile(spec)
        except GrammarError as e:
            result = e
        except Exception as e:  # a backend bug must not kill the caller
            result = GrammarError(f"{backend.name} failed: {short_error(e)}", "unsupported")
        with self._lock:
            self._inflight.pop(key, None)
            self._started_by.pop(key, None)
            self._stuck.pop(key, None)
            self._lru[key] = result
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)
        if isinstance(result, GrammarError):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def overrunning(self, owner: Hashable = None) -> int:
        """How many compilations started for `owner` are still running past their time limit."""
        with self._lock:
            return self._overrunning(owner)

    def _overrunning(self, owner: Hashable) -> int:
        return sum(1 for o in self._stuck.values() if o == owner)

    def __len__(self) -> int:
        return len(self._lru)
