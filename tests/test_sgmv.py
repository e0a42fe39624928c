"""SGMV shrink/expand: the torch reference (CPU path) and the Triton kernels against a naive float64
per-token loop. Without CUDA the kernels run under TRITON_INTERPRET=1 (slow: shapes stay small)."""

from __future__ import annotations

import pytest
import torch

from motet.kernels import sgmv

# tests/conftest.py turns TRITON_INTERPRET on (no CUDA) before anything imports triton.
HAS_TRITON = sgmv.triton is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def make_case(
    seed,
    num_tokens,
    num_segs,
    d_in,
    d_out,
    max_rank,
    lens=None,
    num_slots=5,
    dtype=torch.float32,
    device="cpu",
):
    """Random segments (some empty, some one token, some without adapter; or the given `lens`) over random
    slots whose ranks 1..max_rank are mixed, zero-padded to max_rank as the slot cache stores them."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, num_tokens + 1, (num_segs - 1,), generator=g).sort().values
    if lens is not None:
        cuts = torch.tensor(lens[:-1]).cumsum(0)
    starts = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])]).to(torch.int32)
    slots = torch.randint(-1, num_slots, (num_segs,), generator=g).to(torch.int32)
    ranks = torch.randint(1, max_rank + 1, (num_slots,), generator=g)
    ranks[0] = max_rank
    A = torch.randn(num_slots, max_rank, d_in, generator=g) / d_in**0.5
    B = torch.randn(num_slots, d_out, max_rank, generator=g) / max_rank**0.5
    for s, r in enumerate(ranks.tolist()):
        A[s, r:] = 0
        B[s, :, r:] = 0
    scales = torch.rand(num_slots, generator=g) * 2
    x = torch.randn(num_tokens, d_in, generator=g)
    y = torch.randn(num_tokens, d_out, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)
    return dict(x=to(x), A=to(A), B=to(B), scales=scales.to(device), starts=starts.to(device), slots=slots.to(device),
                y=to(y))  # fmt: skip


def naive(c):
    """Per token, in float64, from the (already rounded) inputs: (h, delta)."""
    x, A, B = c["x"].cpu().double(), c["A"].cpu().double(), c["B"].cpu().double()
    h = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float64)
    delta = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float64)
    starts, slots, scales = c["starts"].tolist(), c["slots"].tolist(), c["scales"].tolist()
    for i, s in enumerate(slots):
        for t in range(starts[i], starts[i + 1]):
            if s >= 0:
                h[t] = A[s] @ x[t]
                delta[t] = B[s] @ h[t] * scales[s]
    return h, delta


def check_expand(y_out, y_in, delta, dtype):
    want = y_in.cpu().double() + delta
    if dtype == torch.float32:
        torch.testing.assert_close(y_out.cpu().double(), want, atol=1e-5, rtol=1e-5)
    else:  # one rounding of the fp32 sum into bf16
        torch.testing.assert_close(y_out.cpu().double(), want, atol=1e-2, rtol=1e-2)
    untouched = delta.abs().sum(1) == 0
    assert torch.equal(y_out.cpu()[untouched], y_in.cpu()[untouched])  # rows without adapter: bit-identical


def run_ops(c, shrink, expand, **kw):
    h = shrink(c["x"], c["A"], c["starts"], c["slots"], **kw)
    assert h.dtype == torch.float32 and h.shape == (c["x"].shape[0], c["A"].shape[1])
    y = c["y"].clone()
    expand(h, c["B"], c["scales"], c["starts"], c["slots"], y, **kw)
    return h, y


# (seed, tokens, segments, in, out, max_rank): empty and one-token segments occur by construction.
REF_CASES = [
    (0, 1, 1, 32, 48, 1),
    (1, 17, 6, 64, 40, 8),
    (2, 64, 64, 96, 160, 16),  # decode-like: mostly one token per segment
    (3, 200, 9, 576, 320, 64),
    (4, 33, 12, 40, 24, 33),
]
TRITON_CASES = [
    (0, 1, 1, 16, 24, 1),
    (1, 13, 5, 48, 40, 8),
    (2, 24, 24, 40, 72, 16),  # T <= S: 16-row tiles
    (3, 70, 4, 80, 24, 64),  # long segments: 64-row tiles, several K and N tiles
    (4, 20, 9, 32, 20, 5),
    (5, 30, 30, 32, 20, 4, [0] * 10 + [25] + [0] * 14 + [1] * 5),  # T <= S, yet one segment spans 2 tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", REF_CASES, ids=[f"case{c[0]}" for c in REF_CASES])
def test_reference_and_cpu_path(case, dtype):
    c = make_case(*case, dtype=dtype)
    h_want, delta = naive(c)
    h, y = run_ops(c, sgmv.sgmv_shrink_reference, sgmv.sgmv_expand_reference)
    torch.testing.assert_close(h.double(), h_want, atol=1e-5, rtol=1e-5)
    check_expand(y, c["y"], delta, dtype)

    y = c["y"].clone()
    sgmv.add_lora(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"])  # CPU: the fused loop
    check_expand(y, c["y"], delta, dtype)
    d = sgmv.lora_delta_reference(c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"])
    assert d.dtype == torch.float32
    torch.testing.assert_close(d.double(), delta, atol=1e-5, rtol=1e-5)


def _expand_of(h, c):
    """float64 expand of the given fp32 h (isolates the expand's error from the shrink's)."""
    B, out = c["B"].cpu().double(), torch.zeros(h.shape[0], c["B"].shape[1], dtype=torch.float64)
    starts, slots, scales = c["starts"].tolist(), c["slots"].tolist(), c["scales"].tolist()
    for i, s in enumerate(slots):
        if s >= 0:
            a, b = starts[i], starts[i + 1]
            out[a:b] = h[a:b].cpu().double() @ B[s].T * scales[s]
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=[f"case{c[0]}" for c in TRITON_CASES])
def test_triton(case, dtype):
    c = make_case(*case, dtype=dtype, device=DEVICE)
    h_want, delta = naive(c)
    h, y = run_ops(c, sgmv.sgmv_shrink_triton, sgmv.sgmv_expand_triton)
    torch.testing.assert_close(h.cpu().double(), h_want, atol=1e-5, rtol=1e-5)
    check_expand(y, c["y"], _expand_of(h, c), dtype)

    # The exact hint resizes the grid (and maybe the row tile); results stay right.
    seg_lens = (c["starts"][1:] - c["starts"][:-1]).tolist()
    h, y = run_ops(c, sgmv.sgmv_shrink_triton, sgmv.sgmv_expand_triton, max_seg_len=max(seg_lens))
    torch.testing.assert_close(h.cpu().double(), h_want, atol=1e-5, rtol=1e-5)
    check_expand(y, c["y"], _expand_of(h, c), dtype)


@needs_triton
def test_triton_strided_output_and_add_lora():
    """y may be a column slice of a wider buffer (e.g. q of a fused qkv output): the rest is untouched."""
    c = make_case(7, 21, 5, 32, 24, 8, device=DEVICE)
    wide = torch.randn(21, 40, device=DEVICE)
    before = wide.clone()
    y = wide[:, 8:32]
    h = sgmv.sgmv_shrink_triton(c["x"], c["A"], c["starts"], c["slots"])
    sgmv.sgmv_expand_triton(h, c["B"], c["scales"], c["starts"], c["slots"], y)
    check_expand(y, before[:, 8:32], naive(c)[1], torch.float32)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 32:], before[:, 32:])

    if DEVICE == "cuda":
        y = c["y"].clone()
        sgmv.add_lora(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"])
        check_expand(y, c["y"], naive(c)[1], torch.float32)


def test_reference_strided_output():
    c = make_case(8, 21, 5, 32, 24, 8)
    wide = torch.randn(21, 40)
    before = wide.clone()
    sgmv.add_lora(wide[:, 8:32], c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"])
    check_expand(wide[:, 8:32], before[:, 8:32], naive(c)[1], torch.float32)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 32:], before[:, 32:])


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_nothing_to_do(impl):
    shrink, expand = getattr(sgmv, f"sgmv_shrink_{impl}"), getattr(sgmv, f"sgmv_expand_{impl}")
    device = DEVICE if impl == "triton" else "cpu"
    for case in [(0, 0, 1, 16, 16, 4), (1, 9, 3, 16, 16, 4)]:
        c = make_case(*case, device=device)
        c["slots"].fill_(-1)  # no token has an adapter
        h, y = run_ops(c, shrink, expand)
        assert not h.any() and torch.equal(y, c["y"])
    c = make_case(2, 5, 1, 16, 16, 4, device=device)
    c["starts"], c["slots"] = c["starts"][:1], c["slots"][:0]  # zero segments
    h, y = run_ops(c, shrink, expand)
    assert not h.any() and torch.equal(y, c["y"])


# -- module groups: modules that read one input (q/k/v, gate/up), one shrink and one expand for all ----------


def make_group_case(
    seed, num_tokens, num_segs, d_in, sizes, max_rank, num_slots=5, dtype=torch.float32, device="cpu"
):
    """Random segments over slots of mixed ranks, each slot targeting a random subset of the group's modules
    (slot 0: all of them at max_rank; slot 1: only the first and the last), stacked as the slot cache stacks
    them: A [S, n * R, in] rank-major (row j * n + m: module m's rank j), B [S, sum(sizes), R], scales [n, S],
    zero past each slot's rank and in the modules it does not target."""
    c = make_case(seed, num_tokens, num_segs, d_in, sum(sizes), max_rank, num_slots=num_slots)
    g = torch.Generator().manual_seed(seed + 100)
    n, R = len(sizes), max_rank
    ranks = torch.randint(1, R + 1, (num_slots,), generator=g).tolist()
    targets = (torch.rand(num_slots, n, generator=g) < 0.6).tolist()
    ranks[0], targets[0] = R, [True] * n
    targets[1] = [m in (0, n - 1) for m in range(n)]
    A = torch.randn(num_slots, R, n, d_in, generator=g) / d_in**0.5
    B = torch.randn(num_slots, sum(sizes), R, generator=g) / R**0.5
    scales = torch.rand(n, num_slots, generator=g) * 2
    col = 0
    for m, size in enumerate(sizes):
        for s in range(num_slots):
            A[s, ranks[s] :, m] = 0
            B[s, col : col + size, ranks[s] :] = 0
            if not targets[s][m]:
                A[s, :, m], B[s, col : col + size], scales[m, s] = 0, 0, 0
        col += size
    to = lambda t: t.to(device=device, dtype=dtype)
    c.update(x=to(c["x"]), y=to(c["y"]), A=to(A.reshape(num_slots, R * n, d_in)), B=to(B))
    c.update(
        scales=scales.to(device),
        starts=c["starts"].to(device),
        slots=c["slots"].to(device),
        sizes=tuple(sizes),
    )
    used = {s for s in c["slots"].tolist() if s >= 0}
    c["active"] = tuple(any(targets[s][m] for s in used) for m in range(n))
    return c


def naive_group(c):
    """Per token and module, in float64: (h [T, n * R] rank-major, delta [T, sum(sizes)])."""
    x, B = c["x"].cpu().double(), c["B"].cpu().double()
    n, S = len(c["sizes"]), c["A"].shape[0]
    A = c["A"].cpu().double().view(S, -1, n, x.shape[1])
    h = torch.zeros(x.shape[0], A.shape[1], n, dtype=torch.float64)
    delta = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float64)
    starts, slots, scales = c["starts"].tolist(), c["slots"].tolist(), c["scales"].tolist()
    for i, s in enumerate(slots):
        for t in range(starts[i], starts[i + 1]):
            if s < 0:
                continue
            col = 0
            for m, size in enumerate(c["sizes"]):
                h[t, :, m] = A[s, :, m] @ x[t]
                delta[t, col : col + size] = B[s, col : col + size] @ h[t, :, m] * scales[m][s]
                col += size
    return h.flatten(1), delta


def _group_expand_of(h, c):
    """float64 expand of the given fp32 h (rank-major over the group's modules)."""
    n = len(c["sizes"])
    B, out = c["B"].cpu().double(), torch.zeros(h.shape[0], c["B"].shape[1], dtype=torch.float64)
    starts, slots, scales = c["starts"].tolist(), c["slots"].tolist(), c["scales"].tolist()
    for i, s in enumerate(slots):
        if s < 0:
            continue
        a, b, col = starts[i], starts[i + 1], 0
        for m, size in enumerate(c["sizes"]):
            out[a:b, col : col + size] = h[a:b, m::n].cpu().double() @ B[s, col : col + size].T * scales[m][s]
            col += size
    return out


def check_group(y_out, c, delta, dtype, active):
    """y's active modules' columns got the delta; inactive modules' columns and adapter-less rows are
    bit-identical to the input."""
    check_expand(y_out, c["y"], delta, dtype)
    col = 0
    for m, size in enumerate(c["sizes"]):
        if not active[m]:
            assert torch.equal(y_out[:, col : col + size].cpu(), c["y"][:, col : col + size].cpu())
        col += size


# (seed, tokens, segments, in, module sizes, max_rank): q/k/v with q, k, v of different widths, gate/up, one
# module; widths that put two modules in one 64-column tile of the Triton expand, and ones that do not.
GROUP_REF_CASES = [
    (10, 1, 1, 32, (32, 16, 16), 4),
    (11, 40, 9, 64, (64, 16, 16), 8),
    (12, 64, 64, 96, (96, 32, 32), 16),  # decode-like
    (13, 120, 7, 48, (80, 80), 16),  # gate/up
    (14, 33, 12, 40, (40, 24, 24), 5),
    (15, 20, 5, 32, (24,), 8),
]
GROUP_TRITON_CASES = [
    (10, 1, 1, 16, (32, 16, 16), 4),
    (11, 24, 24, 32, (40, 24, 24), 8),  # T <= S: 16-row tiles; tile 0 holds q and k columns
    (12, 70, 4, 48, (64, 16, 16), 16),  # long segments: 64-row tiles, several K tiles
    (13, 20, 9, 32, (48, 48), 5),  # gate/up; mixed ranks below the 16-wide rank tile
    (14, 9, 3, 16, (20,), 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GROUP_REF_CASES, ids=[f"case{c[0]}" for c in GROUP_REF_CASES])
def test_group_reference_and_cpu_path(case, dtype):
    c = make_group_case(*case, dtype=dtype)
    h_want, delta = naive_group(c)
    group = dict(sizes=c["sizes"], active=c["active"])
    h = sgmv.sgmv_shrink_reference(c["x"], c["A"], c["starts"], c["slots"])
    torch.testing.assert_close(h.double(), h_want, atol=1e-5, rtol=1e-5)
    y = c["y"].clone()
    sgmv.sgmv_expand_reference(h, c["B"], c["scales"], c["starts"], c["slots"], y, **group)
    check_group(y, c, delta, dtype, c["active"])

    y = c["y"].clone()
    sgmv.add_lora(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], **group)  # the CPU path
    check_group(y, c, delta, dtype, c["active"])
    d = sgmv.lora_delta_reference(
        c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], sizes=c["sizes"]
    )
    torch.testing.assert_close(d.double(), delta, atol=1e-5, rtol=1e-5)


def test_group_cpu_path_shrinks_once_per_segment(monkeypatch):
    """q/k/v of two adapter segments: two shrink products (one per segment), not six."""
    c = make_group_case(16, 12, 3, 32, (32, 16, 16), 8)
    c["starts"], c["slots"] = (
        torch.tensor([0, 5, 7, 12], dtype=torch.int32),
        torch.tensor([0, -1, 2], dtype=torch.int32),
    )
    calls, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **kw: calls.append(a[1].shape) or mm(*a, **kw))
    y = c["y"].clone()
    sgmv.add_lora(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], sizes=c["sizes"])
    monkeypatch.undo()
    assert calls == [(32, 3 * 8)] * 2  # x @ A_cat^T: every module's ranks at once (fp32 expands: addmm_)
    check_group(y, c, naive_group(c)[1], torch.float32, (True,) * 3)


def test_group_inactive_module_is_skipped():
    """A module flagged inactive (no adapter of the batch targets it: its stacks are zero) is not expanded:
    its columns stay bit-identical, -0.0 included."""
    c = make_group_case(17, 15, 4, 32, (32, 16, 16), 4)
    col = 32
    c["B"][:, col : col + 16] = 0
    c["y"][:, col : col + 16] = -0.0
    active = (True, False, True)
    delta = naive_group(c)[1]
    for impl in ("reference", "triton") if HAS_TRITON else ("reference",):
        y = c["y"].clone()
        if impl == "reference":
            sgmv.add_lora(
                y,
                c["x"],
                c["A"],
                c["B"],
                c["scales"],
                c["starts"],
                c["slots"],
                sizes=c["sizes"],
                active=active,
            )
        else:
            dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in c.items()}
            y = dev["y"].clone()
            h = sgmv.sgmv_shrink_triton(dev["x"], dev["A"], dev["starts"], dev["slots"])
            sgmv.sgmv_expand_triton(
                h, dev["B"], dev["scales"], dev["starts"], dev["slots"], y, sizes=c["sizes"], active=active
            )
        check_group(y, c, delta, torch.float32, active)
        assert torch.signbit(y[:, col : col + 16]).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GROUP_TRITON_CASES, ids=[f"case{c[0]}" for c in GROUP_TRITON_CASES])
def test_group_triton(case, dtype):
    """One shrink for the group's modules, one expand launch writing every active module's columns."""
    c = make_group_case(*case, dtype=dtype, device=DEVICE)
    h_want, delta = naive_group(c)
    group = dict(sizes=c["sizes"], active=c["active"])
    h = sgmv.sgmv_shrink_triton(c["x"], c["A"], c["starts"], c["slots"])
    torch.testing.assert_close(h.cpu().double(), h_want, atol=1e-5, rtol=1e-5)
    y = c["y"].clone()
    sgmv.sgmv_expand_triton(h, c["B"], c["scales"], c["starts"], c["slots"], y, **group)
    check_group(y, c, _group_expand_of(h, c), dtype, c["active"])

    # the slot cache's rank cut: stacks of 2R ranks (the upper half zero) read through views of the first R
    S, n, d_in = c["A"].shape[0], len(c["sizes"]), c["A"].shape[2]
    R = c["A"].shape[1] // n
    A2 = torch.zeros(S, 2 * R, n, d_in, dtype=dtype, device=DEVICE)
    A2[:, :R] = c["A"].view(S, R, n, d_in)
    B2 = torch.zeros(S, c["B"].shape[1], 2 * R, dtype=dtype, device=DEVICE)
    B2[:, :, :R] = c["B"]
    hint = max((c["starts"][1:] - c["starts"][:-1]).tolist())
    h = sgmv.sgmv_shrink_triton(
        c["x"], A2.flatten(1, 2)[:, : n * R], c["starts"], c["slots"], max_seg_len=hint
    )
    torch.testing.assert_close(h.cpu().double(), h_want, atol=1e-5, rtol=1e-5)
    y = c["y"].clone()
    sgmv.sgmv_expand_triton(
        h, B2[:, :, :R], c["scales"], c["starts"], c["slots"], y, **group, max_seg_len=hint
    )
    check_group(y, c, _group_expand_of(h, c), dtype, c["active"])
    assert delta.abs().sum() > 0

    # add_lora's GPU path shrinks into an uninitialized buffer: the expand never reads the rows the shrink
    # leaves (those without an adapter)
    h = torch.full_like(h, float("nan"))
    sgmv.sgmv_shrink_triton(c["x"], c["A"], c["starts"], c["slots"], out=h)
    y = c["y"].clone()
    sgmv.sgmv_expand_triton(h, c["B"], c["scales"], c["starts"], c["slots"], y, **group)
    check_group(y, c, delta, dtype, c["active"])
    y = c["y"].clone()
    sgmv.add_lora_triton(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], **group)
    check_group(y, c, delta, dtype, c["active"])


def test_group_shapes_are_checked():
    c = make_group_case(18, 6, 2, 16, (16, 8, 8), 4)
    with pytest.raises(ValueError, match="sizes"):
        sgmv.add_lora(c["y"], c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], sizes=(16, 8, 4))
    with pytest.raises(ValueError, match="active flags"):
        sgmv.add_lora(
            c["y"],
            c["x"],
            c["A"],
            c["B"],
            c["scales"],
            c["starts"],
            c["slots"],
            sizes=(16, 8, 8),
            active=(True,),
        )
