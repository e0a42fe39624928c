"""What every streamed parser of an output shares (the tool-call formats', the reasoning formats', harmony's
reader): finding markers (tags, special tokens) in a text that may still grow, and releasing text piece by piece
so that the pieces add up to the whole text stripped."""

from __future__ import annotations


def earliest(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The first of `markers` at or after `start`, as (offset, marker), or None."""
    hits = [(i, marker) for marker in markers if (i := text.find(marker, start)) >= 0]
    return min(hits) if hits else None


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (what a streamed parser
    holds back: the next delta may complete the marker)."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class Stripped:
    """A text released piece by piece so that the pieces add up to the whole text stripped: leading whitespace
    dropped, trailing whitespace held back until more text follows it."""

    def __init__(self):
        self.started = False  # whether any text was released
        self._pending_ws = ""

    def add(self, text: str) -> str:
        """What to release of the next piece `text` ("" for nothing yet)."""
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return ""
        released = self._pending_ws + body
        self._pending_ws = text[len(body) :]
        self.started = True
        return released
