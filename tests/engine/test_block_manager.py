"""Block manager: allocation, ref counts, prefix caching keyed by adapter, LRU eviction."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from motet.engine.core.block_manager import BlockManager, FreeBlocks
from motet.engine.core.sequence import Sequence


def seq(tokens, adapter_id=0):
    return Sequence(list(tokens), adapter_id=adapter_id)


def computed(bm: BlockManager, tokens, adapter_id=0) -> Sequence:
    """A sequence whose whole prompt was computed, its full blocks in the prefix cache."""
    s = seq(tokens, adapter_id)
    bm.allocate_slots(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return s


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.allocate_slots(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    assert bm.allocate_slots(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    assert bm.allocate_slots(s, 3)
    assert len(s.block_table) == 4
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_allocation_fails_cleanly_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.allocate_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_shared_without_copy_and_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(10)) + [100, 101])
    assert bm.match_prefix(a) == 0
    bm.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)

    b = seq(list(range(10)) + [200, 201, 202])
    assert bm.match_prefix(b) == 8  # two full blocks of the shared 10-token prefix
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert b.num_computed_tokens == b.num_cached_tokens == 8


def test_whole_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, range(8))
    b = seq(range(8))
    assert bm.match_prefix(b) == 4  # the last block holds the token whose logits we need


def test_different_adapters_share_no_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, range(12), adapter_id=1)
    assert bm.match_prefix(seq(range(12), adapter_id=2)) == 0
    assert bm.match_prefix(seq(range(12), adapter_id=1)) == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.free_seq(computed(bm, range(9)))
    assert bm.num_free_blocks == 4
    # Still cached after free: a new sequence with the prefix hits.
    b = seq(range(9))
    assert bm.match_prefix(b) == 8
    bm.free_seq(b)
    # Filling the pool with other content evicts the cached blocks.
    c = seq(range(1000, 1016))
    assert bm.allocate_slots(c, 16)
    bm.free_seq(c)
    assert bm.match_prefix(seq(range(9))) == 0


# -- the free list ------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(0, 12),
    ops=st.lists(
        st.tuples(st.sampled_from(["take", "append", "front", "remove"]), st.integers(0, 11)), max_size=60
    ),
)
def test_free_blocks_reuse_in_the_order_of_one_lru_dict_of_every_id(num_blocks, ops):
    """FreeBlocks (the never-used ids a range) gives blocks back in the order the LRU OrderedDict of every id did:
    given back to the front first (the last first), then the never used by id, then the rest least recently freed
    first; a block held out of turn (a cache hit, a held free block) leaves it wherever it is."""
    free, reference = FreeBlocks(num_blocks), OrderedDict((i, None) for i in range(num_blocks))
    held = set()
    for op, block_id in ops:
        if op == "take" and reference:
            got = free.pop_first()
            assert got == reference.popitem(last=False)[0]
            held.add(got)
        elif op in ("append", "front") and block_id in held:
            held.discard(block_id)
            reference[block_id] = None
            if op == "front":
                reference.move_to_end(block_id, last=False)
                free.push_front(block_id)
            else:
                free.append(block_id)
        elif op == "remove" and block_id in reference:
            del reference[block_id]
            free.remove(block_id)
            held.add(block_id)
        assert len(free) == len(reference)
        assert all((i in free) == (i in reference) for i in range(num_blocks))
    assert [free.pop_first() for _ in range(len(free))] == list(reference)


def test_a_large_pool_makes_only_the_blocks_it_uses():
    bm = BlockManager(num_blocks=1 << 22, block_size=4)
    s = computed(bm, range(10))
    assert bm.num_free_blocks == (1 << 22) - 3 and len(bm.blocks._made) == 3
    bm.free_seq(s)
    assert bm.num_free_blocks == 1 << 22
