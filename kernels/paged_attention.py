"""Paged attention over a flattened batch of sequences (no padding), with a block-paged KV cache.

Layout (shared by the model, the block manager and these kernels):

- ``q``: ``[T, num_heads, head_dim]``; the new tokens of all sequences, concatenated. Sequence ``b`` owns
  rows ``query_start_loc[b]:query_start_loc[b + 1]`` (its ``q_len`` new tokens, possibly 0).
- ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of
  sequence ``b`` lives at block ``block_tables[b, p // block_size]``, offset ``p % block_size``.
- ``seq_lens[b]``: context length *including* the new tokens; the new tokens sit at positions
  ``seq_len - q_len .. seq_len - 1`` and their K/V are already in the cache (``write_kv_cache`` first).
- Causal: the query at position ``p`` attends to keys ``0..p``. GQA: query head ``h`` reads kv head
  ``h // (num_heads // num_kv_heads)``.

``paged_attention_reference`` defines the meaning and is also the CPU production path;
``paged_attention_triton`` is the GPU kernel; ``paged_attention`` picks one by device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is Linux-only; the torch reference serves elsewhere
    triton = None
    tl = None


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V: token ``t`` goes to flat slot ``slot_mapping[t]`` (``block * block_size +
    offset``); negative slots are skipped (e.g. padding rows, or tokens whose KV is already cached)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # .view (not .reshape/.flatten): the write must land in the cache itself, so it must be a view.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    # The boolean filter costs a device sync on CUDA; it is one small op per step, not per layer-kernel.
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_flat[slots] = k.to(k_cache.dtype)
    v_flat[slots] = v.to(v_cache.dtype)


def paged_attention(
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
    """Causal attention of each sequence's new tokens over its paged context; returns ``[T, H, D]`` in
    ``q``'s dtype. ``max_query_len`` / ``max_seq_len`` are optional host-side hints (no device sync);
    ``plan`` is the CPU path's per-step bookkeeping, shared by the layers of one step."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    hints = {"max_query_len": max_query_len, "max_seq_len": max_seq_len}
    if q.is_cuda:
        return paged_attention_triton(*args, **hints)
    return paged_attention_reference(*args, **hints, plan=plan)


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


def paged_attention_triton(
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
) -> torch.Tensor:
    """Triton kernel launch (CUDA, or CPU under ``TRITON_INTERPRET=1``). No device sync.

    Grid: (query blocks, kv heads). A program owns up to ``BLOCK_Q`` consecutive new tokens of one
    sequence times the ``group`` query heads sharing one kv head (``BLOCK_M = BLOCK_Q * group`` rows,
    padded to a power of two >= 16 for ``tl.dot``), so each K/V tile is loaded once per group, and walks
    the sequence's KV in tiles of ``TILE_N`` positions (any block size) with an online softmax.
    Rows past ``query_start_loc[-1]`` are left unwritten.
    """
    del max_seq_len  # loop bounds are read on device
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()

    if max_query_len is None:  # only a tuning hint: guess without a device sync
        max_query_len = 1 if num_tokens <= num_seqs else num_tokens
    # Decode: one token per sequence, so only `group` rows are real; keep the tile at the tl.dot minimum.
    # Prefill: more query rows per program amortize each K/V tile over more work.
    min_m = 16 if max_query_len == 1 else 64
    block_m = max(min_m, triton.next_power_of_2(group))
    block_q = block_m // group
    # Sequence b's query blocks start at query_start_loc[b] // block_q + b (see _find_seq), so this bounds
    # the total without reading query_start_loc on the host.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # Triton runs on CPU tensors only under TRITON_INTERPRET=1, whose tl.dot on bf16 multiplies the raw
    # uint16 bits (triton 3.9): there the kernel upcasts dot operands to fp32 (same rounding of p).
    interpreted = not q.is_cuda
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        num_seqs,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=32,  # independent of the block size: positions look up their block one by one
        # fp32 inputs get true fp32 dots (tl.dot defaults to tf32 on NVIDIA); bf16/fp16 use the default.
        PRECISION="ieee" if q.dtype == torch.float32 or interpreted else None,
        DOT_FP32=interpreted,
    )
    return out


if triton is not None:

    @triton.jit
    def _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
        """The sequence owning global query block ``q_block_idx``: the last ``b`` with
        ``query_start_loc[b] // BLOCK_Q + b <= q_block_idx`` (strictly increasing in ``b``)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_idx:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _paged_attention_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        scale_log2,
        num_seqs,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        q_block_idx = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_block = q_block_idx - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:  # spare program (the grid is an upper bound) or q_len == 0
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len

        # Row m is token (m // GROUP) of this block, query head kv_head * GROUP + m % GROUP.
        offs_m = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        q_pos = ctx_len + tok  # absolute position; every row (even padding) sees key 0, so no NaN rows
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM

        q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        # Keys needed by this block: up to its last real query's position.
        kv_len = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf in the rescale
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(0, kv_len, TILE_N):
            offs_n = start + tl.arange(0, TILE_N)
            n_ok = offs_n < kv_len
            # Per-position block lookup: tiles may span several (small) blocks or part of a big one.
            block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            in_block = offs_n % BLOCK_SIZE
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            k = tl.load(
                k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd,
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [HEAD_DIM_PAD, TILE_N]
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [TILE_N, HEAD_DIM_PAD]
            p = p.to(v.dtype)  # probabilities in the cache dtype for the second dot, as flash attention does
            if DOT_FP32:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            o_ptrs + offs_d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
