"""SGMV over the adapter pool: the torch reference (the CPU path) and the Triton kernels against a naive
float64 per-token loop over the LoRAAdapters' own factors. Without CUDA the kernels run under
TRITON_INTERPRET=1 (slow: shapes stay small).

Every case packs random adapters (mixed ranks, targets, layers and scales) into an AdapterPool with
motet/lora/pool.py's `pack`. Their factors are bf16-representable and their scales powers of two, so a bf16
pool holds them exactly and one tolerance serves every pool dtype (the error left is the fp32 sums' and the
one rounding into y's dtype)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from motet.kernels import sgmv, triton_support
from motet.lora.adapter import LoRAAdapter, module_shape
from motet.lora.pool import MODULE_GROUPS, AdapterPool, LoRABatch, PoolLayout, pack

# tests/conftest.py turns TRITON_INTERPRET on (no CUDA) before anything imports triton.
HAS_TRITON = triton_support.AVAILABLE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

F32, BF16 = torch.float32, torch.bfloat16
GROUPS = MODULE_GROUPS[:4]  # the decoder layers' groups: q/k/v, o, gate/up, down
ALL_MODULES = tuple(m for modules in GROUPS for m in modules)
SCALES = (0.5, 2.0, 0.25, 4.0)  # != 1, and B * scale stays exact in bf16


def base_shape(hidden=32, inter=48, heads=4, kv=2, head_dim=8, layers=2):
    return SimpleNamespace(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        is_moe=False,
    )


SMALL = base_shape()
BIG = base_shape(hidden=80, inter=96, heads=4, kv=2, head_dim=16)  # K > 64: two K tiles; q of 64 columns
# a tensor-parallel rank's part: the pool's geometry is the widest part's, x and y this narrower one's
WIDE, NARROW = base_shape(hidden=40, inter=56, heads=6, kv=3), base_shape(hidden=32, inter=40, heads=4, kv=2)


def _exact(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def _adapter(g, base, name, rank, modules, layers, low_rank=()) -> LoRAAdapter:
    """Random factors of `rank` (half of it for the modules in `low_rank`, as a PEFT rank_pattern)."""
    weights = {}
    for layer in layers:
        for m in modules:
            r = max(1, rank // 2) if m in low_rank else rank
            d_in, d_out = module_shape(base, m)
            A = _exact(torch.randn(r, d_in, generator=g) / d_in**0.5)
            B = _exact(torch.randn(d_out, r, generator=g) / r**0.5)
            weights[(layer, m)] = (A, B, SCALES[int(torch.randint(len(SCALES), (1,), generator=g))])
    return LoRAAdapter(name, rank, weights)


def make_adapters(g, base, max_rank) -> list[LoRAAdapter]:
    layers = range(base.num_hidden_layers)
    rank = lambda: int(torch.randint(1, max_rank + 1, (1,), generator=g))
    subset = [m for m in ALL_MODULES if torch.rand(1, generator=g).item() < 0.5] or ["k_proj"]
    return [
        _adapter(g, base, "all", max_rank, ALL_MODULES, layers),
        # q and v but not k, up but not gate; v at a lower rank than the adapter's
        _adapter(g, base, "qv", rank(), ("q_proj", "v_proj", "up_proj", "down_proj"), layers, ("v_proj",)),
        _adapter(g, base, "last-layer", rank(), ("k_proj", "o_proj", "gate_proj"), layers[-1:]),
        _adapter(g, base, "rank1", 1, ("o_proj", "down_proj"), layers),  # no q/k/v, no gate/up
        _adapter(g, base, "random", rank(), subset, layers),
    ]


@dataclass
class Case:
    base: SimpleNamespace  # x's and y's shapes
    adapters: list[LoRAAdapter]
    pool: AdapterPool
    lens: list[int]
    uses: list[int | None]  # each segment's adapter
    starts: torch.Tensor
    slots: torch.Tensor
    max_rank: int  # the step's (the kernels' rank tiles)
    device: str

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    @property
    def token_adapters(self) -> list[int | None]:
        return [u for n, u in zip(self.lens, self.uses, strict=True) for _ in range(n)]

    @property
    def hint(self) -> int:
        return max(self.lens, default=0)

    def batch(self) -> LoRABatch:
        view = self.pool.view_slots([s for s in self.slots.tolist() if s >= 0])
        return LoRABatch(self.starts, self.slots, self.hint, view)


def make_case(
    seed, tokens, segs=None, *, max_rank, lens=None, uses=None, base=SMALL, pool_base=None, pad=0,
    pool_dtype=F32, device="cpu",
) -> Case:  # fmt: skip
    """Random segments over the adapters (or the given `lens` and `uses`: each segment's adapter): some
    empty, one-token ones, some without adapter, the first and the last on the same slot. `pad`: the step's
    max_rank above its adapters' (a captured graph's)."""
    g = torch.Generator().manual_seed(seed)
    adapters = make_adapters(g, base, max_rank)
    layout = PoolLayout(pool_base or base)
    pool = AdapterPool(layout, 1 << 22, device, pool_dtype, max_slots=16)
    slot_of = {}
    for i in torch.randperm(len(adapters), generator=g).tolist():  # slots and regions in a random order
        slot_of[i] = pool.place(i, pack(adapters[i], layout, pool_dtype), lambda u: False)
    if lens is None:
        cuts = torch.randint(0, tokens + 1, (segs - 1,), generator=g).sort().values.tolist()
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
        if segs >= 4:  # an empty segment
            lens[0], lens[1] = lens[0] + lens[1], 0
    assert sum(lens) == tokens
    if uses is None:
        uses = [
            None if u < 0 else u for u in torch.randint(-1, len(adapters), (len(lens),), generator=g).tolist()
        ]
        if len(lens) >= 3:
            uses[0] = uses[0] if uses[0] is not None else 0
            uses[-1], uses[len(lens) // 2] = uses[0], None  # the same slot twice; one without adapter
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([-1 if u is None else slot_of[u] for u in uses], dtype=torch.int32)
    step_rank = max((adapters[u].rank for u in uses if u is not None), default=0) + pad
    return Case(
        base, adapters, pool, list(lens), uses, starts.to(device), slots.to(device), step_rank, device
    )


def group_io(c: Case, group: int, layer: int, dtype, seed=0):
    """x, y and add_lora's keyword arguments of a module group at a layer (y has some -0.0: untouched
    elements must keep their bits)."""
    g = torch.Generator().manual_seed(1000 + seed + 10 * group + layer)
    modules = MODULE_GROUPS[group]
    sizes = tuple(module_shape(c.base, m)[1] for m in modules)
    geo = c.pool.layout.groups[group]
    x = _exact(torch.randn(c.num_tokens, module_shape(c.base, modules[0])[0], generator=g))
    y = torch.randn(c.num_tokens, sum(sizes), generator=g)
    y[::2, ::3] = -0.0
    kw = dict(group=group, layer=layer, a_ld=geo.a_ld, bt_ld=geo.bt_ld, sizes=sizes, max_rank=c.max_rank)
    return x.to(c.device, dtype), y.to(c.device, dtype), kw


def naive(c: Case, x: torch.Tensor, group: int, layer: int, sizes):
    """Per token, in float64, from the adapters' factors: (h [T, n * max_rank], delta [T, sum(sizes)],
    touched: the elements of y of the modules each token's adapter targets in some layer)."""
    modules = MODULE_GROUPS[group]
    cols = [sum(sizes[:i]) for i in range(len(sizes))]
    T, xd = x.shape[0], x.cpu().double()
    h = torch.zeros(T, len(modules) * c.max_rank, dtype=torch.float64)
    delta = torch.zeros(T, sum(sizes), dtype=torch.float64)
    touched = torch.zeros(T, sum(sizes), dtype=torch.bool)
    for t, u in enumerate(c.token_adapters):
        if u is None:
            continue
        ad = c.adapters[u]
        present = [i for i, m in enumerate(modules) if m in ad.target_modules]
        for pos, i in enumerate(present):
            touched[t, cols[i] : cols[i] + sizes[i]] = True
            if (layer, modules[i]) not in ad.weights:  # targeted in other layers: zero here
                continue
            A, B, scale = ad.weights[(layer, modules[i])]
            hm = A.double() @ xd[t]
            h[t, pos * ad.rank : pos * ad.rank + hm.shape[0]] = hm
            delta[t, cols[i] : cols[i] + sizes[i]] = B.double() @ hm * scale
    return h, delta, touched


def check(y_out, y_in, delta, touched):
    """y_out = y_in + delta (fp32: to fp32 sums' error; bf16: one rounding of the fp32 sum), and the elements
    not touched are bit-identical (-0.0 included)."""
    y_out, y_in = y_out.cpu(), y_in.cpu()
    tol = 1e-5 if y_in.dtype == F32 else 1e-2
    torch.testing.assert_close(y_out.double(), y_in.double() + delta, atol=tol, rtol=tol)
    bits = torch.int32 if y_in.dtype == F32 else torch.int16
    assert torch.equal(y_out.view(bits)[~touched], y_in.view(bits)[~touched])


def check_h(h, h_want):
    assert h.dtype == F32 and h.shape == h_want.shape
    torch.testing.assert_close(h.cpu().double(), h_want, atol=1e-5, rtol=1e-5)


def pool_args(c: Case):
    return c.pool.data, c.pool.desc, c.starts, c.slots


def no_sizes(kw):
    return {k: v for k, v in kw.items() if k not in ("sizes", "max_rank")}


# (x and y's dtype, the pool's)
DTYPES = [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)]
DTYPE_IDS = ["fp32", "bf16", "fp32-x-bf16-pool", "bf16-x-fp32-pool"]

REF_CASES = [
    dict(seed=0, tokens=1, segs=1, max_rank=1),
    dict(seed=1, tokens=17, segs=6, max_rank=8),
    dict(seed=2, tokens=48, segs=48, max_rank=16),  # decode-like: mostly one token per segment
    dict(seed=3, tokens=150, segs=5, max_rank=64, base=BIG),
    dict(seed=4, tokens=33, segs=12, max_rank=5, base=NARROW, pool_base=WIDE),  # K < a_ld, sizes < bt_ld
    dict(seed=5, tokens=9, lens=[1] * 9, max_rank=4, pad=3),  # per-token segments
]


REF_PARAMS = [  # the mixed dtypes on two cases
    pytest.param(case, dtypes, id=f"case{case['seed']}-{name}")
    for case in REF_CASES
    for dtypes, name in zip(DTYPES, DTYPE_IDS, strict=True)
    if dtypes[0] == dtypes[1] or case["seed"] in (1, 4)
]


@pytest.mark.parametrize("case, dtypes", REF_PARAMS)
def test_reference_and_cpu_path(case, dtypes):
    dtype, pool_dtype = dtypes
    c = make_case(**case, pool_dtype=pool_dtype)
    batch = c.batch()
    for layer in range(c.base.num_hidden_layers):
        for group in range(len(GROUPS)):
            x, y, kw = group_io(c, group, layer, dtype)
            h_want, delta, touched = naive(c, x, group, layer, kw["sizes"])
            width = len(kw["bt_ld"]) * c.max_rank
            h = sgmv.sgmv_shrink_reference(x, *pool_args(c), width=width, **no_sizes(kw))
            check_h(h, h_want)
            out = y.clone()
            sgmv.sgmv_expand_reference(h, *pool_args(c), out, sizes=kw["sizes"], **no_sizes(kw))
            check(out, y, delta, touched)

            for rows in (None, batch.weights.rows):  # the descriptors read from the table, or the host's
                out = y.clone()
                sgmv.add_lora(out, x, *pool_args(c), **kw, rows=rows)
                check(out, y, delta, touched)
            d = sgmv.lora_delta_reference(x, *pool_args(c), **no_sizes(kw), sizes=kw["sizes"])
            assert d.dtype == F32
            torch.testing.assert_close(d.double(), delta, atol=1e-5, rtol=1e-5)
            assert not d[~touched].any()

            out = y.clone()
            batch.add(out, x, layer, MODULE_GROUPS[group], kw["sizes"])  # the model's entry point
            check(out, y, delta, touched)


def test_reference_strided_output():
    """y may be a column slice of a wider buffer: the rest is untouched."""
    c = make_case(6, 21, 5, max_rank=8)
    x, y, kw = group_io(c, 0, 1, F32)
    wide = torch.randn(21, y.shape[1] + 16)
    before = wide.clone()
    sgmv.add_lora(wide[:, 8:-8], x, *pool_args(c), **kw)
    _, delta, touched = naive(c, x, 0, 1, kw["sizes"])
    check(wide[:, 8:-8], before[:, 8:-8], delta, touched)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, -8:], before[:, -8:])


def test_sizes_are_checked():
    c = make_case(7, 6, 2, max_rank=4)
    x, y, kw = group_io(c, 0, 0, F32)
    with pytest.raises(ValueError, match="sizes"):
        sgmv.add_lora(y, x, *pool_args(c), **{**kw, "sizes": (32, 16, 12)})
    with pytest.raises(ValueError, match="do not fit"):  # a module wider than the pool's rows
        sgmv.add_lora(torch.zeros(6, 66), x, *pool_args(c), **{**kw, "sizes": (34, 16, 16)})
    with pytest.raises(ValueError, match="group of 1 modules"):
        sgmv.add_lora(y, x, *pool_args(c), **{**kw, "sizes": (64,)})


# -- Triton ----------------------------------------------------------------------------------------------

TRITON_CASES = [
    dict(seed=10, tokens=1, segs=1, max_rank=1),
    dict(seed=11, tokens=13, segs=5, max_rank=8, pad=3),  # the step's max_rank above its adapters'
    dict(seed=12, tokens=16, segs=16, max_rank=16),  # T <= S: 16-row tiles; q and k in one column tile
    # long segments: 64-row tiles (two in one), two K tiles, several column tiles
    dict(seed=13, tokens=90, lens=[66, 0, 20, 4], uses=[0, 2, 1, None], max_rank=8, base=BIG),
    dict(seed=14, tokens=20, segs=6, max_rank=5, base=NARROW, pool_base=WIDE),  # K < a_ld, sizes < bt_ld
    dict(seed=15, tokens=12, lens=[1] * 12, max_rank=4),  # per-token segments, hint 1 (CUDA graphs' decode)
    dict(seed=16, tokens=6, segs=2, max_rank=48),  # q/k/v: 144 ranks, two rank tiles of the shrink
    dict(seed=17, tokens=17, lens=[0] * 16 + [17], max_rank=4),  # T <= S: 16-row tiles, yet 2 in a segment
]


def run_triton(c: Case, group: int, layer: int, dtype):
    """Shrink then expand (without and with the hint; into an h of NaN, which the expand must not read), and
    add_lora_triton, against the naive loop."""
    x, y, kw = group_io(c, group, layer, dtype)
    h_want, delta, touched = naive(c, x, group, layer, kw["sizes"])
    sizes = kw["sizes"]
    shrink_kw = {**no_sizes(kw), "max_rank": c.max_rank}
    h = sgmv.sgmv_shrink_triton(x, *pool_args(c), **shrink_kw)
    check_h(h, h_want)
    out = y.clone()
    sgmv.sgmv_expand_triton(h, *pool_args(c), out, sizes=sizes, **shrink_kw)
    check(out, y, delta, touched)

    hinted = {**shrink_kw, "max_seg_len": c.hint}  # the exact hint resizes the grid (maybe the row tile)
    h = torch.full_like(h, float("nan"))
    sgmv.sgmv_shrink_triton(x, *pool_args(c), out=h, **hinted)
    out = y.clone()
    sgmv.sgmv_expand_triton(h, *pool_args(c), out, sizes=sizes, **hinted)
    check(out, y, delta, touched)

    out = y.clone()
    sgmv.add_lora_triton(out, x, *pool_args(c), **kw, max_seg_len=c.hint)
    check(out, y, delta, touched)
    if DEVICE == "cuda":
        out = y.clone()
        sgmv.add_lora(out, x, *pool_args(c), **kw, max_seg_len=c.hint)
        check(out, y, delta, touched)
    return delta


# Under the interpreter (no GPU) each kernel program costs milliseconds, and bf16's cases differ from fp32's only in
# the loads' and dots' dtype: bf16 runs on the two cases with the most tile paths (long segments in 64-row tiles over
# two K tiles and several column tiles; the shrink's two rank tiles), fp32 on every case; on a GPU both on every case.
BF16_INTERPRETED = (13, 16)
TRITON_PARAMS = [
    pytest.param(case, dtypes, id=f"case{case['seed']}-{name}")
    for case in TRITON_CASES
    for dtypes, name in zip(DTYPES[:2], DTYPE_IDS[:2], strict=True)
    if DEVICE == "cuda" or name == "fp32" or case["seed"] in BF16_INTERPRETED
]


@needs_triton
@pytest.mark.parametrize("case, dtypes", TRITON_PARAMS)
def test_triton(case, dtypes):
    """Every group at the last layer (where the last-layer adapter has weights), and at layer 0 for one case
    (that adapter's modules there: targeted, zero)."""
    dtype, pool_dtype = dtypes
    c = make_case(**case, pool_dtype=pool_dtype, device=DEVICE)
    layers = (0, 1) if case["seed"] == 11 else (1,)
    deltas = [run_triton(c, g, layer, dtype) for layer in layers for g in range(len(GROUPS))]
    assert any(d.abs().sum() > 0 for d in deltas)


@needs_triton
@pytest.mark.parametrize("dtypes", DTYPES[2:], ids=DTYPE_IDS[2:])
def test_triton_mixed_dtypes(dtypes):
    dtype, pool_dtype = dtypes
    c = make_case(20, 18, 6, max_rank=8, pool_dtype=pool_dtype, device=DEVICE)
    for group in range(len(GROUPS)):
        run_triton(c, group, 1, dtype)


@needs_triton
def test_triton_strided_output():
    """y may be a column slice of a wider buffer (e.g. q/k/v of a fused output with more): the rest is
    untouched."""
    c = make_case(21, 21, 5, max_rank=8, device=DEVICE)
    x, y, kw = group_io(c, 2, 1, F32)
    wide = torch.randn(21, y.shape[1] + 16, device=DEVICE)
    before = wide.clone()
    add = sgmv.add_lora if DEVICE == "cuda" else sgmv.add_lora_triton
    add(wide[:, 8:-8], x, *pool_args(c), **kw)
    _, delta, touched = naive(c, x, 2, 1, kw["sizes"])
    check(wide[:, 8:-8], before[:, 8:-8], delta, touched)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, -8:], before[:, -8:])


@needs_triton
def test_triton_nothing_to_do():
    """All slots -1, zero segments, zero tokens: h stays zero (or as it was), y bit-identical."""
    c = make_case(22, 9, 3, max_rank=4, device=DEVICE)
    x, y, kw = group_io(c, 0, 0, F32)
    kw["max_rank"] = 4
    shrink_kw = {**no_sizes(kw), "max_rank": 4}
    cases = [
        (c.starts, torch.full_like(c.slots, -1), x, y),  # no token has an adapter
        (c.starts[:1], c.slots[:0], x, y),  # zero segments
        (torch.zeros(2, dtype=torch.int32, device=DEVICE), c.slots[:1], x[:0], y[:0]),  # zero tokens
    ]
    for starts, slots, xs, ys in cases:
        h = sgmv.sgmv_shrink_triton(xs, c.pool.data, c.pool.desc, starts, slots, **shrink_kw)
        assert h.shape == (xs.shape[0], 12) and not h.any()
        out = ys.clone()
        sgmv.sgmv_expand_triton(
            h, c.pool.data, c.pool.desc, starts, slots, out, sizes=kw["sizes"], **shrink_kw
        )
        sgmv.add_lora_triton(out, xs, c.pool.data, c.pool.desc, starts, slots, **kw)
        assert torch.equal(out.view(torch.int32), ys.view(torch.int32))


@needs_triton
def test_triton_shapes_are_checked():
    c = make_case(23, 6, 2, max_rank=4, device=DEVICE)
    x, y, kw = group_io(c, 0, 0, F32)
    with pytest.raises(ValueError, match="does not fit"):  # x wider than the pool's A rows
        sgmv.sgmv_shrink_triton(torch.zeros(6, 33, device=DEVICE), *pool_args(c), **no_sizes(kw), max_rank=4)
    with pytest.raises(ValueError, match="fp32"):
        sgmv.sgmv_shrink_triton(
            x, *pool_args(c), out=torch.empty(6, 11, device=DEVICE), **no_sizes(kw), max_rank=4
        )
    with pytest.raises(ValueError, match="not \\[T"):
        sgmv.sgmv_expand_triton(torch.zeros(6, 8, device=DEVICE), *pool_args(c), y, **kw)
