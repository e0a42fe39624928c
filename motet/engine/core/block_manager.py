"""Paged KV block manager with prefix caching.

Blocks are fixed-size slabs of the KV cache. A sequence owns a block table; full blocks are
registered under a chained hash (parent hash, adapter id, salt, token ids), so a later sequence with the
same prefix, the same adapter *and the same salt* reuses them without copying. The salt keeps tenants
apart: a cache hit is observable (`cached_tokens`, a faster first token), so a block shared across tenants
would tell one tenant what another's prompts hold. Free blocks keep their hash until they are reused: the
free list is an LRU, and a cache hit pulls a block back out of it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from motet.engine.core.kv_window import WindowBlocks
from motet.engine.core.sequence import CacheScope, Sequence

NO_PARENT = -1  # the first block's parent: CPython never returns -1 from hash(), and unlike None
# (whose hash is its address before Python 3.12) it hashes alike in every process, so a router elsewhere
# computes the same chain as the engine (cluster/).


def prefix_salt(
    tenant: str | None, cache_salt: str | None, shared_across_tenants: bool = False, long_rope: bool = False
) -> int:
    """The salt of a request's prefix-cache keys: blocks are shared only between requests of the same tenant
    (unless the operator shares the cache across tenants) and the same `cache_salt` (vLLM's request field).
    0 when neither applies (the offline engine; a shared cache without cache_salt). A digest, not hash():
    str hashes differ per process, and a router elsewhere must compute the same keys (cluster/). `long_rope`: a
    LongRoPE model's prompt longer than its original context, whose tokens within that context turn by the long
    factors (motet/engine/worker/model.py's RotaryEmbedding): its blocks are never another prompt's."""
    owner = None if shared_across_tenants else tenant
    if owner is None and cache_salt is None and not long_rope:
        return 0
    key = (owner, cache_salt, "long_rope") if long_rope else (owner, cache_salt)
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1  # a positive 63-bit int, never 0


def cache_scope(
    tenant: str | None,
    cache_salt: str | None,
    shared_across_tenants: bool,
    long_rope_original: int | None,
    num_prompt_tokens: int,
) -> CacheScope:
    """A new sequence's prefix-cache scope: its salt, and under LongRoPE (`long_rope_original`: the original
    context) whether its prompt already turns by the long factors, or else where it switches to them."""
    salt = prefix_salt(tenant, cache_salt, shared_across_tenants)
    if long_rope_original is None:
        return CacheScope(salt)
    long_salt = prefix_salt(tenant, cache_salt, shared_across_tenants, long_rope=True)
    if num_prompt_tokens > long_rope_original:
        return CacheScope(long_salt, long_rope=True)
    return CacheScope(salt, switch=(long_rope_original, long_salt))


def block_hash(parent: int | None, adapter_id: int, salt: int, token_ids: tuple[int, ...]) -> int:
    # The adapter id is part of the key (KV depends on the adapter's k/v deltas), and so is the salt (whose
    # cache it is). Both in every block, not only the first: a block found by its hash is never another's.
    return hash((NO_PARENT if parent is None else parent, adapter_id, salt, token_ids))


def matchable_tokens(num_tokens: int) -> int:
    """How many leading tokens of a prompt a prefix-cache hit may cover: all but the last, whose logits the
    step needs."""
    return num_tokens - 1


def chain_block_hashes(
    token_ids,
    adapter_id: int,
    salt: int,
    block_size: int,
    upto_tokens: int,
    hashes: list[int] | None = None,
) -> list[int]:
    """The chained hashes of the full blocks within the first `upto_tokens` tokens, extending `hashes`
    (those of the leading blocks, already computed) in place. `salt`: prefix_salt()."""
    hashes = [] if hashes is None else hashes
    for i in range(len(hashes), upto_tokens // block_size):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(block_hash(hashes[-1] if hashes else None, adapter_id, salt, tokens))
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions


class Blocks:
    """The pool's blocks by id, each made when first used. A small model's pool holds hundreds of thousands of
    blocks (a tiny test model's 0.5 GiB: 524,288); made at once they cost ~1.2 CPU-s and ~130 MiB at every
    engine's start, and a run touches few of them."""

    def __init__(self, num_blocks: int):
        self._num_blocks = num_blocks
        self._made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(block_id)
            block = self._made[block_id] = Block(block_id)
        return block

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(self._num_blocks))


class FreeBlocks:
    """The free blocks in the order they are reused: those given back to the front (never hashed: reused first,
    the last given back first), then those never used yet (by id), then those given back to the end (least
    recently freed first: their cached content lasts longest). One LRU list, as an OrderedDict of every id was;
    the never used are a range, not entries (see Blocks)."""

    def __init__(self, num_blocks: int):
        self._front: OrderedDict[int, None] = OrderedDict()
        self._next, self._end = 0, num_blocks  # never used: ids _next .. _end - 1, but for _taken
        self._taken: set[int] = set()  # never-used ids held out of turn (remove)
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + self._end - self._next - len(self._taken) + len(self._back)

    def __contains__(self, block_id: int) -> bool:
        never_used = self._next <= block_id < self._end and block_id not in self._taken
        return never_used or block_id in self._front or block_id in self._back

    def pop_first(self) -> int:
        if self._front:
            return self._front.popitem(last=False)[0]
        while self._next < self._end:
            block_id, self._next = self._next, self._next + 1
            if block_id not in self._taken:
                return block_id
            self._taken.discard(block_id)  # (held out of turn: it comes back through append or push_front)
        return self._back.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self._back[block_id] = None

    def push_front(self, block_id: int) -> None:
        self._front[block_id] = None
        self._front.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        if block_id in self._front:
            del self._front[block_id]
        elif block_id in self._back:
            del self._back[block_id]
        elif self._next <= block_id < self._end and block_id not in self._taken:
            self._taken.add(block_id)
        else:
            raise KeyError(block_id)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: WindowBlocks | None = None,
    ):
        """`window`: the sliding-window layers' pool where they keep only their window (motet/engine/core/kv_window.py),
        allocated and freed with these blocks; there is no prefix caching then."""
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching and window is None
        self.blocks = Blocks(num_blocks)
        self.free = FreeBlocks(num_blocks)
        self.cached: dict[int, int] = {}  # hash -> block id
        self.seq_hashes: dict[int, list[int]] = {}  # seq id -> hashes of its full blocks, in order
        self.num_registered: dict[int, int] = {}  # seq id -> leading blocks already offered to the cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (on the device or, loaded, in the KV tiers)
        # Called with cached blocks about to be reused, while they still hold their KV (the KV connector keeps
        # them in its tiers: motet/engine/core/kv_connector.py).
        self.on_evict: Callable[[list[Block]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def may_match(self, seq: Sequence) -> bool:
        """Whether the sequence may start from cached blocks (prompt logprobs need every prompt token's logits)."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def prefix_hashes(self, seq: Sequence) -> list[int]:
        """The hashes of the full blocks a prefix-cache hit may cover."""
        return self._hashes(seq, matchable_tokens(seq.num_tokens))

    def _hashes(self, seq: Sequence, upto_tokens: int) -> list[int]:
        """Chained hashes of the sequence's full blocks within its first `upto_tokens` tokens."""
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        return chain_block_hashes(
            seq.token_ids, seq.adapter_id, seq.cache.salt, self.block_size, upto_tokens, hashes
        )

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks holding the longest cached prefix; returns the tokens covered."""
        assert not seq.block_table
        if not self.may_match(seq):
            return 0
        hashes = self.prefix_hashes(seq)
        bs = self.block_size
        for i, h in enumerate(hashes):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
        hit = len(seq.block_table) * bs
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += hit
        seq.num_computed_tokens = hit
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit  # (Sequence.num_cached_tokens: its first admission's hit only)
        return hit

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free.remove(block_id)
        block.ref_count += 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if the pool is short."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        if self.window is not None and not self.window.allocate(seq, num_tokens):
            return False
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed <= 0:  # (most decode steps: the last block has room)
            return True
        if needed > len(self.free):
            return False
        seq.block_table.extend(self.take_blocks(needed))
        return True

    def take_blocks(self, n: int) -> list[int]:
        """Up to `n` free blocks (least recently freed first), held (ref count 1) by the caller, their cached
        content evicted (offered to `on_evict` first)."""
        block_ids = [self.free.pop_first() for _ in range(min(n, len(self.free)))]
        evicted = [self.blocks[i] for i in block_ids if self.blocks[i].hash is not None]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
        return block_ids

    def hold_blocks(self, block_ids: list[int]) -> None:
        """Hold blocks (a sequence's, or free ones) so that none is reused until release_blocks."""
        for block_id in block_ids:
            self._ref(block_id)

    def register_block(self, block_id: int, h: int, token_ids: tuple[int, ...]) -> None:
        """Cache a held block's content under `h` (unless another block holds that content already)."""
        block = self.blocks[block_id]
        if block.hash is None and h not in self.cached:
            block.hash, block.token_ids = h, token_ids
            self.cached[h] = block_id

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks held outside a sequence (take_blocks): cached ones to the LRU's end, the others to
        its front, to be reused first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free.push_front(block_id)
                else:
                    self.free.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs  # (a pending token is not known yet)
        if num_full == self.num_registered.get(seq.seq_id, 0):  # no block filled since (most decode steps)
            return
        hashes = self._hashes(seq, num_full * bs)
        for i in range(self.num_registered.get(seq.seq_id, 0), num_full):
            block, h = self.blocks[seq.block_table[i]], hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[h] = block.block_id
        self.num_registered[seq.seq_id] = num_full

    def truncate(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens (rejected drafts' slots). They were allocated
        for this step alone and never hashed, so they go to the front of the LRU, to be reused first."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free.push_front(block_id)
        # a new list, not shortened in place: the scheduler's record of what the runner holds tells a table that
        # only grew by its being the same list (motet/engine/core/step_plan.py)
        seq.block_table = seq.block_table[:keep]

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first, so they sit earliest in the LRU: a shared prefix outlives its suffixes.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free.append(block_id)
        seq.block_table = []
        if self.window is not None:
            self.window.free_seq(seq)
        seq.num_computed_tokens = 0
        self.num_registered.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state once the sequence is gone for good."""
        self.seq_hashes.pop(seq.seq_id, None)
