"""Drafts and grammars: the grammar's forced tokens as free drafts, drafts checked by the row's matcher, and
the bitmask of every verified position.

A constrained row's logits at draft position j must be masked exactly as the plain path would mask them
after appending drafts[:j]: by the matcher advanced through those drafts, and only once the constraint is
on (a reasoning row's grammar starts after `</think>`, which may sit inside the draft window; a row whose
output may still open `<think>` gets no drafts, motet/engine/speculative/proposer.py). The matcher
is advanced through the drafts and rolled back to the committed state each time, so the engine's commit
advances it by the accepted tokens only, as without speculation.
"""

from __future__ import annotations

import torch

from motet.engine.guided import GuidedDecoding


def forced_text(guided: GuidedDecoding) -> str:
    """The string the grammar forces next (a key, punctuation, a tool call's opening); "" if none.

    Unlike jump-forward its tokens are only drafts: the target verifies them, so a tokenization the model
    would not choose costs a rejected draft, never a different output."""
    if not guided.active or guided.matcher.is_terminated():
        return ""
    return guided.matcher.find_jump_forward_string()


def activation_index(guided: GuidedDecoding, drafts: list[int]) -> int:
    """The first draft position (0..len(drafts)) whose token is constrained; len(drafts) + 1 if none is."""
    if guided.active:
        return 0
    if not drafts or guided.peek is None:
        return len(drafts) + 1
    tail = guided.tail_after(guided.peek(drafts))
    return tail if tail is not None else len(drafts) + 1


def check_drafts(guided: GuidedDecoding, drafts: list[int], first_active: int) -> list[int]:
    """The drafts up to the first one the grammar rejects, and none after one that ends the grammar."""
    m = guided.matcher
    kept = accepted = 0
    for j, token in enumerate(drafts):
        if j >= first_active:
            if m.is_terminated() or not m.accept_token(token):
                break
            accepted += 1
        kept += 1
    m.rollback(accepted)
    return drafts[:kept]


def fill_draft_bitmask(
    bitmask: torch.Tensor, guided: GuidedDecoding, drafts: list[int], first_active: int, first_row: int
) -> None:
    """Fill bitmask rows first_row + j for j in first_active..len(drafts): position j's allowed tokens."""
    m = guided.matcher
    accepted = 0
    for j in range(first_active, len(drafts) + 1):
        m.fill_bitmask(bitmask, first_row + j)
        if j < len(drafts) and not m.is_terminated() and m.accept_token(drafts[j]):
            accepted += 1
    m.rollback(accepted)


class GrammarWalk:
    """The row's matcher as a constraint on a walk of drafts (history.Constraint): each allowed token is
    taken; `release` rolls the matcher back to the committed state."""

    def __init__(self, guided: GuidedDecoding):
        self.matcher = guided.matcher
        self.taken = 0

    def try_take(self, token: int) -> bool:
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        self.matcher.rollback(self.taken)
        self.taken = 0
