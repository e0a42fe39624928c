"""What the benchmarks' smoke tests share: a report's figures checked for shape (present, finite, positive), never
for speed; a module's script run in this process with torch's thread count put back after it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def positive(*values) -> bool:
    """Every value a finite number above zero (a ratio, a rate, a time)."""
    return all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values)


def finite(*values) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def only_json(out: Path, pattern: str = "*.json") -> dict:
    """The one JSON report under `out` (the serving benchmarks name theirs by the time they ran)."""
    (path,) = sorted(out.glob(pattern))
    return json.loads(path.read_text())


def only_md(out: Path, pattern: str = "*.md") -> str:
    (path,) = sorted(out.glob(pattern))
    return path.read_text()


class TorchThreads:
    """Puts torch's intra-op thread count back on exit (the scripts set it for their runs)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)
