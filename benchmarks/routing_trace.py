"""A multi-tenant chat trace for the routing simulation (benchmarks/routing_sim.py).

Tenants each have one system prompt and several LoRA adapters; adapter popularity is Zipf over all adapters
(a share of conversations use the tenant's base model instead). Conversations arrive as a Poisson process;
each has a few turns, the next sent a think time after the previous reply ended (the simulation knows when);
every turn's prompt is the system prompt, the history (earlier user messages and replies) and a new user
message. Tokens are random ids.

Every request carries its prompt's leading full blocks hashed as the engine hashes them (keyed by the
adapter's uid and salted by tenant: motet/engine/core/block_manager.py), the blocks it leaves in the cache (prompt and
reply), and the same prompt hashed without adapter or salt: the prompt text alone, which is what a text-keyed
router sees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from motet.engine.core.block_manager import chain_block_hashes, matchable_tokens, prefix_salt


@dataclass(frozen=True)
class TraceConfig:
    tenants: int = 32
    adapters: int = 256  # adapter i belongs to tenant i % tenants
    zipf_s: float = 1.1
    base_model_share: float = 0.1  # conversations on the tenant's base model
    system_tokens: tuple[int, int] = (200, 800)
    user_tokens: tuple[int, int] = (20, 120)
    output_tokens: tuple[int, int] = (20, 200)
    mean_turns: float = 3.0  # geometric, at most max_turns
    max_turns: int = 8
    mean_think_s: float = 30.0
    block_size: int = 16
    vocab: int = 49000
    seed: int = 0


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # the conversation's start for its first turn; later turns: set by the simulation
    think_s: float  # after the previous turn's reply
    conversation: int
    turn: int
    tenant: int
    adapter: int  # uid; 0: the base model
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # the prompt's blocks a prefix-cache hit may cover
    cache_hashes: tuple[int, ...]  # the full blocks of prompt + reply: what it leaves in the cache
    text_hashes: tuple[int, ...]  # the prompt's blocks without the adapter (the text alone)


def adapter_uid(index: int) -> int:
    return index + 1  # 0 is the base model


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def generate(cfg: TraceConfig, rate_per_s: float, duration_s: float) -> list[list[TraceRequest]]:
    """Conversations (each its turns) starting at `rate_per_s` (Poisson) for `duration_s`."""
    rng = random.Random(cfg.seed)
    systems = [
        [rng.randrange(cfg.vocab) for _ in range(rng.randint(*cfg.system_tokens))] for _ in range(cfg.tenants)
    ]
    weights = zipf_weights(cfg.adapters, cfg.zipf_s)
    order = list(range(cfg.adapters))
    rng.shuffle(order)  # popularity independent of the owner
    conversations: list[list[TraceRequest]] = []
    t, conv = 0.0, 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t > duration_s:
            break
        (rank,) = rng.choices(range(cfg.adapters), weights)
        index = order[rank]
        tenant = index % cfg.tenants
        adapter = 0 if rng.random() < cfg.base_model_share else adapter_uid(index)
        conversations.append(_conversation(cfg, rng, conv, t, tenant, adapter, systems[tenant]))
        conv += 1
    return conversations


def _conversation(cfg, rng, conv, start, tenant, adapter, system) -> list[TraceRequest]:
    bs = cfg.block_size
    turns = 1
    while turns < cfg.max_turns and rng.random() > 1.0 / cfg.mean_turns:
        turns += 1
    tokens = list(system)
    salt = prefix_salt(f"tenant-{tenant}", None)
    hashes: list[int] = []  # the chain with the adapter and salt, extended as the conversation grows
    text: list[int] = []  # and without them
    out, think = [], 0.0
    for turn in range(turns):
        tokens += [rng.randrange(cfg.vocab) for _ in range(rng.randint(*cfg.user_tokens))]
        n_prompt, n_out = len(tokens), rng.randint(*cfg.output_tokens)
        lookup = matchable_tokens(n_prompt)
        chain_block_hashes(tokens, adapter, salt, bs, lookup, hashes)
        chain_block_hashes(tokens, 0, 0, bs, lookup, text)
        block_hashes, text_hashes = tuple(hashes[: lookup // bs]), tuple(text[: lookup // bs])
        tokens += [rng.randrange(cfg.vocab) for _ in range(n_out)]
        chain_block_hashes(tokens, adapter, salt, bs, len(tokens), hashes)
        out.append(
            TraceRequest(
                arrival=start,
                think_s=think,
                conversation=conv,
                turn=turn,
                tenant=tenant,
                adapter=adapter,
                prompt_tokens=n_prompt,
                output_tokens=n_out,
                block_hashes=block_hashes,
                cache_hashes=tuple(hashes),
                text_hashes=text_hashes,
            )
        )
        think = rng.expovariate(1.0 / cfg.mean_think_s) + 1.0
    return out
