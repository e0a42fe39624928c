"""The dev sets the eval suites read, shipped with the package (xz-compressed JSON Lines under data/):
JSONSchemaBench and BFCL (data/README.md says what each record holds). Any other file given with --data
is read the same way, compressed (.xz, .gz) or not."""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
DEV_SETS = ("jsonschemabench", "bfcl")


def dev_set_path(name: str) -> Path:
    """The shipped dev set `name` ("jsonschemabench" or "bfcl")."""
    if name not in DEV_SETS:
        raise ValueError(f"unknown dev set {name!r}: one of {', '.join(DEV_SETS)}")
    return DATA_DIR / f"{name}.jsonl.xz"


def open_text(path: Path):
    """A text stream over `path`, decompressed by its suffix."""
    path = Path(path)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON Lines file (blank lines skipped)."""
    with open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]
