"""A clock the test moves by hand, for the code that takes one (`clock=`) instead of reading time itself."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
