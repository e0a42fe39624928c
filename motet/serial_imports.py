"""The first imports of transformers and what is built on it (peft, xgrammar, llguidance.hf), one thread at a time.

They are imported at their first use, not at start (a warm start serves without them: issue 65), and more than one
thread may be first: the grammar backends' vocabulary built once the server is idle, a fine-tuning job's planning
(peft), a grammar's first backend. Two threads importing them at once can each hold a module the other needs;
Python's import then hands one of them a module still half made ("cannot import name 'AutoModel' from
'transformers'", a 500 on a fine-tuning job's creation). Code that may make such a first import runs under
`first_imports()`; once they are made it costs a lock."""

from __future__ import annotations

import importlib
import sys
import threading

_LOCK = threading.RLock()


def first_imports() -> threading.RLock:
    """The lock to hold while code may import transformers or a library built on it for the first time (re-entrant:
    one holder may call another). Hold it around the code that may import, no longer: another thread's first import
    waits for it."""
    return _LOCK


def imported(*modules: str) -> None:
    """`modules` imported, under `first_imports()` where one is not yet whole (once they are, no lock is taken)."""
    if all(_whole(sys.modules.get(name)) for name in modules):
        return
    with _LOCK:
        for name in modules:
            importlib.import_module(name)


def _whole(module) -> bool:
    """Whether `module` is imported and done (not still being made by some thread's import)."""
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)
