"""What every paged-attention implementation takes besides q (the layout: motet/kernels/paged_attention.py): a
layer's `KVCache` and `AttentionOptions`, and the step's `PagedContext` (with the CPU path's `CpuAttentionPlan` of
it, which motet/kernels/paged_attention_cpu.py makes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A layer's paged caches: K and V, [num_blocks, block_size, num_kv_heads, head_dim] each
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DecodeGroup:
    """One padded batched decode call: its query rows, the blocks to gather, the key mask."""

    seqs: list[int]
    rows: torch.Tensor  # [n] query rows
    blocks: torch.Tensor  # [n * num_blocks] cache blocks, row-major per sequence
    valid: torch.Tensor  # [n, 1, 1, width] bool: the key is one that row's query attends to


@dataclass
class CpuAttentionPlan:
    """What the CPU path derives from the step's metadata, once per step instead of once per layer."""

    starts: list[int]
    lens: list[int]
    groups: list[DecodeGroup]
    tables: list[list[int]] | None = None  # the block table on the host, read when a lone sequence needs it
    window: int | None = None  # the layers' sliding window: keys further back than it are not attended to


@dataclass
class PagedContext:
    """Where a step's sequences are: sequence ``b``'s new tokens are the rows ``query_start_loc[b] :
    query_start_loc[b + 1]`` of q, its keys the first ``seq_lens[b]`` positions of the blocks
    ``block_tables[b]`` lists. The engine's `AttentionMetadata` is one (with the KV write's slots)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    # host-side hints (no device sync): the longest query and context of the step; None where not known
    max_query_len: int | None = None
    max_seq_len: int | None = None
    # the CPU path's bookkeeping of this context: made by the first layer that attends, reused by the others
    cpu_plan: CpuAttentionPlan | None = None


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention, the same every step: the scores' `scale`; `window` (a sliding-window layer): a
    query at position p attends to keys p - window + 1 .. p only; `softcap` (Gemma 2): the scaled scores
    squashed to softcap * tanh(s / softcap); `sinks` [num_heads] (GPT-OSS): each head's learned logit that
    joins its softmax's denominator and attends to nothing."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
