"""Start-up's progress: log lines as a long step goes through a model's layers (loading or quantizing the weights,
packing them for the native CPU step), so that a slow start-up is not silence (quantizing a float checkpoint on load
takes most of a start-up on a small or busy CPU).

A step says once that it begins (`begin`); then lines come at most every few seconds, each at a new tenth of the
layers, so a quick step prints nothing more.

The step under way is also the process's start-up phase (`phase`, read by `current`): what `motet serve`'s
/health answers while it loads ("loading the weights 12/30", its fraction), and what `Heartbeat` says where a phase
has told nothing for EVERY_S seconds (importing the engine's libraries, reading a tokenizer: no line of their own),
so that no stretch of a start-up is silent for longer."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("motet.engine")

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # Hugging Face's and GGUF's block names
EVERY_S = 5.0  # the least time between two lines
T = TypeVar("T")


@dataclass(frozen=True)
class Phase:
    """A start-up phase: what it does, and where it counts them, how many of how many (layers) are done."""

    what: str
    done: int | None = None
    total: int | None = None
    since: float = 0.0  # (time.monotonic) when it began

    @property
    def fraction(self) -> float | None:
        """The share of its count done (None: it counts nothing)."""
        return None if not self.total else min(1.0, (self.done or 0) / self.total)

    def __str__(self) -> str:
        return self.what if not self.total else f"{self.what} {self.done or 0}/{self.total}"


_phase = Phase("starting", since=time.monotonic())
_told_at = (
    time.monotonic()
)  # when the latest start-up line was logged (a line of this module's, or a heartbeat)


def phase(what: str, done: int | None = None, total: int | None = None) -> None:
    """The process's start-up is now at `what` (`done` of `total` where it counts them)."""
    global _phase
    since = _phase.since if _phase.what == what else time.monotonic()
    _phase = Phase(
        what, done, total, since
    )  # (one assignment: a reader on another thread sees one or the other)


def current() -> Phase:
    """The start-up phase under way (or the last one)."""
    return _phase


def told() -> None:
    """A start-up line was just logged: the heartbeat need not speak for another EVERY_S seconds."""
    global _told_at
    _told_at = time.monotonic()


def begin(what: str, detail: str = "") -> None:
    """The line a long start-up step logs as it starts (`what`, with `detail` in parentheses); the phase it begins."""
    phase(what)
    log.info("%s%s ...", what, f" ({detail})" if detail else "")
    told()


class Heartbeat:
    """A line, where a start-up has logged none for `every_s` seconds, saying which phase it is in and for how
    long: `tick()` (from a loop that ticks anyway: the server's), or a daemon thread of its own (`start`, `stop`;
    a `with` block) for the offline commands."""

    def __init__(
        self,
        every_s: float | None = None,
        logger: logging.Logger = log,
        say: Callable[[str], None] | None = None,
    ):
        """The line goes to `logger` at info, or to `say` where given (a command that prints, not logs)."""
        self.every_s = EVERY_S if every_s is None else every_s
        self.say = say or (lambda text: logger.info("%s", text))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - _told_at < self.every_s:
            return
        at = current()
        self.say(f"still {at} ({now - at.since:.0f} s)")
        told()

    def start(self) -> Heartbeat:
        told()  # (from now on)
        self._thread = threading.Thread(target=self._run, name="start-up-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 5)):
            self.tick()

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
        phase(self.what, self.layers, self.layers)
        if self.lines:
            log.info("%s: done in %.1f s", self.what, time.perf_counter() - self.start)
            told()

    def each_layer(self, layers: Iterable[T]) -> Iterator[T]:
        """`layers` (one item a layer, in order) as they are, logging the progress as each is taken (the one before
        it is done); the caller tells the total time."""
        for i, layer in enumerate(layers):
            self._reached(i)
            yield layer
        phase(self.what, self.layers, self.layers)

    def _reached(self, done: int) -> None:
        phase(self.what, done, self.layers)
        tenth, now = 10 * done // self.layers, time.perf_counter()
        if tenth > self.told and now - self.last >= self.every_s:
            self.told, self.last, self.lines = tenth, now, self.lines + 1
            log.info(
                "%s: %d%% (%d of %d layers) in %.0f s",
                self.what, 100 * done // self.layers, done, self.layers, now - self.start,
            )  # fmt: skip
            told()


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
