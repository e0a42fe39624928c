"""The dev sets the data-driven tests read: the full ones shipped with motet (motet/evals/data), or, with
MOTET_TEST_SAMPLES set, the small samples committed under tests/fixtures/data (every 8th JSONSchemaBench
record with a schema under 6 kB, every 10th BFCL case)."""

from __future__ import annotations

import os
from pathlib import Path

from motet.evals.datasets import dev_set_path, read_jsonl

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"

__all__ = ["dev_set", "read_jsonl"]


def dev_set(name: str) -> tuple[Path, bool]:
    """(path, whether it is the full set) for "jsonschemabench" or "bfcl"; read it with read_jsonl."""
    if not os.environ.get("MOTET_TEST_SAMPLES"):
        return dev_set_path(name), True
    return FIXTURES / f"{name}_sample.jsonl", False
