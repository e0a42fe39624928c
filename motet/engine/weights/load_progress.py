"""Start-up's progress: log lines as a long step goes through a model's layers (loading or quantizing the weights,
packing them for the native CPU step), so that a slow start-up is not silence (quantizing a float checkpoint on load
takes most of a start-up on a small or busy CPU).

A step says once that it begins (`begin`); then lines come at most every few seconds, each at a new tenth of the
layers, so a quick step prints nothing more."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

log = logging.getLogger("motet.engine")

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # Hugging Face's and GGUF's block names
EVERY_S = 5.0  # the least time between two lines
T = TypeVar("T")


def begin(what: str, detail: str = "") -> None:
    """The line a long start-up step logs as it starts (`what`, with `detail` in parentheses)."""
    log.info("%s%s ...", what, f" ({detail})" if detail else "")


class LoadProgress:
    """Counts the layers a step has gone through: a checkpoint's tensors (in the order the loader takes them) by
    the layer their names hold, or the layers themselves."""

    def __init__(self, what: str, layers: int, every_s: float | None = None):
        self.what, self.layers = what, max(1, layers)
        self.every_s = EVERY_S if every_s is None else every_s
        self.start = self.last = time.perf_counter()
        self.seen: set[int] = set()
        self.told = 0  # the last tenth logged
        self.lines = 0

    def tensors(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """`weights` as they are, logging the progress as each is taken (the loader handles one before it takes
        the next), and the total time at the end where the load was slow enough to be told."""
        for name, tensor in weights:
            match = _LAYER.search(name)
            if match is not None and int(match[1]) not in self.seen:
                self.seen.add(int(match[1]))
                self._reached(len(self.seen) - 1)  # the layer before this one is done
            yield name, tensor
        if self.lines:
            log.info("%s: done in %.1f s", self.what, time.perf_counter() - self.start)

    def each_layer(self, layers: Iterable[T]) -> Iterator[T]:
        """`layers` (one item a layer, in order) as they are, logging the progress as each is taken (the one before
        it is done); the caller tells the total time."""
        for i, layer in enumerate(layers):
            self._reached(i)
            yield layer

    def _reached(self, done: int) -> None:
        tenth, now = 10 * done // self.layers, time.perf_counter()
        if tenth > self.told and now - self.last >= self.every_s:
            self.told, self.last, self.lines = tenth, now, self.lines + 1
            log.info(
                "%s: %d%% (%d of %d layers) in %.0f s",
                self.what, 100 * done // self.layers, done, self.layers, now - self.start,
            )  # fmt: skip


def show_on_stderr() -> None:
    """The offline entry points' start-up lines (loading, packing, warm-up: a minute on a busy CPU) on stderr, as
    vLLM's own logger shows them, where the application configured no logging: Python would print nothing below a
    warning. Once the application configures the root logger, its handlers take over (this one stands aside)."""
    motet, root = logging.getLogger("motet"), logging.getLogger()
    if root.handlers or motet.handlers or motet.level != logging.NOTSET:
        return
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(lambda record: not root.handlers)
    motet.addHandler(handler)
    motet.setLevel(logging.INFO)
