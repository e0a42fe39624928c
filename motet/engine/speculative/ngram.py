"""Prompt lookup: drafts copied from where the sequence's latest n tokens occurred before.

JSON extraction copies from the prompt, tool calls repeat the user's words, an edit repeats the previous
answer: in all of them the tokens that followed an earlier occurrence of the current suffix are good
guesses for what comes next. Each sequence keeps an index from n-gram to the end of its latest earlier
occurrence, extended incrementally as tokens are appended, so a proposal costs O(max_n) dict lookups
instead of a scan over the prompt.
"""

from __future__ import annotations


class NgramIndex:
    """Latest occurrence of every n-gram (min_n <= n <= max_n) of one token list, excluding its suffix."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # n-grams ending at positions < this are in _ends
        self.matched = 0  # the length of the suffix the latest proposal matched (0: none)

    def _extend(self, tokens: list[int], upto: int) -> None:
        for end in range(max(self._indexed, 1), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end  # later occurrences overwrite earlier ones
        self._indexed = max(self._indexed, upto)

    def propose(self, tokens: list[int], k: int, ahead: list[int] = ()) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix of
        `tokens + ahead` (`ahead`: drafts already chosen, e.g. forced by a grammar; never indexed).

        `tokens` only ever grows between calls (the sequence's prompt and output); the suffix itself is not
        indexed, so a match always lies strictly before it."""
        full = tokens + list(ahead) if ahead else tokens
        self.matched = 0
        if k <= 0 or len(full) < 2:
            return []
        self._extend(tokens, len(tokens))  # n-grams ending before the last position
        for n in range(min(self.max_n, len(full) - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(full[len(full) - n :]))
            if end is not None:
                self.matched = n
                return full[end : end + k]
        return []
