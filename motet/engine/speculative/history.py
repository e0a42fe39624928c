"""Drafts from what earlier requests of the same scope wrote: an n-gram model over recent outputs.

Requests of one tenant and adapter under one kind of grammar repeat each other: the same JSON keys and
punctuation in the same tokenization, the same tool-call scaffolding, the same boilerplate, while the
values in between differ. Like suffix decoding, each scope keeps its latest finished outputs (each led in
by the last prompt tokens, so an output's first tokens can be proposed too) and counts, for every context
of 1..max_n tokens, the tokens that followed it. A draft is the most frequent next token after the longest
context seen, and its chance of acceptance is estimated from the counts: where the outputs agree
(punctuation, the next key the grammar allows) drafts run on, where they differ (a value) they stop.
Walked under the row's grammar, only the continuations it allows count, so requests with different schemas
or tools can share a scope. Scopes never mix, so one tenant's outputs never shape another's drafts (drafts
never change an output, but they change its timing).

Memory is bounded per tenant, and no tenant's traffic can evict another's history (acceptance, and so
timing, would depend on the other's load): each tenant has its own budget of scopes and tokens, its least
recently used scopes dropped first. A tenant holds one of `max_tenants` slots from its first recorded output
until it has been idle for `tenant_idle_s`; only then may a newcomer take its slot. While every slot is held
by an active tenant, a newcomer's outputs are not kept (its rows draft from prompt lookup and the grammar).
So memory stays under max_tenants x tokens_per_tenant, and a tenant loses its history only by its own
idleness.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

_MIN_CHANCE = 0.05  # stop drafting once the whole run's chance of acceptance falls below this

# Budgets. About 2 KB a token at worst (all n-grams distinct): 16 x 8k tokens stay under ~270 MB, and
# typical outputs, which repeat themselves, far less.
MAX_TENANTS = 16  # tenants whose history is kept at once
SCOPES_PER_TENANT = 32
TOKENS_PER_TENANT = 8192
TOKENS_PER_SCOPE = 4096
TENANT_IDLE_S = 300.0  # a tenant idle this long may lose its slot to a newcomer


class DraftScope(NamedTuple):
    """Whose recent outputs a request may draft from."""

    tenant: str | None
    cache_salt: str | None  # the request's cache_salt: requests of different salts share nothing
    adapter: int  # the adapter's uid (0: the base model)
    grammar_kind: str | None
    reasoning: str | None


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


class _TenantHistory:
    """One tenant's scopes, least recently used first, within the tenant's own budget."""

    def __init__(self, now: float):
        self.scopes: OrderedDict[DraftScope, _ScopeModel] = OrderedDict()
        self.num_tokens = 0
        self.last_used = now


class OutputHistory:
    """Recent outputs per scope, and the drafts they suggest; budgets per tenant (see the module's doc)."""

    def __init__(
        self,
        max_n: int = 4,
        max_tenants: int = MAX_TENANTS,
        scopes_per_tenant: int = SCOPES_PER_TENANT,
        tokens_per_tenant: int = TOKENS_PER_TENANT,
        tokens_per_scope: int = TOKENS_PER_SCOPE,
        tenant_idle_s: float = TENANT_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < tokens_per_scope <= tokens_per_tenant:
            raise ValueError(f"tokens_per_scope must be in [1, tokens_per_tenant], got {tokens_per_scope}")
        self.max_n = max_n
        self.max_tenants, self.scopes_per_tenant = max_tenants, scopes_per_tenant
        self.tokens_per_tenant, self.tokens_per_scope = tokens_per_tenant, tokens_per_scope
        self.tenant_idle_s, self.clock = tenant_idle_s, clock
        self._tenants: dict[str | None, _TenantHistory] = {}
        self.turned_away = 0  # outputs not kept: every tenant slot was held by an active tenant

    def __len__(self) -> int:
        return sum(len(t.scopes) for t in self._tenants.values())

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self._tenants.values())

    @property
    def max_tokens(self) -> int:
        """The bound on the tokens kept, over all tenants."""
        return self.max_tenants * self.tokens_per_tenant

    def _slot(self, tenant: str | None, now: float) -> _TenantHistory | None:
        """The tenant's history, given a slot if it has none and one is free or held by an idle tenant."""
        held = self._tenants.get(tenant)
        if held is not None:
            return held
        for other, h in list(self._tenants.items()):  # only a tenant's own idleness frees its slot
            if now - h.last_used >= self.tenant_idle_s:
                del self._tenants[other]
        if len(self._tenants) >= self.max_tenants:
            return None
        held = self._tenants[tenant] = _TenantHistory(now)
        return held

    def record(self, scope: DraftScope, lead_in: list[int], output: list[int]) -> None:
        """A finished output of `scope`, after the prompt's last tokens `lead_in`."""
        if not output:
            return
        now = self.clock()
        tenant = self._slot(scope.tenant, now)
        if tenant is None:
            self.turned_away += 1
            return
        tenant.last_used = now
        model = tenant.scopes.pop(scope, None) or _ScopeModel(self.max_n)
        tenant.scopes[scope] = model
        tenant.num_tokens -= model.num_tokens
        tokens = list(lead_in[-self.max_n :]) + list(output)
        model.add(tokens[: self.tokens_per_scope], self.tokens_per_scope)  # its start: where outputs agree
        tenant.num_tokens += model.num_tokens
        while len(tenant.scopes) > 1 and (
            len(tenant.scopes) > self.scopes_per_tenant or tenant.num_tokens > self.tokens_per_tenant
        ):
            tenant.num_tokens -= tenant.scopes.popitem(last=False)[1].num_tokens

    def propose(
        self,
        scope: DraftScope,
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
        tenant = self._tenants.get(scope.tenant)
        model = tenant.scopes.get(scope) if tenant is not None else None
        drafts: list[int] = []
        chances: list[float] = []
        if model is None or k <= 0:
            return drafts, chances
        tenant.last_used = self.clock()
        tenant.scopes.move_to_end(scope)
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
