"""The torch reference of paged attention (motet/kernels/paged_attention.py has the layout), which is also the CPU
production path: prefill chunks in bounded query sub-chunks, decodes batched in groups of similar context
length, with the per-step bookkeeping (`CpuAttentionPlan`) shared by the layers of one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Upper bound on score-matrix elements per matmul in the reference (16 MiB of fp32): long prefill
# chunks are split into query sub-chunks so memory stays bounded like a flash kernel's would.
_MAX_SCORE_ELEMS = 1 << 22


_BATCHED_DECODE_MIN = 8
_PAD_SLACK = 1.5  # a batched decode group pads its keys to at most this times its shortest context


def decode_groups(decodes: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Decode rows in groups of similar context length, each worth one padded batched call.

    Padding every row to the batch's longest context would make one long conversation among short ones
    cost the whole batch its length in gathered keys; within a group the padding is bounded by
    `_PAD_SLACK`. Rows that end up in too small a group are left out (the per-sequence path takes them)."""
    groups: list[list[int]] = []
    for b in sorted(decodes, key=lambda b: lens[b]):
        if groups and lens[b] <= _PAD_SLACK * lens[groups[-1][0]] + block_size:
            groups[-1].append(b)
        else:
            groups.append([b])
    return [g for g in groups if len(g) >= _BATCHED_DECODE_MIN]


def _blocks_of(cache: torch.Tensor, table: list[int], num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` blocks of a block table: a view when they are consecutive (a lone sequence's
    usual case: the allocator hands out runs), else a gathered copy."""
    first = table[0]
    if table[num_blocks - 1] - first == num_blocks - 1 and table[:num_blocks] == list(
        range(first, first + num_blocks)
    ):
        return cache[first : first + num_blocks]
    return cache.index_select(0, torch.tensor(table[:num_blocks], device=cache.device))


@dataclass
class DecodeGroup:
    """One padded batched decode call: its query rows, the blocks to gather, the key mask."""

    seqs: list[int]
    rows: torch.Tensor  # [n] query rows
    blocks: torch.Tensor  # [n * num_blocks] cache blocks, row-major per sequence
    valid: torch.Tensor  # [n, 1, 1, width] bool: key position < that sequence's length


@dataclass
class CpuAttentionPlan:
    """What the CPU path derives from the step's metadata, once per step instead of once per layer."""

    starts: list[int]
    lens: list[int]
    groups: list[DecodeGroup]
    tables: list[list[int]] | None = None  # the block table on the host, read when a lone sequence needs it


def plan_cpu_attention(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> CpuAttentionPlan:
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    groups, dev = [], block_tables.device
    for seqs in decode_groups(decodes, lens, block_size) if len(decodes) >= _BATCHED_DECODE_MIN else []:
        num_blocks = -(-max(lens[b] for b in seqs) // block_size)
        width = num_blocks * block_size
        blocks = block_tables[torch.tensor(seqs, device=dev), :num_blocks].reshape(-1).to(torch.long)
        valid = (
            torch.arange(width, device=dev)[None, :]
            < torch.tensor([lens[b] for b in seqs], device=dev)[:, None]
        )
        rows = torch.tensor([starts[b] for b in seqs], device=dev)
        groups.append(DecodeGroup(seqs, rows, blocks, valid[:, None, None, :]))
    return CpuAttentionPlan(starts, lens, groups)


def _decode_batched(out, q, k_cache, v_cache, group: DecodeGroup, scale) -> None:
    """Attention of single-token (decode) rows of many sequences at once, keys padded to the longest.

    In fp32 (SDPA's CPU flash kernel measured 1.4 ms a call on bf16 keys at batch 32, several times its
    fp32 time)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n = len(group.seqs)
    width = group.blocks.shape[0] // n * block_size
    k = k_cache.index_select(0, group.blocks).view(n, width, num_kv_heads, head_dim).transpose(1, 2).float()
    v = v_cache.index_select(0, group.blocks).view(n, width, num_kv_heads, head_dim).transpose(1, 2).float()
    qr = q.index_select(0, group.rows).float().unsqueeze(2)
    o = F.scaled_dot_product_attention(qr, k, v, attn_mask=group.valid, scale=scale, enable_gqa=True)
    out[group.rows] = o.squeeze(2).to(out.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    """Torch reference, and the CPU production path.

    One sequence at a time: gather its KV blocks (``index_select``, contiguous and cache-resident), then
    ``matmul -> masked softmax -> matmul`` in fp32 with the query heads of each kv group folded into the
    row dimension (GQA without expanding K/V). Measured on CPU this beats both one padded batch for all
    decodes (the padded gather is large and cache-hostile) and ``scaled_dot_product_attention``
    (per-call overhead for short queries; no faster for prefill chunks). Rows past
    ``query_start_loc[-1]`` are zero. `plan` (from `plan_cpu_attention`) may be shared by all layers.
    """
    del max_query_len, max_seq_len  # host-side lists below are free on CPU
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if plan is None:
        plan = plan_cpu_attention(block_tables, query_start_loc, seq_lens, block_size)
    starts, lens = plan.starts, plan.lens
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    done = set()
    # Many decode rows of similar length: one padded gather + one SDPA call per group beats a
    # per-sequence loop of small ops.
    for g in plan.groups:
        _decode_batched(out, q, k_cache, v_cache, g, scale)
        done.update(g.seqs)
    if len(done) == len(lens):
        return out
    # [num_kv_heads, group, T, head_dim]: query head h = kv_head * group + g; scaled once for all rows
    qs = (q.float() * scale).view(-1, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    for b, seq_len in enumerate(lens):
        if b in done:
            continue
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        ctx_len = seq_len - q_len  # tokens cached before this step's new ones
        if plan.tables is None:
            plan.tables = block_tables.tolist()
        tables = plan.tables
        num_blocks = -(-seq_len // block_size)
        # [num_kv_heads, seq_len, head_dim] in fp32 (.float() is a no-op for fp32 caches)
        k = _blocks_of(k_cache, tables[b], num_blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        v = _blocks_of(v_cache, tables[b], num_blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.float().transpose(0, 1), v.float().transpose(0, 1)
        if q_len == 1:  # decode, the common case: the last position sees every key, no mask; few ops
            p = torch.softmax(torch.matmul(qs[:, :, q_start], k.mT), dim=-1)
            out[q_start] = torch.matmul(p, v).view(num_heads, head_dim)
            continue
        qb = qs[:, :, q_start:q_end]
        chunk = max(1, _MAX_SCORE_ELEMS // (num_heads * seq_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            n = c1 - c0
            kv_end = ctx_len + c1  # the chunk's last query sees keys 0..kv_end-1; earlier ones see fewer
            s = torch.matmul(qb[:, :, c0:c1].reshape(num_kv_heads, group * n, head_dim), k[:, :kv_end].mT)
            s = s.view(num_kv_heads, group, n, kv_end)
            if n > 1:  # a single query row is the last position: it sees every key, no mask needed
                q_pos = torch.arange(ctx_len + c0, ctx_len + c1, device=q.device)
                future = torch.arange(kv_end, device=q.device)[None, :] > q_pos[:, None]
                s.masked_fill_(future, float("-inf"))
            p = torch.softmax(s, dim=-1).view(num_kv_heads, group * n, kv_end)
            o = torch.matmul(p, v[:, :kv_end]).view(num_kv_heads, group, n, head_dim)
            out[q_start + c0 : q_start + c1] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out
