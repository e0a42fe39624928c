"""motet: multi-tenant LLM serving (per-tenant LoRA adapters batched together, grammar-constrained output,
an OpenAI-compatible API).

The public API, imported lazily so that `import motet` costs nothing until one is used:

    from motet import LLM, SamplingParams
    llm = LLM()                                   # the default model
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

`motet.main` is the `motet` command (serve, pull, generate, run-batch, eval, fine-tune); `motet.serve(argv)` runs the
server as `motet serve ARGS` would.
"""

from __future__ import annotations

import importlib
import os

# OpenMP's threads (libgomp: motet's native step and torch's) spin this many times at a barrier before they sleep, set
# before anything loads torch (libgomp reads it once). libgomp's default, 300,000 spins (milliseconds), is right on
# a machine of its own; beside other busy processes a thread spins through its time slice while the one it waits for
# is off the core: the step kept 23% of its tokens/s beside two busy loops on 2 cores, where a fair share is 50%. A
# short spin still covers a barrier's usual wait on a quiet machine (docs/cpu.md, "Sharing the cores").
OMP_SPIN_COUNT = "10000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)

# (each imported on first use; the version too: importlib.metadata takes a fifth of a second)
_EXPORTS = {
    "__version__": ("motet.version", "__version__"),
    "LLM": ("motet.engine.llm", "LLM"),
    "SamplingParams": ("motet.engine.sampling_params", "SamplingParams"),
    "EngineConfig": ("motet.engine.config", "EngineConfig"),
    "LLMEngine": ("motet.engine.llm_engine", "LLMEngine"),
    "RequestOutput": ("motet.engine.outputs", "RequestOutput"),
    "main": ("motet.api.cli", "main"),
}
__all__ = sorted([*_EXPORTS, "serve"])


def serve(argv: list[str] | None = None) -> int:
    """Run the OpenAI-compatible server as `motet serve ARGV` would (blocks until it stops)."""
    from motet.api.cli import main

    return main(["serve", *(argv or [])])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'motet' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
