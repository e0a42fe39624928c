"""The Triton kernels of motet/kernels/sgmv.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """This program's slot, rows and row mask; slot -1 also for tiles past the segment's end."""
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg)
    slot = tl.where(start + tl.program_id(1) * BLOCK_M < end, slot, -1)
    return slot.to(tl.int64), rows.to(tl.int64), rows < end


@triton.jit
def _piece(desc_ptr, slot, layer, stride_ds, stride_dc, GROUP: tl.constexpr, NUM_MODULES: tl.constexpr):
    """The slot's adapter's piece of the group at `layer` (int64): (rank, the piece's element offset in the
    pool, the mask of its targeted modules, how many); rank 0 where there is none (no slot, or no module of
    the group)."""
    ok = slot >= 0
    row = desc_ptr + tl.maximum(slot, 0) * stride_ds
    r = tl.load(row, mask=ok, other=0).to(tl.int64)
    offset = tl.load(row + (1 + 3 * GROUP) * stride_dc, mask=ok, other=-1).to(tl.int64)
    stride = tl.load(row + (2 + 3 * GROUP) * stride_dc, mask=ok, other=0).to(tl.int64)
    mask = tl.load(row + (3 + 3 * GROUP) * stride_dc, mask=ok, other=0).to(tl.int64)
    r = tl.where(offset < 0, 0, r)
    k = mask * 0
    for m in tl.static_range(NUM_MODULES):
        k += (mask >> m) & 1
    return r, offset + layer * stride, mask, k


@triton.jit
def _shrink_kernel(
    x_ptr,
    pool_ptr,
    desc_ptr,
    h_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    layer,
    K,
    A_LD,
    W,
    stride_xt,
    stride_xk,
    stride_ds,
    stride_dc,
    stride_ht,
    stride_hr,
    GROUP: tl.constexpr,
    NUM_MODULES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (segment, row tile, rank tile): h[rows, i] = x[rows] . A[i, :K] for the piece's rows i of the
    tile (A [k * r, A_LD] at the piece's start)."""
    slot, rows, row_ok = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    r, base, mask, k = _piece(desc_ptr, slot, layer, stride_ds, stride_dc, GROUP, NUM_MODULES)
    num_r = tl.minimum(k * r, W)  # A's rows (bounded by h's width, should max_rank be too small)
    r0 = tl.program_id(2) * BLOCK_R
    if r0 >= num_r:  # no adapter, no piece of the group, a spare tile past the segment's end or A's rows
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = offs_r < num_r
    x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk
    a_ptrs = pool_ptr + base + offs_r[None, :].to(tl.int64) * A_LD + offs_k[:, None]  # A^T tile [K, R]
    # tl.full, not tl.zeros (a triton.jit helper: stays compiled if triton was imported before
    # TRITON_INTERPRET was set, which breaks the tests' re-decoration)
    acc = tl.full([BLOCK_M, BLOCK_R], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_FP32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    h_ptr,
    pool_ptr,
    desc_ptr,
    y_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    layer,
    A_LD,
    W,
    END0,
    END1,
    END2,
    LD0,
    LD1,
    LD2,
    stride_ht,
    stride_hr,
    stride_ds,
    stride_dc,
    stride_yt,
    stride_yn,
    GROUP: tl.constexpr,
    NUM_MODULES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (segment, row tile, column tile): the delta of each targeted module whose columns
    [END(m-1), END(m)) meet the tile, from its ranks h[:, pos * r:(pos + 1) * r] and its BT (row length
    LD(m)), which follows A and the BT of the targeted modules before it (usually one module a tile)."""
    slot, rows, row_ok = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    r, base, mask, k = _piece(desc_ptr, slot, layer, stride_ds, stride_dc, GROUP, NUM_MODULES)
    if r <= 0:  # no adapter (y untouched), no piece of the group, or a spare tile past the segment's end
        return
    n0 = tl.program_id(2) * BLOCK_N
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    r_ok = offs_r < r
    bt = base + k * r * A_LD  # the first targeted module's BT
    pos = k * 0  # the module's index among the targeted ones
    delta = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    write = offs_n < 0  # the tile's columns of targeted modules (the others are left untouched)
    for m in tl.static_range(NUM_MODULES):
        if m == 0:
            start = 0
            end = END0
            ld = LD0
        elif m == 1:
            start = END0
            end = END1
            ld = LD1
        else:
            start = END1
            end = END2
            ld = LD2
        on = (mask >> m) & 1
        end = end * on  # an untargeted module: an empty column range
        cols_ok = (offs_n >= start) & (offs_n < end)
        write = write | cols_ok
        if (n0 < end) & (n0 + BLOCK_N > start):
            h_cols = pos * r + offs_r
            h = tl.load(
                h_ptr + rows[:, None] * stride_ht + h_cols[None, :] * stride_hr,
                mask=row_ok[:, None] & (r_ok & (h_cols < W))[None, :],
                other=0.0,
            )
            b = tl.load(
                pool_ptr + bt + offs_r[:, None].to(tl.int64) * ld + (offs_n - start)[None, :],
                mask=r_ok[:, None] & cols_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            delta += tl.dot(h, b, input_precision=PRECISION)
        bt += on * r * ld
        pos += on
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
    store_ok = row_ok[:, None] & write[None, :]
    y = tl.load(y_ptrs, mask=store_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=store_ok)
