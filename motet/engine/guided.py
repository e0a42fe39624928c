"""A sequence's grammar constraint: its matcher, when the constraint starts, and jump-forward.

The matcher advances with every output token (in `LLMEngine.commit`, after sampling) and is read by
the model runner, which fills the sequence's row of the token bitmask while the forward pass runs (with
speculative drafts, one row per verified position: motet/engine/speculative/grammar_drafts.py).
Preemption needs no rollback: a preempted sequence keeps its output tokens (recompute only rebuilds
their KV), and the matcher has accepted exactly those tokens.

Reasoning models may write `<think>...</think>` (or their format's markup: motet/grammar/reasoning.py) before
the content the grammar describes. With a reasoning parser the constraint has three phases:

- OPENING (the output's start, unless the prompt already opened `<think>` or the format always starts inside
  its reasoning): undecided. The mask allows the grammar's tokens and the tokens that continue an opening tag
  (motet/grammar/reasoning.ReasoningOpening), and each token is checked against both. The first token that only
  one of them allows decides: the grammar's, and the constraint is on from the output's first token (the matcher
  has accepted every token so far); an opening tag completed, and the output reasons (the matcher is rolled
  back). A token both allow ("<" opens `<think>` and `<tool_call>`) keeps both open.
- REASONING: unconstrained until one of the format's end tags (`</think>`) appears in the output text.
- CLOSING (only with a reasoning budget): the output has used its budget of tokens while reasoning; the mask
  allows only the tokens that write the first end tag, exactly (vLLM's `thinking_token_budget` forces the end
  the same way), so that the grammar holds for the rest. The API bounds the reasoning of a forced tool call
  this way: a model that never ends its reasoning would otherwise never write the call it must.
- CONSTRAINED: the grammar masks every token.

So the content (the text after the reasoning, or the whole output) always matches the grammar; an output
that does not open `<think>` cannot skip the constraint by writing `</think>` later.

Jump-forward: where the grammar forces a string (a property name, a tool call's opening), its tokens
are appended without sampling them one by one; the next step computes them as one chunk. The forced
string's last token is left to the model, because it could merge with what follows (`"` + `name`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from motet.grammar.backend import Matcher, set_token_bits
from motet.grammar.reasoning import REASONING_END, ReasoningOpening


class Phase(Enum):
    OPENING = "opening"
    REASONING = "reasoning"
    CLOSING = "closing"
    CONSTRAINED = "constrained"


class GuidedDecoding:
    def __init__(
        self,
        matcher: Matcher,
        reasoning: ReasoningOpening | None = None,
        reasoning_started: bool = False,
        reasoning_ends: tuple[str, ...] = (REASONING_END,),
        reasoning_budget: int | None = None,
        closing: ReasoningOpening | None = None,
        peek: Callable[[list[int]], list[str]] | None = None,
    ):
        """`reasoning`: the tokenizer's tokens that open the reasoning when the output may reason (None: it
        never does); `reasoning_started`: the output begins inside it (the prompt opened `<think>`);
        `reasoning_ends`: what ends it; `reasoning_budget`: the most output tokens written before the reasoning
        must end (None: no limit), `closing` then the tokens that write the first of `reasoning_ends`; `peek`: the
        text tokens would add to the output so far, token by token (its detokenizer's), for drafts."""
        if reasoning_budget is not None and closing is None:
            raise ValueError("a reasoning budget needs the tokens that close the reasoning")
        self.matcher = matcher
        self.peek = peek
        self._opening = reasoning
        self._ends = reasoning_ends
        self._tail_len = max(len(end) for end in reasoning_ends)
        if reasoning_started:
            self.phase = Phase.REASONING
        else:
            self.phase = Phase.CONSTRAINED if reasoning is None else Phase.OPENING
        # OPENING: what is written of an opening tag; None once none can open
        self._progress: bytes | None = b""
        self._grammar_open = True  # OPENING: whether the matcher accepted every token so far
        self._grammar_tokens = 0  # OPENING: how many tokens the matcher accepted (to roll them back)
        self._tail = ""  # REASONING: the output text's last characters, to find its end
        self._budget, self._closing = reasoning_budget, closing
        self._written = 0  # output tokens so far (until CONSTRAINED), against the budget
        self._closed = b""  # CLOSING: what is written of the end tag
        if reasoning_started:
            self._check_budget()

    @property
    def active(self) -> bool:
        """Whether the grammar alone masks the next token."""
        return self.phase is Phase.CONSTRAINED

    @property
    def opening(self) -> bool:
        """Whether the output may still open its reasoning or follow the grammar (the mask allows both)."""
        return self.phase is Phase.OPENING

    @property
    def tag_masked(self) -> bool:
        """Whether the mask is a tag's tokens (`fill_tag_bitmask`): OPENING's (with the grammar's) or
        CLOSING's. Such a row gets no drafts: each token decides what the next may be."""
        return self.phase in (Phase.OPENING, Phase.CLOSING)

    @property
    def holds_stop(self) -> bool:
        """A bounded reasoning is open: the output may not end in it (the sampler masks its EOS and stop tokens, as
        before min_tokens), since the grammar it is bounded for must come."""
        return self.phase is Phase.REASONING and self._budget is not None

    @property
    def reasoning_room(self) -> int | None:
        """REASONING under a budget: how many more tokens it may take before its end is forced (else None)."""
        if self.phase is not Phase.REASONING or self._budget is None:
            return None
        return self._budget - self._written

    def fill_tag_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """OPENING: the grammar's allowed tokens (while it is open) and those that continue an opening tag.
        CLOSING: the tokens that continue the end tag."""
        if self.phase is Phase.CLOSING:
            bitmask[row].zero_()
            set_token_bits(bitmask, row, self._closing.tokens(self._closed))
            return
        if self._grammar_open:
            self.matcher.fill_bitmask(bitmask, row)
        else:
            bitmask[row].zero_()
        if self._progress is not None:
            set_token_bits(bitmask, row, self._opening.tokens(self._progress))

    def _ended(self, tail: str) -> bool:
        return any(end in tail for end in self._ends)

    def observe_text(self, text: str) -> None:
        """Output text of the token just appended (after `accept`): finds where the reasoning ends."""
        if self.phase is not Phase.CONSTRAINED:
            self._written += 1
        if self.phase is not Phase.REASONING:
            return
        self._tail = (self._tail + text)[-(self._tail_len + len(text)) :]
        if self._ended(self._tail):
            self.phase = Phase.CONSTRAINED
        else:
            self._check_budget()

    def _check_budget(self) -> None:
        if self._budget is not None and self._written >= self._budget:
            self.phase, self._closed = Phase.CLOSING, b""

    def tail_after(self, texts: list[str]) -> int | None:
        """With the given texts appended one by one (drafts' text deltas), after how many the constraint
        would be on; None if it stays off. The state is not changed. Not for an OPENING output (it gets
        no drafts: the proposer skips it)."""
        if self.active:
            return 0
        if self.opening:
            raise ValueError("an output that may still open <think> has no drafts")
        tail = self._tail
        for i, text in enumerate(texts):
            tail = (tail + text)[-(self._tail_len + len(text)) :]
            if self._ended(tail):
                return i + 1
        return None

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the mask did not allow it (state unchanged)."""
        if self.phase is Phase.CONSTRAINED:
            return self.matcher.accept_token(token_id)
        if self.phase is Phase.REASONING:
            return True
        if self.phase is Phase.CLOSING:
            closed = self._closing.advance(self._closed, token_id)
            if closed is None:
                return False
            if self._closing.complete(closed):
                self.phase = Phase.CONSTRAINED
            self._closed = closed
            return True
        progress = self._opening.advance(self._progress, token_id) if self._progress is not None else None
        grammar = self._grammar_open and self.matcher.accept_token(token_id)
        if progress is None and not grammar:
            return False
        self._grammar_tokens += grammar
        if progress is not None and self._opening.complete(progress):  # a tag is complete: the output reasons
            self.matcher.rollback(self._grammar_tokens)
            self.phase, self._tail = Phase.REASONING, ""
        elif progress is None:  # only the grammar allowed it: constrained from the first token
            self.phase = Phase.CONSTRAINED
        else:
            self._progress, self._grammar_open = progress, grammar
        return True

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
