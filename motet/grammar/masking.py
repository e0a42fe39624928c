"""Filling a step's grammar bitmasks across backends: xgrammar's and llguidance's matchers each in one
multi-threaded call, the others row by row. Above the backends (backend.py defines the interface, each
*_backend.py one of them), so none imports another's user."""

from __future__ import annotations

import torch

from motet.grammar import llguidance_backend, xgrammar_backend
from motet.grammar.backend import Matcher

_BATCHED = (
    (xgrammar_backend.XGrammarMatcher, xgrammar_backend.batch_fill),
    (llguidance_backend.LLGuidanceMatcher, llguidance_backend.batch_fill),
)


def fill_bitmasks(bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
    """Fill many rows: a backend's matchers in one multi-threaded call where it has one (they release
    the GIL), the others row by row. `items` holds (matcher, row) pairs."""
    taken: set[int] = set()
    for kind, batch_fill in _BATCHED:
        batch = [(m, r) for m, r in items if isinstance(m, kind) and not m.is_terminated()]
        if batch:
            batch_fill(bitmask, batch)
            taken |= {id(m) for m, _ in batch}
    for m, r in items:
        if id(m) not in taken:
            m.fill_bitmask(bitmask, r)
