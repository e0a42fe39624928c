"""Punica-style SGMV (segmented gather matrix-vector): each token adds its own LoRA adapter's delta.

Tokens are grouped in segments by adapter slot: segment ``i`` owns rows ``seg_starts[i]:seg_starts[i+1]``
and uses slot ``seg_slots[i]`` (-1: no adapter, rows untouched). For each segment with an adapter

    y[s_i:s_(i+1)] += (x[s_i:s_(i+1)] @ A_i^T) @ B_i^T * scale_i

computed as a *shrink* to an fp32 intermediate ``h [T, n * max_rank]`` then an *expand* added into ``y`` in
place. Stacked weights, as the slot cache holds them (PEFT orientation), for a *group* of ``n`` modules that
read the same input and write adjacent columns of one fused output (q/k/v, gate/up; or one module alone):

- ``A_stack [num_slots, n * max_rank, in]``, rank-major: row ``j * n + m`` is module ``m``'s rank ``j`` (so
  the first ``n * r`` rows are every module's first ``r`` ranks: one shrink serves the whole group, and
  cutting a batch to rank ``r`` is a plain slice);
- ``B_stack [num_slots, sum(sizes), max_rank]``: module ``m``'s B at its columns of the fused output;
- ``scales [n, num_slots]`` fp32 (``[num_slots]`` for one module).

Adapters of lower rank are zero-padded to ``max_rank`` and modules an adapter does not target are zero, so
one launch mixes ranks and target sets. ``sizes`` gives each module's output columns (default: one module
over all of y); ``active`` the modules whose expand runs (default all: a module no adapter of the batch
targets adds zero, skipping it only saves the work).

The ``*_reference`` functions define the meaning and are also the CPU production path (a loop over
segments with plain matmuls measured fastest on CPU); ``*_triton`` are the GPU kernels (one program per
segment and row tile; the expand writes every module's columns in one launch); ``add_lora`` picks by device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is Linux-only; the torch reference serves elsewhere
    triton = None
    tl = None

MAX_GROUP = 3  # modules sharing one input (q, k, v): the expand kernel's column ranges


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scales: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    active: Sequence[bool] | None = None,
    max_seg_len: int | None = None,
) -> None:
    """``y += lora_delta(x)`` in place (y's dtype): one shrink then one expand, by device.

    ``max_seg_len`` is an optional tuning hint for the GPU grid (the caller knows it from its host-side
    batch metadata); without it the grid is sized from ``T`` with no device sync.
    """
    if x.is_cuda:
        add_lora_triton(
            y,
            x,
            A_stack,
            B_stack,
            scales,
            seg_starts,
            seg_slots,
            sizes=sizes,
            active=active,
            max_seg_len=max_seg_len,
        )
    else:
        _add_lora_torch(y, x, A_stack, B_stack, scales, seg_starts, seg_slots, sizes, active)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scales: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    active: Sequence[bool] | None = None,
    max_seg_len: int | None = None,
) -> None:
    """The GPU path of `add_lora`: two launches, the shrink into an uninitialized ``h`` (the expand reads only
    the rows of segments with an adapter, which the shrink writes: no memset kernel) and the expand."""
    h = torch.empty(x.shape[0], A_stack.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink_triton(x, A_stack, seg_starts, seg_slots, max_seg_len=max_seg_len, out=h)
    sgmv_expand_triton(
        h, B_stack, scales, seg_starts, seg_slots, y, sizes=sizes, active=active, max_seg_len=max_seg_len
    )


def _group(y: torch.Tensor, B_stack: torch.Tensor, scales: torch.Tensor, sizes, active):
    """(column ranges, active flags, scales [n, S]) of a group; ValueError where the shapes disagree."""
    sizes = (y.shape[1],) if sizes is None else tuple(sizes)
    active = (True,) * len(sizes) if active is None else tuple(bool(a) for a in active)
    scales = scales.view(1, -1) if scales.dim() == 1 else scales
    if not 1 <= len(sizes) <= MAX_GROUP or len(active) != len(sizes) or scales.shape[0] != len(sizes):
        raise ValueError(
            f"a group of {len(sizes)} modules: {len(active)} active flags, scales {tuple(scales.shape)}"
        )
    if sum(sizes) != y.shape[1] or B_stack.shape[1] != y.shape[1]:
        raise ValueError(f"sizes {sizes}: y {tuple(y.shape)}, B_stack {tuple(B_stack.shape)} do not fit")
    cols, c = [], 0
    for size in sizes:
        cols.append((c, c + size))
        c += size
    return cols, active, scales


# ---------------------------------------------------------------------------------------------------------
# torch: the reference and the CPU path


def _segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) of the non-empty segments that have an adapter (one host sync)."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    return [
        (starts[i], starts[i + 1], s) for i, s in enumerate(slots) if s >= 0 and starts[i + 1] > starts[i]
    ]


def sgmv_shrink_reference(
    x: torch.Tensor, A_stack: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """``h [T, n * max_rank]`` fp32: ``x @ A_slot^T`` per segment; rows without an adapter are zero."""
    h = torch.zeros(x.shape[0], A_stack.shape[1], dtype=torch.float32, device=x.device)
    for a, b, s in _segments(seg_starts, seg_slots):
        torch.mm(x[a:b].float(), A_stack[s].float().t(), out=h[a:b])
    return h


def sgmv_expand_reference(
    h: torch.Tensor,
    B_stack: torch.Tensor,
    scales: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    active: Sequence[bool] | None = None,
) -> None:
    """``y[:, module m's columns] += h_m @ B_slot[m's columns]^T * scale_slot[m]`` per segment, in place, in
    y's dtype, where ``h_m = h[:, m::n]`` are module m's ranks."""
    cols, active, scales = _group(y, B_stack, scales, sizes, active)
    scale = scales.tolist()
    for a, b, s in _segments(seg_starts, seg_slots):
        _expand_segment(y[a:b], h[a:b], B_stack[s], [row[s] for row in scale], cols, active)


def _expand_segment(y, h, B, scales, cols, active) -> None:
    """One segment's expand, module by module (h: its rows, rank-major over the group's modules)."""
    n = len(cols)
    for m, (c0, c1) in enumerate(cols):
        if not active[m]:
            continue
        hm, Bm, ym = h[:, m::n], B[c0:c1], y[:, c0:c1]
        if ym.dtype == torch.float32 and Bm.dtype == torch.float32:
            ym.addmm_(hm, Bm.t(), alpha=scales[m])  # fused: no temporary for the delta
        else:
            ym += torch.mm(hm, Bm.float().t()).mul_(scales[m])  # fp32 delta, rounded once into y's dtype


def _add_lora_torch(y, x, A_stack, B_stack, scales, seg_starts, seg_slots, sizes, active) -> None:
    """The CPU path: one loop over segments; per segment one shrink for the whole group (one matmul), then
    each active module's expand into its columns (no [T, rank] buffer across segments)."""
    cols, active, scales = _group(y, B_stack, scales, sizes, active)
    scale = scales.tolist()
    for a, b, s in _segments(seg_starts, seg_slots):
        h = torch.mm(x[a:b].float(), A_stack[s].float().t())
        _expand_segment(y[a:b], h, B_stack[s], [row[s] for row in scale], cols, active)


def lora_delta_reference(
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scales: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The LoRA delta ``[T, sum(sizes)]`` in fp32 (zero for rows without an adapter)."""
    delta = torch.zeros(x.shape[0], B_stack.shape[1], dtype=torch.float32, device=x.device)
    sgmv_expand_reference(
        sgmv_shrink_reference(x, A_stack, seg_starts, seg_slots),
        B_stack,
        scales,
        seg_starts,
        seg_slots,
        delta,
        sizes=sizes,
    )
    return delta


# ---------------------------------------------------------------------------------------------------------
# Triton: CUDA, or CPU under TRITON_INTERPRET=1


def _grid_rows(num_tokens: int, num_segs: int, max_seg_len: int | None) -> tuple[int, int]:
    """(BLOCK_M, row tiles per segment). The grid is (segments, tiles) and tiles past a segment's end exit at
    once, so without a hint the bound is all T rows in one segment (no device sync)."""
    guess = max_seg_len if max_seg_len is not None else (1 if num_tokens <= num_segs else num_tokens)
    block_m = 16 if guess <= 16 else 64  # 16: tl.dot's minimum (decode); 64 amortizes weight tiles (prefill)
    bound = num_tokens if max_seg_len is None else min(max_seg_len, num_tokens)
    return block_m, triton.cdiv(max(bound, 1), block_m)


def _precision(*tensors: torch.Tensor) -> str | None:
    # fp32 operands get true fp32 dots (tl.dot defaults to tf32 on NVIDIA), as in torch; the expand's fp32
    # intermediate times low-precision B may use tf32. bf16/fp16 dots take the default (None).
    interpreted = not tensors[0].is_cuda
    return "ieee" if interpreted or all(t.dtype == torch.float32 for t in tensors) else None


def sgmv_shrink_triton(
    x: torch.Tensor,
    A_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton shrink: ``h [T, n * max_rank]`` fp32 (A_stack's rows: a group's modules in one launch), zero for
    rows without an adapter; into `out` if given, whose rows without an adapter are left as they are. No
    device sync."""
    if triton is None:
        raise RuntimeError("sgmv_shrink_triton needs triton")
    num_tokens, k = x.shape
    num_slots, rank, k_a = A_stack.shape
    if k_a != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit A_stack {tuple(A_stack.shape)}")
    h = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device) if out is None else out
    if h.shape != (num_tokens, rank) or h.dtype != torch.float32:
        raise ValueError(f"out {tuple(h.shape)} {h.dtype}: the shrink writes [{num_tokens}, {rank}] fp32")
    num_segs = seg_slots.shape[0]
    if num_tokens == 0 or num_segs == 0 or rank == 0:
        return h
    block_m, tiles = _grid_rows(num_tokens, num_segs, max_seg_len)
    _shrink_kernel[(num_segs, tiles)](
        x,
        A_stack,
        h,
        seg_starts,
        seg_slots,
        k,
        rank,
        *x.stride(),
        *A_stack.stride(),
        *h.stride(),
        BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_K=64,
        PRECISION=_precision(x, A_stack),
        # Under TRITON_INTERPRET=1 (CPU tensors) tl.dot on bf16 multiplies raw bits (triton 3.9): upcast there.
        DOT_FP32=not x.is_cuda,
    )
    return h


def sgmv_expand_triton(
    h: torch.Tensor,
    B_stack: torch.Tensor,
    scales: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    sizes: Sequence[int] | None = None,
    active: Sequence[bool] | None = None,
    max_seg_len: int | None = None,
) -> None:
    """Triton expand: every active module's ``y`` columns ``+= h_m @ B_slot^T * scale_slot[m]`` in one
    launch, in place, in y's dtype. No device sync."""
    if triton is None:
        raise RuntimeError("sgmv_expand_triton needs triton")
    cols, active, scales = _group(y, B_stack, scales, sizes, active)
    num_tokens, width = h.shape
    num_slots, n, rank = B_stack.shape
    if rank * len(cols) != width or y.shape[0] != num_tokens:
        raise ValueError(f"h {tuple(h.shape)}, B_stack {tuple(B_stack.shape)}, y {tuple(y.shape)} do not fit")
    num_segs = seg_slots.shape[0]
    if num_tokens == 0 or num_segs == 0 or rank == 0 or not any(active):
        return
    block_m, tiles = _grid_rows(num_tokens, num_segs, max_seg_len)
    block_n = 64
    ends = [c1 for _, c1 in cols] + [n] * (MAX_GROUP - len(cols))
    _expand_kernel[(num_segs, tiles, triton.cdiv(n, block_n))](
        h,
        B_stack,
        scales,
        y,
        seg_starts,
        seg_slots,
        rank,
        *ends,
        sum(1 << m for m, a in enumerate(active) if a),
        *h.stride(),
        *B_stack.stride(),
        *scales.stride(),
        *y.stride(),
        NUM_MODULES=len(cols),
        BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_N=block_n,
        PRECISION=_precision(y, B_stack) or "tf32",
    )


if triton is not None:

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
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        h_ptr,
        seg_starts_ptr,
        seg_slots_ptr,
        K,
        R,
        stride_xt,
        stride_xk,
        stride_as,
        stride_ar,
        stride_ak,
        stride_ht,
        stride_hr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        slot, rows, row_ok = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
        if slot < 0:  # no adapter (h stays zero) or a spare tile past the segment's end
            return
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk
        a_base = a_ptr + slot * stride_as
        a_ptrs = a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak  # A^T tile [K, R]
        # tl.full, not tl.zeros (a triton.jit helper: stays compiled if triton was imported before
        # TRITON_INTERPRET was set, which breaks the tests' re-decoration)
        acc = tl.full([BLOCK_M, BLOCK_R], 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=k_ok[:, None] & (offs_r[None, :] < R), other=0.0)
            if DOT_FP32:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            else:
                at = at.to(xt.dtype)
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K * stride_ak
        h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
        tl.store(h_ptrs, acc, mask=row_ok[:, None] & (offs_r[None, :] < R))

    @triton.jit
    def _expand_kernel(
        h_ptr,
        b_ptr,
        scales_ptr,
        y_ptr,
        seg_starts_ptr,
        seg_slots_ptr,
        R,
        END0,
        END1,
        END2,
        ACTIVE,
        stride_ht,
        stride_hr,
        stride_bs,
        stride_bn,
        stride_br,
        stride_sm,
        stride_ss,
        stride_yt,
        stride_yn,
        NUM_MODULES: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (segment, row tile, column tile): the delta of each active module whose columns
        [END(m-1), END(m)) meet the tile, from its ranks h[:, m::NUM_MODULES] (usually one module a tile)."""
        slot, rows, row_ok = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
        if slot < 0:  # no adapter (y untouched) or a spare tile past the segment's end
            return
        n0 = tl.program_id(2) * BLOCK_N
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        r_ok = offs_r < R
        b_base = b_ptr + slot * stride_bs
        b_ptrs = b_base + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn  # B^T tile [R, N]
        delta = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        write = offs_n < 0  # the tile's columns of active modules (the others are left untouched)
        for m in tl.static_range(NUM_MODULES):
            if m == 0:
                start = 0
                end = END0
            elif m == 1:
                start = END0
                end = END1
            else:
                start = END1
                end = END2
            end = end * ((ACTIVE >> m) & 1)  # an inactive module: an empty column range
            cols_ok = (offs_n >= start) & (offs_n < end)
            write = write | cols_ok
            if (n0 < end) & (n0 + BLOCK_N > start):
                h = tl.load(
                    h_ptr + rows[:, None] * stride_ht + (offs_r[None, :] * NUM_MODULES + m) * stride_hr,
                    mask=row_ok[:, None] & r_ok[None, :],
                    other=0.0,
                )
                b = tl.load(b_ptrs, mask=r_ok[:, None] & cols_ok[None, :], other=0.0).to(tl.float32)
                scale = tl.load(scales_ptr + m * stride_sm + slot * stride_ss)
                delta += tl.dot(h, b, input_precision=PRECISION) * scale
        y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
        mask = row_ok[:, None] & write[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
