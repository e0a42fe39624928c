"""Filling a step's grammar bitmasks across backends: xgrammar's matchers in one multi-threaded call, the
others row by row. Above both backends (backend.py defines the interface, xgrammar_backend.py one of them),
so neither imports the other's user."""

from __future__ import annotations

import torch

from grammar.backend import Matcher
from grammar.xgrammar_backend import XGrammarMatcher, batch_fill


def fill_bitmasks(bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
    """Fill many rows: xgrammar matchers in one multi-threaded call (it releases the GIL), the
    others row by row. `items` holds (matcher, row) pairs."""
    batch = [(m, r) for m, r in items if isinstance(m, XGrammarMatcher) and not m.is_terminated()]
    if batch:
        batch_fill(bitmask, batch)
    taken = {id(m) for m, _ in batch}
    for m, r in items:
        if id(m) not in taken:
            m.fill_bitmask(bitmask, r)
