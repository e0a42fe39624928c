"""Start-up's progress while the weights load: a log line as the layers go by, so that a slow load is not silence
(quantizing a float checkpoint on load takes most of a start-up on a small or busy CPU).

Lines come at most every few seconds, each at a new tenth of the layers, so a quick load prints nothing."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator

log = logging.getLogger("motet.engine")

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # Hugging Face's and GGUF's block names
EVERY_S = 5.0  # the least time between two lines


class LoadProgress:
    """Counts the layers a checkpoint's tensors (in the order the loader takes them) belong to."""

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
            self._saw(name)
            yield name, tensor
        if self.lines:
            log.info("%s: done in %.1f s", self.what, time.perf_counter() - self.start)

    def _saw(self, name: str) -> None:
        match = _LAYER.search(name)
        if match is None or int(match[1]) in self.seen:
            return
        self.seen.add(int(match[1]))
        done = len(self.seen) - 1  # the layer before this one is done
        tenth, now = 10 * done // self.layers, time.perf_counter()
        if tenth > self.told and now - self.last >= self.every_s:
            self.told, self.last, self.lines = tenth, now, self.lines + 1
            log.info(
                "%s: %d%% (%d of %d layers) in %.0f s",
                self.what, 100 * done // self.layers, done, self.layers, now - self.start,
            )  # fmt: skip
