"""A sequence's grammar constraint: its matcher, when the constraint starts, and jump-forward.

The matcher advances with every output token (in `LLMEngine.commit`, after sampling) and is read by
the model runner, which fills the sequence's row of the token bitmask while the forward pass runs (with
speculative drafts, one row per verified position: motet/engine/speculative/grammar_drafts.py).
Preemption needs no rollback: a preempted sequence keeps its output tokens (recompute only rebuilds
their KV), and the matcher has accepted exactly those tokens.

Reasoning models write `<think>...</think>` first; with `wait_for="</think>"` the constraint starts
with the first token after that text appears in the output.

Jump-forward: where the grammar forces a string (a property name, a tool call's opening), its tokens
are appended without sampling them one by one; the next step computes them as one chunk. The forced
string's last token is left to the model, because it could merge with what follows (`"` + `name`).
"""

from __future__ import annotations

from collections.abc import Callable

from motet.grammar.backend import Matcher


class GuidedDecoding:
    def __init__(self, matcher: Matcher, wait_for: str | None = None):
        self.matcher = matcher
        self.wait_for = wait_for
        self.active = wait_for is None
        self._tail = ""  # the output text's last characters, while waiting for `wait_for`

    def observe_text(self, text: str) -> None:
        """Output text of the token just appended (before the constraint is active)."""
        if self.active:
            return
        self._tail = (self._tail + text)[-(len(self.wait_for) + len(text)) :]
        if self.wait_for in self._tail:
            self.active = True

    def tail_after(self, texts: list[str]) -> int | None:
        """With the given texts appended one by one (drafts' text deltas), after how many the constraint
        would be on; None if it stays off. The state is not changed."""
        if self.active:
            return 0
        tail = self._tail
        for i, text in enumerate(texts):
            tail = (tail + text)[-(len(self.wait_for) + len(text)) :]
            if self.wait_for in tail:
                return i + 1
        return None

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (a masked-out token)."""
        return not self.active or self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def jump_forward(self, encode: Callable[[str], list[int]]) -> list[int]:
        """The tokens of the string the grammar forces next, minus the last one, already accepted."""
        if not self.active or self.matcher.is_terminated():
            return []
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return []
        accepted = []
        for token_id in encode(forced)[:-1]:
            if not self.matcher.accept_token(token_id):
                break
            accepted.append(token_id)
        return accepted
