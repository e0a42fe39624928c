"""The dev sets the data-driven tests read: the full ones beside the repository (../shared/data) when they
are there, else the small samples committed under tests/fixtures/data (every 8th JSONSchemaBench record
with a schema under 6 kB, every 10th BFCL case), so those tests always run."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"


def dev_set(name: str) -> tuple[Path, bool]:
    """(path, whether it is the full set) for "jsonschemabench" or "bfcl"."""
    full = SHARED / name / "dev.jsonl"
    if full.is_file() and not os.environ.get("MOTET_TEST_SAMPLES"):  # set: the samples, as CI may see
        return full, True
    return FIXTURES / f"{name}_sample.jsonl", False
