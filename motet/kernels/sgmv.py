"""Punica-style SGMV (segmented gather matrix-vector) over a pool of adapters: each token adds its own adapter's
delta, whatever the adapters' ranks and targets.

Tokens are grouped in segments by adapter slot: segment ``i`` owns rows ``seg_starts[i]:seg_starts[i+1]``
and uses slot ``seg_slots[i]`` (-1: no adapter, rows untouched). For a *group* of ``n`` modules that read the
same input x and write adjacent columns of one fused output y (q/k/v, gate/up; or one module alone), each
segment with an adapter adds

    y[rows, module m's columns] += (x[rows] @ A_m^T) @ BT_m      (BT_m = (B_m * scale_m)^T)

computed as a *shrink* of x by every targeted module's A at once into an fp32 intermediate h, then an *expand*
of each module's ranks of h into its columns of y, in place, in y's dtype.

The weights live in one flat ``pool`` tensor (motet/lora/pool.py packs them) and a descriptor table ``desc``
[slots, 1 + 3 * groups] int64 says where: ``desc[s, 0]`` is the adapter's rank r; for group g, columns
``1 + 3g, 2 + 3g, 3 + 3g`` hold the element offset of layer 0's *piece* (-1: the adapter targets no module
of the group), the stride from one layer's piece to the next, and the mask of the group's modules it
targets. A piece is the targeted modules' A stacked, ``[k * r, a_ld]`` (row ``i * r + j``: the i-th targeted
module's rank j; k targeted modules), then each targeted module's ``BT [r, bt_ld[m]]``, in module order. Only
the first ``x.shape[1]`` columns of A and the first ``sizes[m]`` of BT_m are read (under tensor parallelism a
rank's part may be narrower than the pool's geometry).

The ``*_reference`` functions define the meaning and are also the CPU production path of the eager model (a
loop over segments with plain matmuls; the compiled CPU step runs motet/kernels/csrc/sgmv.h);
``*_triton`` are the GPU kernels; ``add_lora`` picks by device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from motet.kernels import triton_support

MAX_GROUP = 3  # modules sharing one input (q, k, v): the expand kernel's column ranges


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    desc: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    group: int,
    layer: int,
    a_ld: int,
    bt_ld: Sequence[int],
    sizes: Sequence[int] | None = None,
    max_rank: int,
    max_seg_len: int | None = None,
    rows: Mapping[int, Sequence[int]] | None = None,
) -> None:
    """``y += lora_delta(x)`` in place (y's dtype): one shrink then one expand, by device.

    ``max_rank``: the largest rank of the step's adapters (the GPU kernels' rank tile). ``max_seg_len``: an
    optional tuning hint for the GPU grid (without it the grid is sized from ``T`` with no device sync).
    ``rows``: the slots' descriptors on the host (the torch path reads them there; else from ``desc``).
    """
    sizes = _sizes(y, bt_ld, sizes)
    if x.is_cuda:
        add_lora_triton(
            y, x, pool, desc, seg_starts, seg_slots, group=group, layer=layer, a_ld=a_ld, bt_ld=bt_ld,
            sizes=sizes, max_rank=max_rank, max_seg_len=max_seg_len,
        )  # fmt: skip
    else:
        _add_lora_torch(y, x, pool, desc, seg_starts, seg_slots, group, layer, a_ld, bt_ld, sizes, rows)


def _sizes(y: torch.Tensor, bt_ld: Sequence[int], sizes: Sequence[int] | None) -> tuple[int, ...]:
    """The group's output columns per module (default: one module over all of y); ValueError where they do not
    fit y or the pool's geometry."""
    sizes = (y.shape[1],) if sizes is None else tuple(sizes)
    if not 1 <= len(sizes) <= MAX_GROUP or len(sizes) != len(bt_ld):
        raise ValueError(f"a group of {len(sizes)} modules, but the pool's geometry has {len(bt_ld)}")
    if sum(sizes) != y.shape[1] or any(s > ld for s, ld in zip(sizes, bt_ld, strict=True)):
        raise ValueError(f"sizes {sizes}: y {tuple(y.shape)}, the pool's rows {tuple(bt_ld)} do not fit")
    return sizes


# ---------------------------------------------------------------------------------------------------------
# torch: the reference and the CPU path


def _segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) of the non-empty segments that have an adapter (one host sync)."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    return [
        (starts[i], starts[i + 1], s) for i, s in enumerate(slots) if s >= 0 and starts[i + 1] > starts[i]
    ]


def piece(
    pool: torch.Tensor, row: Sequence[int], group: int, layer: int, a_ld: int, bt_ld: Sequence[int]
) -> tuple[int, list[int], torch.Tensor, list[torch.Tensor]] | None:
    """One adapter's piece of a group at a layer, as views into the pool: (rank, the targeted modules, A
    [k * r, a_ld], their BT [r, bt_ld[m]] each); None where it targets no module of the group."""
    r = int(row[0])
    offset, stride, mask = (int(row[1 + 3 * group + c]) for c in range(3))
    if offset < 0 or r == 0:
        return None
    present = [m for m in range(len(bt_ld)) if mask >> m & 1]
    base = offset + layer * stride
    k = len(present)
    A = pool[base : base + k * r * a_ld].view(k * r, a_ld)
    at, bts = base + k * r * a_ld, []
    for m in present:
        bts.append(pool[at : at + r * bt_ld[m]].view(r, bt_ld[m]))
        at += r * bt_ld[m]
    return r, present, A, bts


def _row(desc: torch.Tensor, rows: Mapping[int, Sequence[int]] | None, slot: int) -> Sequence[int]:
    """A slot's descriptor: from the host copy where given, else read from the table."""
    row = rows.get(slot) if rows is not None else None
    return row if row is not None else desc[slot].tolist()


def _columns(sizes: Sequence[int]) -> list[int]:
    out, c = [], 0
    for size in sizes:
        out.append(c)
        c += size
    return out


def sgmv_shrink_reference(
    x, pool, desc, seg_starts, seg_slots, *, group, layer, a_ld, bt_ld, width: int, rows=None
) -> torch.Tensor:
    """``h [T, width]`` fp32: each segment's ``x @ A^T`` over its adapter's targeted modules (columns ``0 .. k *
    r``; the rest, and rows without an adapter, zero)."""
    h = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
    for a, b, s in _segments(seg_starts, seg_slots):
        p = piece(pool, _row(desc, rows, s), group, layer, a_ld, bt_ld)
        if p is not None:
            A = p[2]
            h[a:b, : A.shape[0]] = x[a:b].float() @ A[:, : x.shape[1]].float().t()
    return h


def sgmv_expand_reference(
    h, pool, desc, seg_starts, seg_slots, y, *, group, layer, a_ld, bt_ld, sizes=None, rows=None
) -> None:
    """``y[:, module m's columns] += h_m @ BT_m`` per segment, in place, in y's dtype, where ``h_m`` are the
    columns ``pos * r .. (pos + 1) * r`` of h for m, the pos-th module its adapter targets."""
    sizes = _sizes(y, bt_ld, sizes)
    cols = _columns(sizes)
    for a, b, s in _segments(seg_starts, seg_slots):
        p = piece(pool, _row(desc, rows, s), group, layer, a_ld, bt_ld)
        if p is not None:
            _expand_segment(y[a:b], h[a:b], p, sizes, cols)


def _expand_segment(y, h, p, sizes, cols) -> None:
    """One segment's expand, module by module (h: its rows, the targeted modules' ranks one after another)."""
    r, present, _, bts = p
    for pos, m in enumerate(present):
        hm, BT, ym = (
            h[:, pos * r : (pos + 1) * r],
            bts[pos][:, : sizes[m]],
            y[:, cols[m] : cols[m] + sizes[m]],
        )
        if ym.dtype == torch.float32 and BT.dtype == torch.float32:
            ym.addmm_(hm, BT)  # fused: no temporary for the delta
        else:
            ym += torch.mm(hm, BT.float())  # fp32 delta, rounded once into y's dtype


def _add_lora_torch(y, x, pool, desc, seg_starts, seg_slots, group, layer, a_ld, bt_ld, sizes, rows) -> None:
    """The CPU path: one loop over segments; per segment one shrink for the whole group (one matmul), then
    each targeted module's expand into its columns (no [T, rank] buffer across segments)."""
    cols = _columns(sizes)
    for a, b, s in _segments(seg_starts, seg_slots):
        p = piece(pool, _row(desc, rows, s), group, layer, a_ld, bt_ld)
        if p is None:
            continue
        h = torch.mm(x[a:b].float(), p[2][:, : x.shape[1]].float().t())
        _expand_segment(y[a:b], h, p, sizes, cols)


def lora_delta_reference(
    x, pool, desc, seg_starts, seg_slots, *, group, layer, a_ld, bt_ld, sizes, rows=None
) -> torch.Tensor:
    """The LoRA delta ``[T, sum(sizes)]`` in fp32 (zero for rows without an adapter)."""
    delta = torch.zeros(x.shape[0], sum(sizes), dtype=torch.float32, device=x.device)
    _add_lora_torch(
        delta, x, pool, desc, seg_starts, seg_slots, group, layer, a_ld, bt_ld, tuple(sizes), rows
    )
    return delta


def add_embedding_lora(
    y: torch.Tensor,
    input_ids: torch.Tensor,
    pool: torch.Tensor,
    desc: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    group: int,
    a_ld: int,
    bt_ld: Sequence[int],
    max_rank: int,
    max_seg_len: int | None = None,
    rows: Mapping[int, Sequence[int]] | None = None,
) -> None:
    """``y[t] += BT^T @ A[:, input_ids[t]]`` in place for the embedding's group (PEFT's lora.Embedding: the
    shrink of a token is a lookup of its column of A [r, vocab]; the expand as for any group). On the GPU the
    lookups are one gather over every token (no device sync) and the expand is the Triton kernel's."""
    if not y.is_cuda:
        for a, b, s in _segments(seg_starts, seg_slots):
            p = piece(pool, _row(desc, rows, s), group, 0, a_ld, bt_ld)
            if p is not None:
                r, _, A, bts = p
                h = A[:, input_ids[a:b]].t().float()
                _expand_segment(y[a:b], h, p, (y.shape[1],), [0])
        return
    T, R = y.shape[0], max(1, max_rank)
    counts = (seg_starts[1:] - seg_starts[:-1]).long()
    slots = torch.repeat_interleave(seg_slots.long(), counts, output_size=T)  # each token's slot
    row = desc[slots.clamp(min=0)]
    rank, offset = row[:, 0], row[:, 1 + 3 * group]
    ranks = torch.arange(R, device=y.device)
    live = ((slots >= 0) & (offset >= 0)).unsqueeze(1) & (ranks.unsqueeze(0) < rank.unsqueeze(1))
    index = offset.unsqueeze(1) + ranks.unsqueeze(0) * a_ld + input_ids.long().unsqueeze(1)
    h = torch.where(live, pool[torch.where(live, index, 0)].float(), 0.0)  # [T, R]: A[:, token] per token
    sgmv_expand_triton(
        h, pool, desc, seg_starts, seg_slots, y, group=group, layer=0, a_ld=a_ld, bt_ld=bt_ld,
        sizes=(y.shape[1],), max_rank=R, max_seg_len=max_seg_len,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Triton: CUDA, or CPU under TRITON_INTERPRET=1

BLOCK_K = 64  # the shrink's step over x's columns
BLOCK_N = 64  # the expand's column tile of the fused output
MAX_BLOCK_R = 128  # the shrink's rank tile at most: wider groups take several rank tiles (a grid dimension)


def _grid_rows(num_tokens: int, num_segs: int, max_seg_len: int | None) -> tuple[int, int]:
    """(BLOCK_M, row tiles per segment). The grid is (segments, tiles, ...) and tiles past a segment's end exit
    at once, so without a hint the bound is all T rows in one segment (no device sync)."""
    guess = max_seg_len if max_seg_len is not None else (1 if num_tokens <= num_segs else num_tokens)
    block_m = 16 if guess <= 16 else 64  # 16: tl.dot's minimum (decode); 64 amortizes weight tiles (prefill)
    bound = num_tokens if max_seg_len is None else min(max_seg_len, num_tokens)
    return block_m, triton_support.cdiv(max(bound, 1), block_m)


def _check_pool(pool: torch.Tensor, desc: torch.Tensor) -> None:
    if pool.dim() != 1 or pool.stride(0) != 1:
        raise ValueError(f"the pool is one flat contiguous tensor, not {tuple(pool.shape)} {pool.stride()}")
    if desc.dim() != 2:
        raise ValueError(f"the descriptor table is [slots, columns], not {tuple(desc.shape)}")


def _launch(
    kernel,
    col_tiles,
    src,
    pool,
    desc,
    dst,
    seg_starts,
    seg_slots,
    layer,
    *scalars,
    group,
    max_seg_len,
    **meta,
):
    """One launch of a segment kernel over (segments, row tiles, `col_tiles`), reading `src` into `dst`: its
    arguments are the tensors, the layer, `scalars`, then the strides of src, the descriptors and dst."""
    block_m, tiles = _grid_rows(src.shape[0], seg_slots.shape[0], max_seg_len)
    kernel[(seg_slots.shape[0], tiles, col_tiles)](
        src, pool, desc, dst, seg_starts, seg_slots, layer, *scalars, *src.stride(), *desc.stride(), *dst.stride(),
        GROUP=group, BLOCK_M=block_m, **meta,
    )  # fmt: skip


def sgmv_shrink_triton(
    x: torch.Tensor,
    pool: torch.Tensor,
    desc: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    group: int,
    layer: int,
    a_ld: int,
    bt_ld: Sequence[int],
    max_rank: int,
    max_seg_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton shrink: ``h [T, n * max_rank]`` fp32 (n = len(bt_ld)), each segment's ``x @ A^T`` in columns
    ``0 .. k * r`` (its adapter's k targeted modules of the group, rank r <= max_rank), one launch for the
    group. Without `out`, h is zero elsewhere (as the reference's); into `out`, only those columns of the rows
    of segments with a piece of the group at this layer are written, the rest is left as it is. No device
    sync: the descriptors are read on the device. (A rank above max_rank is the caller's error: its product
    is cut to h's width, never read or written out of bounds.)"""
    if not triton_support.AVAILABLE:
        raise RuntimeError("sgmv_shrink_triton needs triton")
    _check_pool(pool, desc)
    num_tokens, k = x.shape
    n = len(bt_ld)
    if not 1 <= n <= MAX_GROUP or k > a_ld:
        raise ValueError(f"x {tuple(x.shape)} does not fit a group of {n} modules with A rows of {a_ld}")
    width = n * max_rank
    h = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device) if out is None else out
    if h.shape != (num_tokens, width) or h.dtype != torch.float32:
        raise ValueError(f"out {tuple(h.shape)} {h.dtype}: the shrink writes [{num_tokens}, {width}] fp32")
    num_segs = seg_slots.shape[0]
    if num_tokens == 0 or num_segs == 0 or width == 0:
        return h
    block_r = min(max(16, triton_support.next_power_of_2(width)), MAX_BLOCK_R)
    # fp32 dots unless x and the pool are the same 16-bit type: fp32 operands get true fp32 (tl.dot defaults to
    # tf32 on NVIDIA), as in torch; mixed types are upcast (x rounded to the pool's type would lose bits). Under
    # TRITON_INTERPRET=1 (CPU tensors) tl.dot on bf16 multiplies raw bits (triton 3.9): always fp32 there.
    dot_fp32 = not x.is_cuda or x.dtype == torch.float32 or x.dtype != pool.dtype
    _launch(
        _jit()._shrink_kernel, triton_support.cdiv(width, block_r), x, pool, desc, h, seg_starts, seg_slots, layer, k, a_ld, width,
        group=group, max_seg_len=max_seg_len, NUM_MODULES=n, BLOCK_R=block_r, BLOCK_K=BLOCK_K, DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else None,
    )  # fmt: skip
    return h


def sgmv_expand_triton(
    h: torch.Tensor,
    pool: torch.Tensor,
    desc: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    group: int,
    layer: int,
    a_ld: int,
    bt_ld: Sequence[int],
    sizes: Sequence[int] | None = None,
    max_rank: int,
    max_seg_len: int | None = None,
) -> None:
    """Triton expand: ``y[:, module m's columns] += h_m @ BT_m[:, :sizes[m]]`` for every module m each
    segment's adapter targets, in one launch for the group (a column tile may hold two modules), in place, in
    y's dtype. Reads only the columns ``pos * r .. (pos + 1) * r`` of h of rows whose segment's adapter has a
    piece of the group (those the shrink wrote). Every other element of y is left bit-identical. No device
    sync."""
    if not triton_support.AVAILABLE:
        raise RuntimeError("sgmv_expand_triton needs triton")
    _check_pool(pool, desc)
    sizes = _sizes(y, bt_ld, sizes)
    num_tokens, width = h.shape
    n = len(bt_ld)
    if width != n * max_rank or y.shape[0] != num_tokens or h.dtype != torch.float32:
        raise ValueError(f"h {tuple(h.shape)} {h.dtype}, y {tuple(y.shape)}: not [T, {n} * {max_rank}] fp32")
    num_segs = seg_slots.shape[0]
    if num_tokens == 0 or num_segs == 0 or width == 0:
        return
    cols = [*_columns(sizes)[1:], y.shape[1]]
    ends = cols + [y.shape[1]] * (MAX_GROUP - n)
    lds = list(bt_ld) + [0] * (MAX_GROUP - n)
    _launch(
        _jit()._expand_kernel, triton_support.cdiv(y.shape[1], BLOCK_N), h, pool, desc, y, seg_starts, seg_slots, layer, a_ld,
        width, *ends, *lds, group=group, max_seg_len=max_seg_len, NUM_MODULES=n,
        BLOCK_R=max(16, triton_support.next_power_of_2(max_rank)), BLOCK_N=BLOCK_N,
        # h is fp32; y in fp32 gets true fp32 dots, a 16-bit y takes tf32 (below its own rounding)
        PRECISION="ieee" if not y.is_cuda or y.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def add_lora_triton(
    y, x, pool, desc, seg_starts, seg_slots, *, group, layer, a_ld, bt_ld, sizes, max_rank, max_seg_len=None
) -> None:
    """The GPU path of `add_lora` (two launches: the shrink, the expand). The shrink writes into an
    uninitialized h (no memset): the expand reads only what it wrote."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} have different rows")
    geometry = dict(
        group=group, layer=layer, a_ld=a_ld, bt_ld=bt_ld, max_rank=max_rank, max_seg_len=max_seg_len
    )
    h = torch.empty(x.shape[0], len(bt_ld) * max_rank, dtype=torch.float32, device=x.device)
    sgmv_shrink_triton(x, pool, desc, seg_starts, seg_slots, out=h, **geometry)
    sgmv_expand_triton(h, pool, desc, seg_starts, seg_slots, y, sizes=sizes, **geometry)


def _jit():
    """This module's Triton kernels (motet/kernels/jit/sgmv.py), imported at their first launch."""
    return triton_support.kernels(__name__)
