"""Argparse types for motet's numeric flags: a value that is not a finite number in the flag's range is
refused at start-up, in one line naming the flag (`motet serve: error: argument --x: ...`), never accepted
to fail later (`--responses-max-age-days nan` once made every stored response unreadable).

Every numeric flag of every command takes its type from here (motet/api/cli.py, motet/api/server.py,
motet/cluster/serve_flags.py); `OneLineErrors` is the parser class that prints a refusal as that one line.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

MAX_SECONDS = 7 * 86400.0  # a timeout or grace period longer than a week is a mistake (and near the
# event loop's limits: a deadline of 1e300 s overflows)
MAX_DAYS = 36500.0  # a retention of a century


def integer(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An integer flag in [low, high] (no upper bound when `high` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        _check(value, text, low, high, open_low=False)
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float = 0.0, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """A finite real flag in [low, high], or (low, high] with `above` (no upper bound when `high` is None)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):  # float() reads "nan", "inf" and "1e999" (inf)
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        _check(value, text, low, high, open_low=above)
        return value

    parse.__name__ = "number"
    return parse


def seconds(low: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """A duration flag: finite seconds from `low` (or above it) to MAX_SECONDS."""
    return number(low, MAX_SECONDS, above=above)


def _check(value, text: str, low, high, open_low: bool) -> None:
    too_low = value <= low if open_low else value < low
    if too_low or (high is not None and value > high):
        lower = f"> {low:g}" if open_low else f">= {low:g}"
        wanted = f"{lower} and <= {high:g}" if high is not None else lower
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose refusals are one line (argparse's default prints the whole usage first, which for
    `motet serve` is a screenful that hides the error)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)
