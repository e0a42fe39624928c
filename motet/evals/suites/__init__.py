"""The suites of `motet eval`: one module per suite, all with the same small interface.

A suite module `motet/evals/suites/<name>.py` defines

    NAME: str
    NEEDS_SERVER: bool                       # False: it runs offline (no server is started or contacted)
    def add_arguments(p: argparse.ArgumentParser) -> None      # its own flags
    def run(ctx: EvalContext) -> dict                          # JSON-serializable results
    def markdown(results: dict) -> str
    def plots(results: dict, out_dir: Path) -> list[Path]      # PNGs (matplotlib, Agg backend)
    def summary(results: dict) -> str                          # a few lines printed at the end
    def failure(results: dict) -> str | None                   # optional: why the run measured nothing (its
                                                               # requests all failed); `motet eval` exits 1

or, instead of `markdown` / `plots`, `compare_markdown(runs)` / `compare_plots(runs, out_dir)` over
`{label: results}`, which render one server (`{"": results}`) or two side by side (without them
motet/evals/report.py has a generic side-by-side fallback). Modules are found here by
name, so a new suite is just a new file; imports of heavy libraries belong inside `run`.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

ORDER = ("jsonschema", "bfcl", "lora", "serving", "throughput")  # how `motet eval --help` lists them


def discover() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """The importable suites by name, and those that failed to import with the reason."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    suites, broken = {}, {}
    for name in names:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except Exception as e:  # one broken suite must not take the others down
            broken[name] = f"{type(e).__name__}: {e}"
            continue
        suites[getattr(module, "NAME", name)] = module
    return suites, broken
