"""The torch reference of paged attention (motet/kernels/paged_attention.py has the layout), which is also the CPU
production path: prefill chunks in bounded query sub-chunks, decodes batched in groups of similar context
length, with the per-step bookkeeping (attention_args.py's `CpuAttentionPlan`, made here) shared by the layers
of one step. With a `window` (sliding-window layers) a query at position p sees the keys at p - window + 1 .. p
only, and only those blocks are read: the others may hold newer tokens (motet/engine/core/block_manager.py's
`WindowBlocks` reuses them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from motet.kernels.attention_args import (
    AttentionOptions,
    CpuAttentionPlan,
    DecodeGroup,
    KVCache,
    PagedContext,
)

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


def first_key(seq_len: int, q_len: int, window: int | None) -> int:
    """The first key position the first of a sequence's `q_len` new tokens (of `seq_len`) attends to."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def plan_cpu_attention(ctx: PagedContext, block_size: int, window: int | None = None) -> CpuAttentionPlan:
    block_tables = ctx.block_tables
    starts, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    groups, dev = [], block_tables.device
    plan = CpuAttentionPlan(starts, lens, groups, window=window)
    # within a window a row reads at most `window` keys: group by what is read
    spans = lens if window is None else [min(n, window) for n in lens]
    for seqs in decode_groups(decodes, spans, block_size) if len(decodes) >= _BATCHED_DECODE_MIN else []:
        if window is None:
            num_blocks = -(-max(lens[b] for b in seqs) // block_size)
            firsts = [0] * len(seqs)
            blocks = block_tables[torch.tensor(seqs, device=dev), :num_blocks].reshape(-1).to(torch.long)
        else:  # each row's blocks from the one holding its first key
            if plan.tables is None:
                plan.tables = block_tables.tolist()
            firsts = [first_key(lens[b], 1, window) // block_size for b in seqs]
            num_blocks = max(-(-lens[b] // block_size) - f for b, f in zip(seqs, firsts, strict=True))
            rows_blocks = [
                [t[i] if i < len(t) else 0 for i in range(f, f + num_blocks)]
                for t, f in zip((plan.tables[b] for b in seqs), firsts, strict=True)
            ]
            blocks = torch.tensor(rows_blocks, device=dev).reshape(-1)
        width = num_blocks * block_size
        pos = (
            torch.arange(width, device=dev)[None, :] + torch.tensor(firsts, device=dev)[:, None] * block_size
        )  # each gathered key's position
        seq_len = torch.tensor([lens[b] for b in seqs], device=dev)[:, None]
        valid = pos < seq_len
        if window is not None:
            valid &= pos >= seq_len - window
        rows = torch.tensor([starts[b] for b in seqs], device=dev)
        groups.append(DecodeGroup(seqs, rows, blocks, valid[:, None, None, :]))
    return plan


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


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of [num_kv_heads, group, ...] scores, with each head's sink logit as one more
    column that is then dropped (its share of the weight goes nowhere)."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    column = sink.view(*sink.shape, *([1] * (scores.dim() - 2))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def paged_attention_reference(
    q: torch.Tensor, kv_cache: KVCache, ctx: PagedContext, options: AttentionOptions
) -> torch.Tensor:
    """Torch reference, and the CPU production path.

    One sequence at a time: gather its KV blocks (``index_select``, contiguous and cache-resident), then
    ``matmul -> masked softmax -> matmul`` in fp32 with the query heads of each kv group folded into the
    row dimension (GQA without expanding K/V). Measured on CPU this beats both one padded batch for all
    decodes (the padded gather is large and cache-hostile) and ``scaled_dot_product_attention``
    (per-call overhead for short queries; no faster for prefill chunks). Rows past
    ``query_start_loc[-1]`` are zero. The plan of `ctx` (`plan_cpu_attention`) is made by the first call and
    kept in it for the others (the layers of one step, of one window).
    """
    k_cache, v_cache = kv_cache
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale, window, softcap, sinks = options.scale, options.window, options.softcap, options.sinks
    plan = ctx.cpu_plan
    if plan is None:
        plan = ctx.cpu_plan = plan_cpu_attention(ctx, block_size, window)
    assert plan.window == window, "a plan is made for one window"
    starts, lens = plan.starts, plan.lens
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    done = set()
    # Many decode rows of similar length: one padded gather + one SDPA call per group beats a
    # per-sequence loop of small ops.
    one_by_one = softcap is not None or sinks is not None  # (SDPA has neither: those rows go one by one)
    for g in plan.groups if not one_by_one else ():
        _decode_batched(out, q, k_cache, v_cache, g, scale)
        done.update(g.seqs)
    if len(done) == len(lens):
        return out
    # each query head's sink logit, as the scores' [num_kv_heads, group] leading dims
    sink = sinks.float().view(num_kv_heads, group) if sinks is not None else None
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
            plan.tables = ctx.block_tables.tolist()
        # the keys from the block holding the first one any new token attends to (all of them without a window)
        first_block = first_key(seq_len, q_len, window) // block_size
        base = first_block * block_size  # the position of k's first row
        num_blocks = -(-seq_len // block_size) - first_block
        table = plan.tables[b][first_block:]
        # [num_kv_heads, seq_len - base, head_dim] in fp32 (.float() is a no-op for fp32 caches)
        k = _blocks_of(k_cache, table, num_blocks).view(-1, num_kv_heads, head_dim)[: seq_len - base]
        v = _blocks_of(v_cache, table, num_blocks).view(-1, num_kv_heads, head_dim)[: seq_len - base]
        k, v = k.float().transpose(0, 1), v.float().transpose(0, 1)
        if q_len == 1:  # decode, the common case: the last position sees every key (in its window), no mask
            lo = first_key(seq_len, 1, window) - base
            p = _softmax(_capped(torch.matmul(qs[:, :, q_start], k[:, lo:].mT), softcap), sink)
            out[q_start] = torch.matmul(p, v[:, lo:]).view(num_heads, head_dim)
            continue
        qb = qs[:, :, q_start:q_end]
        chunk = max(1, _MAX_SCORE_ELEMS // (num_heads * (seq_len - base)))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            n = c1 - c0
            # the chunk's last query sees keys up to kv_end - 1, its first from kv_start (earlier ones fewer)
            kv_end = ctx_len + c1 - base
            kv_start = first_key(ctx_len + c0 + 1, 1, window) - base
            keys = kv_end - kv_start
            s = torch.matmul(
                qb[:, :, c0:c1].reshape(num_kv_heads, group * n, head_dim), k[:, kv_start:kv_end].mT
            )
            s = _capped(s.view(num_kv_heads, group, n, keys), softcap)
            if n > 1:  # a single query row is the last position: it sees every key, no mask needed
                q_pos = torch.arange(ctx_len + c0, ctx_len + c1, device=q.device)[:, None]
                k_pos = torch.arange(base + kv_start, base + kv_end, device=q.device)[None, :]
                hidden = k_pos > q_pos  # the future
                if window is not None:
                    hidden |= k_pos <= q_pos - window
                s.masked_fill_(hidden, float("-inf"))
            p = _softmax(s, sink).view(num_kv_heads, group * n, keys)
            o = torch.matmul(p, v[:, kv_start:kv_end]).view(num_kv_heads, group, n, head_dim)
            out[q_start + c0 : q_start + c1] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out
