"""Drafts from what earlier requests of the same scope wrote: an n-gram model over recent outputs.

Requests of one tenant and adapter under one kind of grammar repeat each other: the same JSON keys and
punctuation in the same tokenization, the same tool-call scaffolding, the same boilerplate, while the
values in between differ. Like suffix decoding, each scope keeps its latest finished outputs (each led in
by the last prompt tokens, so an output's first tokens can be proposed too) and counts, for every context
of 1..max_n tokens, the tokens that followed it. A draft is the most frequent next token after the longest
context seen, and its chance of acceptance is estimated from the counts: where the outputs agree
(punctuation, the next key the grammar allows) drafts run on, where they differ (a value) they stop.
Walked under the row's grammar, only the continuations it allows count, so requests with different schemas
or tools can share a scope. Memory is bounded: a few thousand tokens per scope and a budget over all
scopes, the least recently used scopes dropped first. Scopes never mix, so one tenant's outputs never shape
another's drafts (drafts never change an output, but they change its timing).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Protocol

_MIN_CHANCE = 0.05  # stop drafting once the whole run's chance of acceptance falls below this


class Constraint(Protocol):
    """What the walk needs of a grammar: take the token if it is allowed (the caller rolls back all it
    took, drafted or not)."""

    def try_take(self, token: int) -> bool: ...


class _ScopeModel:
    """Next-token counts after every context of 1..max_n tokens in a scope's kept outputs."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.outputs: deque[list[int]] = deque()
        self.num_tokens = 0
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}  # context -> next token -> count
        self.totals: dict[tuple[int, ...], int] = {}
        self.best: dict[tuple[int, ...], tuple[int, int]] = {}  # context -> (most frequent next, count)

    def _pairs(self, tokens: list[int]):
        for end in range(1, len(tokens)):
            for n in range(1, min(self.max_n, end) + 1):
                yield tuple(tokens[end - n : end]), tokens[end]

    def add(self, tokens: list[int], max_tokens: int) -> None:
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        for ctx, nxt in self._pairs(tokens):
            counts = self.counts.setdefault(ctx, {})
            c = counts[nxt] = counts.get(nxt, 0) + 1
            self.totals[ctx] = self.totals.get(ctx, 0) + 1
            if (c, nxt) > self._best_key(ctx):
                self.best[ctx] = (nxt, c)
        while self.num_tokens > max_tokens and len(self.outputs) > 1:
            self._remove(self.outputs.popleft())

    def _remove(self, tokens: list[int]) -> None:
        self.num_tokens -= len(tokens)
        for ctx, nxt in self._pairs(tokens):
            counts = self.counts[ctx]
            counts[nxt] -= 1
            if not counts[nxt]:
                del counts[nxt]
            self.totals[ctx] -= 1
            if not counts:
                del self.counts[ctx], self.totals[ctx], self.best[ctx]
            elif self.best[ctx][0] == nxt:
                self.best[ctx] = max(counts.items(), key=lambda kv: (kv[1], kv[0]))

    def _best_key(self, ctx: tuple[int, ...]) -> tuple[int, int]:
        best = self.best.get(ctx)
        return (best[1], best[0]) if best is not None else (0, -1)

    def candidates(self, context: list[int]):
        """After the longest suffix of `context` seen: its next tokens as (count, token), most frequent
        first (ties: the larger id; the rest sorted only if the first is passed over), and their total."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            ctx = tuple(context[len(context) - n :])
            if (best := self.best.get(ctx)) is not None:

                def ranked(ctx=ctx, best=best):
                    yield best[1], best[0]
                    rest = ((c, t) for t, c in self.counts[ctx].items() if t != best[0])
                    yield from sorted(rest, reverse=True)

                return ranked(), self.totals[ctx]
        return iter(()), 0


class OutputHistory:
    """Recent outputs per scope, and the drafts they suggest."""

    def __init__(
        self, max_n: int = 4, max_scopes: int = 256, tokens_per_scope: int = 4096, max_tokens: int = 32768
    ):
        # About 2 KB a token at worst (all n-grams distinct): 32k tokens in all stay under ~70 MB.
        self.max_n = max_n
        self.max_scopes, self.tokens_per_scope, self.max_tokens = max_scopes, tokens_per_scope, max_tokens
        self._scopes: OrderedDict[Hashable, _ScopeModel] = OrderedDict()  # least recently used first
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._scopes)

    def record(self, scope: Hashable, lead_in: list[int], output: list[int]) -> None:
        """A finished output of `scope`, after the prompt's last tokens `lead_in`."""
        if not output:
            return
        model = self._scopes.pop(scope, None) or _ScopeModel(self.max_n)
        self._scopes[scope] = model
        self.num_tokens -= model.num_tokens
        model.add(list(lead_in[-self.max_n :]) + list(output), self.tokens_per_scope)
        self.num_tokens += model.num_tokens
        while len(self._scopes) > 1 and (
            len(self._scopes) > self.max_scopes or self.num_tokens > self.max_tokens
        ):
            self.num_tokens -= self._scopes.popitem(last=False)[1].num_tokens

    def propose(
        self,
        scope: Hashable,
        context: list[int],
        k: int,
        constraint: Constraint | None = None,
        min_chance: float = _MIN_CHANCE,
    ) -> tuple[list[int], list[float]]:
        """Up to k drafts after `context` (its last max_n tokens matter), and for each the estimated chance
        that it and every draft before it are accepted (non-increasing, never below `min_chance`).

        With a `constraint` (the row's grammar), each draft is the most frequent next token the grammar
        allows, and its chance counts only against the others it allows: where outputs differ only in
        what the grammar decides (the next key), the walk runs on."""
        model = self._scopes.get(scope)
        drafts: list[int] = []
        chances: list[float] = []
        if model is None or k <= 0:
            return drafts, chances
        self._scopes.move_to_end(scope)
        context, chance = list(context[-self.max_n :]), 1.0
        while len(drafts) < k:
            ranked, total = model.candidates(context)
            token = None
            for count, t in ranked:
                if constraint is None or constraint.try_take(t):
                    token = t
                    break
                total -= count  # the grammar rules it out
            if token is None:
                break
            chance *= count / (total + 1)  # one sighting is a guess, many agreeing ones are not
            if chance < min_chance:
                break
            drafts.append(token)
            chances.append(chance)
            context = context[1:] + [token] if len(context) == self.max_n else context + [token]
        return drafts, chances
