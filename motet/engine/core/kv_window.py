"""The KV cache of sliding-window layers (Mistral's, Gemma 2/3's local layers) past their window.

Such a layer attends to the last `window` positions only, so a sequence keeps at most a ring of blocks for it:
logical block i lives in the ring's block i mod R, and a new block past the ring overwrites the oldest, whose
positions no query attends to any more (the attention kernels never read a block before a query's window:
motet/kernels/paged_attention.py). R covers a window plus the longest chunk one step writes, so the positions
a chunk's first query still needs survive the chunk's own writes. The global layers keep the whole context in
the block manager's blocks (motet/engine/core/block_manager.py); the window layers' blocks are another pool, with
its own tensors, taken as a ring grows and given back when its sequence leaves: a long request holds at most R
blocks of it however long it runs, vLLM's sliding-window manager's bound.

Without prefix caching: a hit would need the window's KV before the hit point, which this pool does not keep.
"""

from __future__ import annotations

from motet.engine.core.sequence import Sequence


def ring_blocks(window: int, max_chunk: int, block_size: int) -> int:
    """R: the blocks a ring needs so that a step writing `max_chunk` tokens keeps every key its queries see.

    A chunk at positions s..s+C-1 writes up to logical block (s+C-1) // B and its first query reads from
    position s - window + 1: R must exceed the distance between those blocks, at most
    ceil((window + C - 2) / B) + 1."""
    return -(-(window + max_chunk - 2) // block_size) + 2


class WindowBlocks:
    """The window layers' block pool: each sequence's ring (`Sequence.window_blocks`), grown as it needs."""

    def __init__(self, num_blocks: int, block_size: int, ring: int, max_chunk: int):
        """`ring`: R, from `ring_blocks` for chunks of `max_chunk` tokens, which the scheduler keeps to."""
        self.block_size = block_size
        self.ring = ring
        self.max_chunk = max_chunk
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's ring to hold its first `num_tokens` positions (at most R blocks); False if the
        pool is short."""
        needed = min(-(-num_tokens // self.block_size), self.ring) - len(seq.window_blocks)
        if needed <= 0:
            return True
        if needed > len(self.free):
            return False
        seq.window_blocks.extend(self.free.pop() for _ in range(needed))
        return True

    def free_seq(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.window_blocks))
        seq.window_blocks = []


def window_table(ring: list[int], num_blocks: int) -> list[int]:
    """The block table of a ring, `num_blocks` logical blocks long: block i at ring[i mod R] (before the window,
    entries name blocks that hold newer positions now; attention never reads those)."""
    n = len(ring)
    return ring * (num_blocks // n) + ring[: num_blocks % n] if n else [0] * num_blocks


def pool_sizes(
    layer_blocks: int, num_global: int, num_window: int, most_window: int, virtual_global: int
) -> tuple[int, int]:
    """(global blocks, window blocks) for `layer_blocks`, the blocks of one layer the KV budget holds over all
    layers. The window pool never needs more blocks than the global one (a ring is at most as long as its
    sequence) nor more than every sequence's whole ring (`most_window`): up to there the layers share the budget
    as without a window; past it the global layers take the rest. With no global layer (Mistral's window on
    every layer) the global blocks only index positions: `virtual_global`, which costs no memory."""
    even = layer_blocks // (num_global + num_window)
    if even <= most_window:
        return (even if num_global else virtual_global), max(1, even)
    if not num_global:
        return virtual_global, most_window
    return (layer_blocks - most_window * num_window) // num_global, most_window
