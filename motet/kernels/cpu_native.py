"""The native CPU kernels (motet/kernels/csrc/cpu_kernels.cpp): built on first use, called through ctypes.

The sources (motet/kernels/csrc: a header per kernel, and the forward with the C API in cpu_kernels.cpp) are
compiled with the system C++ compiler (`-O3 -fopenmp` and the flags of the instruction-set tier that runs here:
motet/kernels/cpu_isa.py, `isa()`) into a cache directory keyed by the source, the flags and the CPU's
features, so a build happens once per machine and tier (a few seconds). Torch is imported first, so the library's OpenMP calls land in the libgomp torch already
loaded: one thread pool for torch and these kernels. Where no compiler is found or the build fails, or
`MOTET_CPU_KERNELS=0`, `library()` is None and callers keep their torch path (the reference).

Besides single kernels (attention, SGMV, GEMM) the library runs a whole forward: a program of generic op records
(`Op`: a kind, buffers, a few ints, pointers and floats, read per kind as the source's table says) over named
fp32 buffers, which `ProgramWriter` writes and each layer fills with its own ops (`write_ops`:
motet/engine/worker/op_writer.py). A new kind of layer is a new op kind, never a new struct: `ABI_VERSION` moves
when the records or the step do.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from motet.kernels import cpu_isa
from motet.kernels.attention_args import AttentionOptions, KVCache, PagedContext
from motet.kernels.quant import BLOCK, QuantizedWeight

log = logging.getLogger("motet.kernels")

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"  # includes the other files in csrc/
# The version of the C API this module's structs and signatures speak: given to the source as a macro (its one
# written value), returned by the built library's motet_abi_version, and checked as the library loads.
ABI_VERSION = 11
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # and the tier's (cpu_isa.TIERS)
FLAGS.append(f"-DMOTET_ABI_VERSION={ABI_VERSION}")
PANEL = 16  # output columns per packed weight panel (NR in the source)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
QUANT_CODES = {
    "int8": 2,
    "int4": 3,
    "mxfp4": 4,
}  # quantized weights' codes (the source's WeightCode), by format
# Bytes of one packed block record (a panel's 16 columns x 32 inputs): fp16 scales (and mins; MXFP4: fp32
# scales), then the values.
QUANT_RECORD = {
    "int8": PANEL * 2 + BLOCK * PANEL,
    "int4": PANEL * 4 + BLOCK * PANEL // 2,
    "mxfp4": PANEL * 4 + BLOCK * PANEL // 2,
}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "motet_attention": [_i32, _i32, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i32, _ptr]
    + [_i32] * 4
    + [_f32, _i32, _f32, _ptr],  # scale, window, softcap, sinks
    "motet_sgmv": [_i32, _ptr, _i64, _ptr, _i64, _ptr, _i32, _i32]  # dtype, x, y, pool, group, layer
    + [_ptr, _ptr, _i32, _i32, _ptr, _i32],  # segments, n_in, sizes, n
    "motet_gemm": [_i32, _ptr, _i64, _i32, _i32, _ptr, _i32, _ptr, _ptr, _i64, _i32],
    "motet_experts": [_i32, _ptr, _i64, _ptr, _i32, _i32, _ptr, _i32, _ptr, _ptr, _i64],
    "motet_unpack_rows": [_i32, _ptr, _i32, _i32, _i32, _ptr],
}


LORA_GROUPS = (
    8  # the pool's decoder groups (motet/lora/pool.py's DECODER_GROUPS): the ones the forward applies
)


class LoraPool(ctypes.Structure):
    """The adapters' pool (motet/kernels/sgmv.py's layout): its weights, descriptors and piece geometry."""

    _fields_ = [("data", _ptr), ("desc", _ptr), ("desc_ld", _i64), ("a_ld", _i32 * LORA_GROUPS),
                ("bt_ld", (_i32 * 3) * LORA_GROUPS)]  # fmt: skip

    @classmethod
    def of(cls, data: torch.Tensor, desc: torch.Tensor, a_ld: Sequence[int], bt_ld: Sequence[Sequence[int]]):
        """The pool's tensors and its groups' geometry (the decoder groups': the first LORA_GROUPS)."""
        assert data.is_contiguous() and desc.is_contiguous() and desc.dtype == torch.int64
        a_ld, bt_ld = list(a_ld)[:LORA_GROUPS], list(bt_ld)[:LORA_GROUPS]
        assert len(a_ld) == len(bt_ld) == LORA_GROUPS
        bt = ((_i32 * 3) * LORA_GROUPS)(*[(_i32 * 3)(*row, *[0] * (3 - len(row))) for row in bt_ld])
        return cls(data.data_ptr(), desc.data_ptr(), desc.stride(0), (_i32 * LORA_GROUPS)(*a_ld), bt)


# Sums a float buffer over the tensor-parallel ranks, in place: (pointer, count); the forward calls it on each
# block's output before adding it to the residual stream (the source's AllReduce).
ALL_REDUCE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)

# The forward's program (the source's Op and Program; field order matters): op records that Python writes once,
# each reading its fields as the source's table says (the layers write them: motet/engine/worker/op_writer.py).
OP_KINDS = (
    "rms_norm",
    "linear",
    "rotary_kv",
    "attention",
    "activation",
    "add_residual",
    "moe",
    "gated_add",
    "latent_attention",
)  # OpKind
ACTIVATIONS = (
    "silu",
    "gelu_tanh",
    "swiglu_limit",
    "gelu",
    "relu",
    "relu2",
)  # the source's Activation, by motet's names
KV_POOLS = ("global", "window")  # the source's KvPool: which slots and tables an op's KV lives at
OP_INTS, OP_PTRS, OP_FLOATS = 12, 5, 3


class Op(ctypes.Structure):
    _fields_ = [
        ("kind", _i32),
        ("layer", _i32),
        ("inp", _i32),
        ("out", _i32),
        ("i", _i32 * OP_INTS),
        ("p", _ptr * OP_PTRS),
        ("f", _f32 * OP_FLOATS),
    ]


class Program(ctypes.Structure):
    _fields_ = [(n, _i32) for n in ("dtype_w", "dtype_cache", "block_size", "num_ops", "num_buffers")] + [
        ("ops", ctypes.POINTER(Op)),
        ("widths", ctypes.POINTER(_i32)),
        ("all_reduce", ALL_REDUCE),
        ("scratch", _ptr),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i32),
        ("num_seqs", _i32),
        ("positions", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("table_stride", _i64),
        ("qsl", _ptr),
        ("seq_lens", _ptr),
        ("window_slots", _ptr),
        ("window_tables", _ptr),
        ("window_table_stride", _i64),
        ("num_segs", _i32),
        ("seg_starts", _ptr),
        ("seg_slots", _ptr),
        ("lora", ctypes.POINTER(LoraPool)),
        ("timings", ctypes.POINTER(ctypes.c_double)),
    ]


@dataclass(frozen=True)
class RouteOptions:
    """DeepSeek's routing of a sparse layer (motet/engine/worker/routing.py; the source's routing.h): sigmoid scores
    or the softmax, the choice limited to the `kept` best of `groups` groups, the correction bias (fp32 [E]'s
    address, or None), the weights times `scale`."""

    sigmoid: bool
    groups: int
    kept: int
    bias: int | None
    scale: float


class ProgramWriter:
    """Op records in the order the forward runs them, over named fp32 buffers [T, width] (buffer "x": the
    residual stream, the forward's argument; each other one as wide as the widest use an op makes of it). Each
    method writes one op, its arguments put where the source's table of op fields says; pointers are addresses
    of memory the caller keeps alive as long as the program."""

    def __init__(self, hidden: int):
        self.ops: list[Op] = []
        self.names = {"x": 0}
        self.widths = [hidden]

    def buffer(self, name: str, width: int = 0) -> int:
        """The buffer's id, its width raised to `width` columns."""
        if name not in self.names:
            self.names[name] = len(self.widths)
            self.widths.append(0)
        b = self.names[name]
        self.widths[b] = max(self.widths[b], width)
        return b

    def _op(self, kind: str, inp: int, out: int, ints=(), ptrs=(), floats=(), layer: int = -1) -> None:
        op = Op(OP_KINDS.index(kind), layer, inp, out)
        op.i[: len(ints)] = [int(v) for v in ints]
        op.p[: len(ptrs)] = [p or None for p in ptrs]
        op.f[: len(floats)] = [float(v) for v in floats]
        self.ops.append(op)

    def rms_norm(
        self,
        src: str,
        dst: str,
        weight: int,
        eps: float,
        n: int,
        groups: int = 1,
        src_col: int = 0,
        dst_col: int = 0,
        whole: int = 0,
    ) -> None:
        """`groups` runs of `n` columns from `src_col` normed (weight [n]) into `dst` from `dst_col` (in place
        where src is dst): one run spans a row's heads, or one run per head. `whole` > 0: the one run is this
        rank's part of a row `whole` wide (a norm across heads under tensor parallelism): its sum of squares is
        all-reduced over the ranks first."""
        span = n * groups
        self._op(
            "rms_norm",
            self.buffer(src, src_col + span),
            self.buffer(dst, dst_col + span),
            (src_col, dst_col, n, groups, whole),
            (weight,),
            (eps,),
        )

    def linear(
        self,
        src: str,
        dst: str,
        weight: int,
        code: int,
        k: int,
        n: int,
        bias: int | None = None,
        accumulate: bool = False,
        layer: int = -1,
        lora_group: int = -1,
        lora_sizes=(),
    ) -> None:
        """dst[:, :n] (=, or += with `accumulate`) src[:, :k] @ W^T (+ bias), W packed in format `code`; then the
        layer's LoRA deltas of `lora_group` (-1: none), its modules' outputs `lora_sizes` adjacent columns."""
        sizes = list(lora_sizes) + [0] * (3 - len(lora_sizes))
        self._op(
            "linear",
            self.buffer(src, k),
            self.buffer(dst, n),
            (k, n, code, accumulate, lora_group, len(lora_sizes), *sizes),
            (weight, bias),
            layer=layer,
        )

    def rotary_kv(
        self,
        qkv: str,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        cos: int,
        sin: int,
        k_cache: int,
        v_cache: int,
        pool: str,
    ) -> None:
        """q and k heads of `qkv` (q heads, then k, then v) rotated in place over their first `rotary_dim`
        values (tables [positions, rotary_dim / 2]), k and v written to the caches at the `pool`'s slots."""
        b = self.buffer(qkv, (heads + 2 * kv_heads) * head_dim)
        self._op(
            "rotary_kv",
            b,
            b,
            (heads, kv_heads, head_dim, rotary_dim, KV_POOLS.index(pool)),
            (cos, sin, k_cache, v_cache),
        )

    def attention(
        self,
        qkv: str,
        dst: str,
        heads: int,
        kv_heads: int,
        head_dim: int,
        k_cache: int,
        v_cache: int,
        pool: str,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: int | None = None,
    ) -> None:
        """Paged attention of the q heads at the start of `qkv`'s rows over the `pool`'s caches into `dst`."""
        self._op(
            "attention",
            self.buffer(qkv, heads * head_dim),
            self.buffer(dst, heads * head_dim),
            (heads, kv_heads, head_dim, KV_POOLS.index(pool), window or 0),
            (k_cache, v_cache, sinks),
            (scale, softcap or 0.0),
        )

    def activation(
        self,
        src: str,
        dst: str,
        n: int,
        act: str,
        alpha: float = 0.0,
        limit: float = 0.0,
    ) -> None:
        """dst[:, :n] = act(gate) * up of src's [gate n | up n] columns."""
        self._op(
            "activation",
            self.buffer(src, 2 * n),
            self.buffer(dst, n),
            (n, ACTIVATIONS.index(act)),
            (),
            (alpha, limit),
        )

    def gated_add(self, src: str, dst: str, n: int, gate: str) -> None:
        """dst[:, :n] += src[:, :n], each row times sigmoid(its `gate` buffer's first value)."""
        self._op("gated_add", self.buffer(src, n), self.buffer(dst, n), (n, self.buffer(gate, 1)), (), ())

    def add_residual(self, src: str, n: int, norm: int | None = None, eps: float = 0.0) -> None:
        """A block's output joins the stream "x": all-reduced over the ranks, normed where `norm`, added."""
        self._op("add_residual", self.buffer(src, n), 0, (n,), (norm,), (eps,))

    def moe(
        self,
        src: str,
        logits: str,
        dst: str,
        num_experts: int,
        top_k: int,
        inter: int,
        hidden: int,
        renormalize: bool,
        act: str,
        gate_up: int,
        down: int,
        gate_up_bias: int | None = None,
        down_bias: int | None = None,
        alpha: float = 0.0,
        limit: float = 0.0,
        code: int = 0,
        routing: RouteOptions | None = None,
    ) -> None:
        """dst = each token's top-k experts (by the router's `logits`: a softmax's top-k, or DeepSeek's `routing`)
        over its `src` row, weighted; the experts' weights in `code` (the model's dtype, or QUANT_CODES': every
        expert's pack_quantized one after another, biases fp32)."""
        r = routing
        self._op(
            "moe",
            self.buffer(src, hidden),
            self.buffer(dst, hidden),
            (
                self.buffer(logits, num_experts),
                num_experts,
                top_k,
                inter,
                renormalize,
                ACTIVATIONS.index(act),
                hidden,
                code,
                r is not None,
                r is not None and r.sigmoid,
                r.groups if r else 1,
                r.kept if r else 1,
            ),
            (gate_up, down, gate_up_bias, down_bias, r.bias if r else None),
            (alpha, limit, r.scale if r else 1.0),
        )

    def latent_attention(
        self,
        q: str,
        kv: str,
        dst: str,
        heads: int,
        nope: int,
        rope: int,
        rank: int,
        v_dim: int,
        cos: int,
        sin: int,
        cache: int,
        w_uk: int,
        w_uv: int,
        scale: float,
        interleaved: bool,
        layer: int = -1,
        lora_group: int = -1,
    ) -> None:
        """DeepSeek's latent attention (motet/kernels/csrc/latent.h): `q`'s heads [nope | rope] and `kv`'s rows
        [c_kv normed | k_pe] rotated in place, the rows [c_kv | k_pe] written to the latent cache at the step's
        slots, every head attending over the cached rows in the absorbed form (W_UK^T and W_UV, kv_b_proj's halves,
        packed a head after another) into `dst` [T, heads v_dim]; kv_b_proj's LoRA deltas of `lora_group` there."""
        self._op(
            "latent_attention",
            self.buffer(q, heads * (nope + rope)),
            self.buffer(dst, heads * v_dim),
            (heads, nope, rope, rank, v_dim, self.buffer(kv, rank + rope), interleaved, lora_group),
            (cos, sin, cache, w_uk, w_uv),
            (scale,),
            layer=layer,
        )

    def program(self, dtype_w: int, dtype_cache: int, block_size: int) -> Program:
        """The written ops as a program (checked: `check`); it holds its arrays."""
        ops = (Op * len(self.ops))(*self.ops)
        widths = (_i32 * len(self.widths))(*self.widths)
        program = Program(dtype_w, dtype_cache, block_size, len(self.ops), len(self.widths), ops, widths)
        program._arrays = (ops, widths)  # (the struct points at them)
        check(program)
        return program


PHASES = ("linear", "attention", "lora", "other")  # Step.timings' slots (the source's Phase)


_SIGNATURES["motet_kernels"] = []
_SIGNATURES["motet_check"] = [ctypes.POINTER(Program)]
_SIGNATURES["motet_forward"] = [ctypes.POINTER(Program), ctypes.POINTER(Step), _ptr]
_SIGNATURES["motet_release"] = [ctypes.POINTER(Program)]


def enabled() -> bool:
    return os.environ.get("MOTET_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def isa() -> str:
    """The name of the instruction-set tier whose kernels run here (cpu_isa.TIERS; read once)."""
    return cpu_isa.selected().name


# The bits of the built library's motet_kernels(): which kernels its tier's flags compiled in.
KERNEL_BITS = {"avx2": 1, "bf16_dot": 2, "vnni": 4}


def kernels() -> list[str]:
    """The kernels the running tier's library holds (KERNEL_BITS' names; none where no library loads)."""
    lib = library()
    bits = lib.motet_kernels() if lib is not None else 0
    return [name for name, bit in KERNEL_BITS.items() if bits & bit]


def bf16_activations() -> bool:
    """Whether the running tier rounds activations to bf16 to multiply them with bf16 weights (accumulating
    in fp32), where the others multiply them in fp32."""
    return cpu_isa.selected().bf16_activations


def _cache_dir() -> Path:
    root = os.environ.get("MOTET_CACHE_DIR") or Path.home() / ".cache" / "motet"
    return Path(root) / "kernels"


def _build(compiler: str, tier: cpu_isa.Isa) -> Path:
    sources = [f.read_bytes() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h")]
    flags = [*FLAGS, *tier.flags]
    features = " ".join(sorted(cpu_isa.cpu_flags())) or platform.processor()
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(flags).encode(), compiler.encode(), features.encode()])
    )
    target = _cache_dir() / f"motet_cpu_{platform.machine()}_{tier.name}_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (a server's tensor-parallel ranks, test workers, replicas starting together on a new
    # machine each compiled the same library: tens of seconds of a core each); the others wait for its build.
    with open(target.with_suffix(".lock"), "a") as lock:
        _lock_exclusive(lock)
        if target.exists():
            return target
        t0 = time.perf_counter()  # (tens of seconds on a busy CPU: said, not silent)
        log.info(
            "compiling the native CPU kernels for the %s tier (once on this machine, into %s) ...",
            tier.name,
            target.parent,
        )
        # Built beside the target and renamed into place: a loader never sees half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=300
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{proc.stderr[-2000:]}")
            os.replace(out, target)
        log.info("compiled the native CPU kernels in %.1f s", time.perf_counter() - t0)
    return target


def _lock_exclusive(file) -> None:
    """Holds an exclusive lock on `file` until it is closed (POSIX flock; where there is none, no lock: concurrent
    builders each build, and the last rename wins)."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def library() -> ctypes.CDLL | None:
    """The loaded kernels of the tier that runs (`isa()`), or None (not enabled, no compiler, or the build
    failed: logged once)."""
    return _load(isa()) if enabled() else None


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else the first of g++, c++, clang++ on the PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    compiler_path = compiler()
    if compiler_path is None:
        log.warning("no C++ compiler found: the CPU kernels fall back to their torch references")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler_path, cpu_isa.BY_NAME[name])))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        log.warning("the CPU kernels could not be built (%s): torch references serve instead", e)
        return None
    if lib.motet_abi_version() != ABI_VERSION:
        log.warning("stale CPU kernel library: torch references serve instead")
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.motet_release.restype = None
    return lib


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name}: unsupported arguments (status {status})")


def attention(
    q: torch.Tensor, kv_cache: KVCache, ctx: PagedContext, options: AttentionOptions
) -> torch.Tensor:
    """Paged causal attention (the layout of motet/kernels/paged_attention.py, the options of
    motet/kernels/attention_args.py), K/V read in the cache's dtype."""
    k_cache, v_cache = kv_cache
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    tables = ctx.block_tables.to(torch.int32).contiguous()
    qsl = ctx.query_start_loc.to(torch.int32).contiguous()
    lens = ctx.seq_lens.to(torch.int32).contiguous()
    out = torch.empty((T, H, D), dtype=q.dtype)
    sinks = options.sinks.float().contiguous() if options.sinks is not None else None
    status = library().motet_attention(
        DTYPE_CODES[q.dtype],
        DTYPE_CODES[k_cache.dtype],
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        qsl.data_ptr(),
        lens.data_ptr(),
        len(lens),
        out.data_ptr(),
        H,
        KVH,
        D,
        BS,
        options.scale,
        options.window or 0,
        options.softcap or 0.0,
        sinks.data_ptr() if sinks is not None else None,
    )
    _check(status, "attention")
    return out


def sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: LoraPool,
    dtype: torch.dtype,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    group: int,
    layer: int,
    sizes: Sequence[int],
) -> None:
    """``y += lora_delta(x)`` in place for one module group at one layer (motet/kernels/sgmv.py's meaning and
    layout), fp32 x and y (row-strided views allowed), the pool's weights in `dtype`."""
    assert x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1
    assert sum(sizes) == y.shape[1] and x.shape[0] == y.shape[0]
    starts = seg_starts.to(torch.int32).contiguous()
    slots = seg_slots.to(torch.int32).contiguous()
    status = library().motet_sgmv(
        DTYPE_CODES[dtype],
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        ctypes.byref(pool),
        group,
        layer,
        starts.data_ptr(),
        slots.data_ptr(),
        len(slots),
        x.shape[1],
        (ctypes.c_int * len(sizes))(*sizes),
        len(sizes),
    )
    _check(status, "sgmv")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight as the GEMM's panels: [ceil(N / 16), K, 16], zero rows past N (same dtype)."""
    N, K = weight.shape
    padded = torch.zeros((-(-N // PANEL) * PANEL, K), dtype=weight.dtype)
    padded[:N] = weight
    return padded.view(-1, PANEL, K).transpose(1, 2).contiguous()


def pack_quantized(weight: QuantizedWeight) -> torch.Tensor:
    """A quantized [N, K] weight as the quantized GEMM's panels (motet/kernels/csrc/qgemm.h): uint8
    [ceil(N / 16), K / 32, record], per panel and block the 16 columns' fp16 scales (MXFP4: fp32), (int4) fp16 mins, then
    the values by quads of 4 k, each column's 4 values adjacent: int8: a quad's columns 0-7, then 8-15
    (32 bytes each); int4, MXFP4: a quad's 32 bytes hold columns 0-7 in the low nibbles, 8-15 in the high ones.
    Rows past N are zero (scale and min 0: they compute 0)."""
    N, K = weight.shape
    P, nb = -(-N // PANEL), K // BLOCK

    def panels(t: torch.Tensor) -> torch.Tensor:  # [N, nb, ...] -> [P, nb, 16, ...] with zero rows past N
        padded = torch.zeros((P * PANEL, *t.shape[1:]), dtype=t.dtype)
        padded[:N] = t.cpu()
        return padded.view(P, PANEL, *t.shape[1:]).transpose(1, 2)

    scales = weight.scales
    if (
        weight.format.codebook is not None
    ):  # MXFP4: 2^(e - 128) in fp32 (each code stands for twice its value)
        scales = torch.ldexp(torch.ones(scales.shape), scales.int() - 128)
    header = [panels(scales).contiguous().view(torch.uint8).view(P, nb, -1)]
    if weight.mins is not None:
        header.append(panels(weight.mins).contiguous().view(torch.uint8).view(P, nb, -1))
    # [P, nb, 16 columns, 32 k] -> [P, nb, 8 quads, 2 halves of 8 columns, 8 columns, 4 k]
    values = panels(weight.values()).reshape(P, nb, 2, 8, BLOCK // 4, 4).permute(0, 1, 4, 2, 3, 5)
    if weight.format.bits == 4:
        values = values[:, :, :, 0] | (values[:, :, :, 1] << 4)
    values = values.contiguous().view(torch.uint8).reshape(P, nb, -1)
    out = torch.cat([*header, values], dim=-1)
    assert out.shape[-1] == QUANT_RECORD[weight.format.name]
    return out


def packed_rows(
    packed: torch.Tensor, rows: torch.Tensor, k: int, quantized: str | None = None
) -> torch.Tensor:
    """Rows `rows` (int64 [T]) of the [N, K] weight that `pack` (or `pack_quantized` in the int8 / int4 format
    `quantized`) packed, as fp32 [T, K]: a tied embedding table looked up in its lm_head's panels (a row is a
    panel's column: its values strided in the panel, a quantized one's per-block scales and mins beside them),
    so the table needs no copy of its own. Exactly the packed values (the format's `dequantize`)."""
    panel, col = rows // PANEL, rows % PANEL
    if quantized is None:  # [P, K, 16]: row r is column r % 16 of panel r // 16
        return packed[panel, :, col].float()
    nb = k // BLOCK
    rec = packed[panel]  # [T, nb, record]: each token's panel, every block
    T = rec.shape[0]
    pick = col.view(T, 1, 1).expand(T, nb, 1)
    scales = rec[..., : 2 * PANEL].contiguous().view(torch.float16).gather(2, pick).float()  # [T, nb, 1]
    if quantized == "int8":  # values [quad, half of 8 columns, 8 columns, 4 k]
        values = rec[..., 2 * PANEL :].reshape(T, nb, BLOCK // 4, 2, 8, 4)
        half = (col // 8).view(T, 1, 1, 1, 1, 1).expand(T, nb, BLOCK // 4, 1, 8, 4)
        values = values.gather(3, half)[:, :, :, 0]  # [T, nb, quad, 8 columns, 4 k]
        at = (col % 8).view(T, 1, 1, 1, 1).expand(T, nb, BLOCK // 4, 1, 4)
        q = values.gather(3, at)[:, :, :, 0].reshape(T, nb, BLOCK).view(torch.int8).float()
        return (q * scales).reshape(T, k)
    assert quantized == "int4", quantized  # (MXFP4: experts only, never a table)
    mins = rec[..., 2 * PANEL : 4 * PANEL].contiguous().view(torch.float16).gather(2, pick).float()
    values = rec[..., 4 * PANEL :].reshape(T, nb, BLOCK // 4, 8, 4)  # [quad, 8 columns, 4 k]: two nibbles
    at = (col % 8).view(T, 1, 1, 1, 1).expand(T, nb, BLOCK // 4, 1, 4)
    byte = values.gather(3, at)[:, :, :, 0].reshape(T, nb, BLOCK)
    q = (byte >> (4 * (col // 8)).view(T, 1, 1).to(torch.uint8)) & 0xF  # columns 8-15: the high nibbles
    return (q.float() * scales + mins).reshape(T, k)


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    quantized: str | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for fp32 x [M, K] and W packed by `pack` (n: W's rows), or by `pack_quantized` in
    the format named by `quantized`, into fp32 `out` (made if None; with `accumulate`, added to it).
    Accumulates in fp32; bf16 weights are converted on load; with quantized weights x is quantized to int8
    blocks first and each block's product is an integer one (quant.quantize_activations)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and packed.is_contiguous()
    M, K = x.shape
    code, bias_dtype = _weight_format(packed.shape, packed.dtype, K, n, quantized)
    if out is None:
        out = torch.empty((M, n), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.stride(1) == 1 and out.shape == (M, n)
    if bias is not None:
        bias = bias.to(bias_dtype).contiguous()
    status = library().motet_gemm(
        code,
        x.data_ptr(),
        x.stride(0),
        M,
        K,
        packed.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
        int(accumulate),
    )
    _check(status, "gemm")
    return out


def unpack_rows(packed: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, stop) of the weight W [n, K] that `packed` holds (fp32 or bf16 panels of `pack`; start a
    multiple of PANEL), dense fp32 [stop - start, K] (into `out` if given): an operand of g @ W."""
    assert packed.is_contiguous() and packed.dtype in DTYPE_CODES and start % PANEL == 0
    assert 0 <= start <= stop <= packed.shape[0] * PANEL
    K = packed.shape[1]
    if out is None:
        out = torch.empty((stop - start, K), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (stop - start, K)
    status = library().motet_unpack_rows(
        DTYPE_CODES[packed.dtype], packed.data_ptr(), K, start, stop, out.data_ptr()
    )
    _check(status, "unpack_rows")
    return out


def _weight_format(
    shape, dtype: torch.dtype, K: int, n: int, quantized: str | None
) -> tuple[int, torch.dtype]:
    """The kernels' code of one packed weight of `shape` (panels of `pack`, or of `pack_quantized` in the format
    `quantized`) for inputs of width K and n outputs, checked; and the dtype its bias goes in."""
    if quantized is None:
        assert shape[1] == K and shape[0] * PANEL >= n
        return DTYPE_CODES[dtype], dtype
    assert tuple(shape[1:]) == (K // BLOCK, QUANT_RECORD[quantized]) and K % BLOCK == 0
    assert shape[0] * PANEL >= n
    return QUANT_CODES[quantized], torch.float32


def experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    quantized: str | None = None,
) -> torch.Tensor:
    """The grouped expert GEMM (the MoE op's, motet/kernels/csrc/moe.h): rows of fp32 x [M, K] sorted by expert,
    expert e's rows [offsets[e], offsets[e + 1]) times its weight [n, K]^T (+ bias[e]); `packed`: every expert's
    weight packed by `pack` (or by `pack_quantized` in the format `quantized`) stacked [E, ...]; bias [E, n]."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and packed.is_contiguous()
    M, K = x.shape
    E = packed.shape[0]
    offsets = offsets.to(torch.int32).contiguous()
    assert offsets.shape == (E + 1,) and int(offsets[0]) == 0 and int(offsets[-1]) == M
    code, bias_dtype = _weight_format(packed.shape[1:], packed.dtype, K, n, quantized)
    out = torch.empty((M, n), dtype=torch.float32)
    if bias is not None:
        bias = bias.to(bias_dtype).contiguous()
        assert bias.shape == (E, n)
    status = library().motet_experts(
        code,
        x.data_ptr(),
        x.stride(0),
        offsets.data_ptr(),
        E,
        K,
        packed.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out.stride(0),
    )
    _check(status, "experts")
    return out


def check(program: Program) -> None:
    """Raise where the program's ops do not fit its buffers or the kernels (made once, before any step)."""
    _check(library().motet_check(ctypes.byref(program)), "program")


def forward(program: Program, step: Step, x: torch.Tensor) -> None:
    """The program over `x` [T, hidden] fp32 (the embeddings in, the final normed hidden out)."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    _check(library().motet_forward(ctypes.byref(program), ctypes.byref(step), x.data_ptr()), "forward")


def release(program: Program) -> None:
    """Free the scratch buffers the program's steps keep."""
    library().motet_release(ctypes.byref(program))
