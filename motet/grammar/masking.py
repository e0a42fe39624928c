"""Filling a step's grammar bitmasks across backends: each backend's unterminated matchers in one call of
their class's `fill_many` (xgrammar's and llguidance's are multi-threaded), the terminated ones row by row. It
names no backend (backend.py defines the interface, each *_backend.py one of them): a step imports none of their
libraries before a grammar is compiled."""

from __future__ import annotations

import torch

from motet.grammar.backend import Matcher


def fill_bitmasks(bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
    """Fill many rows: a backend's matchers in one call where it has one (they release the GIL), the others row by
    row. `items` holds (matcher, row) pairs."""
    batches: dict[type[Matcher], list[tuple[Matcher, int]]] = {}
    for m, r in items:
        if m.is_terminated():
            m.fill_bitmask(bitmask, r)
        else:
            batches.setdefault(type(m), []).append((m, r))
    for kind, batch in batches.items():
        kind.fill_many(bitmask, batch)
