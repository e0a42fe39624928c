"""The native CPU kernels (motet/kernels/csrc/cpu_kernels.cpp): built on first use, called through ctypes.

The sources (motet/kernels/csrc: a header per kernel, and the forward with the C API in cpu_kernels.cpp) are
compiled with the system C++ compiler for this CPU (`-O3 -march=native -fopenmp`) into a
cache directory keyed by the source, the flags and the CPU's features, so a build happens once per machine
(a few seconds). Torch is imported first, so the library's OpenMP calls land in the libgomp torch already
loaded: one thread pool for torch and these kernels. Where no compiler is found or the build fails, or
`MOTET_CPU_KERNELS=0`, `library()` is None and callers keep their torch path (the reference).
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
from collections.abc import Sequence
from pathlib import Path

import torch

from motet.kernels.quant import BLOCK, QuantizedWeight

log = logging.getLogger("motet.kernels")

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"  # includes the other files in csrc/
# The version of the C API this module's structs and signatures speak: given to the source as a macro (its one
# written value), returned by the built library's motet_abi_version, and checked as the library loads.
ABI_VERSION = 9
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
FLAGS.append(f"-DMOTET_ABI_VERSION={ABI_VERSION}")
PANEL = 16  # output columns per packed weight panel (NR in the source)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
QUANT_CODES = {"int8": 2, "int4": 3}  # quantized weights' codes (the source's WeightCode), by format name
# Bytes of one packed block record (a panel's 16 columns x 32 inputs): fp16 scales (and mins), then the values.
QUANT_RECORD = {"int8": PANEL * 2 + BLOCK * PANEL, "int4": PANEL * 4 + BLOCK * PANEL // 2}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "motet_attention": [_i32, _i32, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i32, _ptr]
    + [_i32] * 4
    + [_f32],
    "motet_sgmv": [_i32, _ptr, _i64, _ptr, _i64, _ptr, _i32, _i32]  # dtype, x, y, pool, group, layer
    + [_ptr, _ptr, _i32, _i32, _ptr, _i32],  # segments, n_in, sizes, n
    "motet_gemm": [_i32, _ptr, _i64, _i32, _i32, _ptr, _i32, _ptr, _ptr, _i64, _i32],
}


# The forward's descriptors (the structs of the same names in the source; field order matters).
class Linear(ctypes.Structure):
    """A packed weight and its code (DTYPE_CODES for the model's dtype, or QUANT_CODES)."""

    _fields_ = [("w", _ptr), ("code", _i32)]


class AttentionWeights(ctypes.Structure):
    """The attention op's weights; q_norm and k_norm (Qwen3's per-head RMSNorm weights) null where none."""

    _fields_ = [("norm", _ptr), ("qkv", Linear), ("qkv_bias", _ptr), ("o", Linear), ("q_norm", _ptr),
                ("k_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr)]  # fmt: skip


class MlpWeights(ctypes.Structure):
    """A SwiGLU MLP (a dense layer's, or a sparse layer's shared expert: inter 0 where it has none)."""

    _fields_ = [("gate_up", Linear), ("down", Linear), ("inter", _i32)]


class MoeWeights(ctypes.Structure):
    """A sparse layer's experts: the router, every expert's packed gate_up then every expert's packed down
    (one after another, in the model's dtype), and the shared expert with its gate."""

    _fields_ = [("router", Linear), ("experts_gate_up", _ptr), ("experts_down", _ptr), ("num_experts", _i32),
                ("top_k", _i32), ("inter", _i32), ("renormalize", _i32), ("shared", MlpWeights),
                ("shared_gate", Linear)]  # fmt: skip


MLP_DENSE, MLP_SPARSE = 0, 1  # Layer.mlp_kind (the source's MlpKind)


class Layer(ctypes.Structure):
    _fields_ = [("attn", AttentionWeights), ("post_norm", _ptr), ("mlp_kind", _i32), ("mlp", MlpWeights),
                ("moe", MoeWeights)]  # fmt: skip


LORA_GROUPS = (
    4  # the pool's decoder groups (motet/lora/pool.py's DECODER_GROUPS): the ones the forward applies
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
# op's output before adding it to the residual stream (the source's AllReduce).
ALL_REDUCE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


class Model(ctypes.Structure):
    _fields_ = [(n, _i32) for n in ("dtype_w", "dtype_cache", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "num_layers", "block_size")] + [
        ("eps", _f32), ("scale", _f32), ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr),
        ("layers", ctypes.POINTER(Layer)), ("all_reduce", ALL_REDUCE),
    ]  # fmt: skip


class Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i32), ("num_seqs", _i32), ("positions", _ptr), ("slots", _ptr), ("tables", _ptr),
                ("table_stride", _i64), ("qsl", _ptr), ("seq_lens", _ptr), ("num_segs", _i32),
                ("seg_starts", _ptr), ("seg_slots", _ptr), ("lora", ctypes.POINTER(LoraPool)),
                ("timings", ctypes.POINTER(ctypes.c_double))]  # fmt: skip


PHASES = ("linear", "attention", "lora", "other")  # Step.timings' slots (the source's Phase)


_SIGNATURES["motet_forward"] = [ctypes.POINTER(Model), ctypes.POINTER(Step), _ptr]


def enabled() -> bool:
    return os.environ.get("MOTET_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("MOTET_CACHE_DIR") or Path.home() / ".cache" / "motet"
    return Path(root) / "kernels"


def _build(compiler: str) -> Path:
    sources = [f.read_bytes() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h")]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(FLAGS).encode(), compiler.encode(), _cpu_features().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"motet_cpu_{platform.machine()}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builders (test workers) never see half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (not enabled, no compiler, or the build failed: logged once)."""
    if not enabled():
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler found: the CPU kernels fall back to their torch references")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        log.warning("the CPU kernels could not be built (%s): torch references serve instead", e)
        return None
    if lib.motet_abi_version() != ABI_VERSION:
        log.warning("stale CPU kernel library: torch references serve instead")
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name}: unsupported arguments (status {status})")


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Paged causal attention (the layout of motet/kernels/paged_attention.py), K/V read in the cache's dtype."""
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    tables = block_tables.to(torch.int32).contiguous()
    qsl = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((T, H, D), dtype=q.dtype)
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
        scale,
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
    [ceil(N / 16), K / 32, record], per panel and block the 16 columns' fp16 scales, (int4) fp16 mins, then
    the values by quads of 4 k, each column's 4 values adjacent: int8: a quad's columns 0-7, then 8-15
    (32 bytes each); int4: a quad's 32 bytes hold columns 0-7 in the low nibbles, 8-15 in the high ones.
    Rows past N are zero (scale and min 0: they compute 0)."""
    N, K = weight.shape
    P, nb = -(-N // PANEL), K // BLOCK

    def panels(t: torch.Tensor) -> torch.Tensor:  # [N, nb, ...] -> [P, nb, 16, ...] with zero rows past N
        padded = torch.zeros((P * PANEL, *t.shape[1:]), dtype=t.dtype)
        padded[:N] = t.cpu()
        return padded.view(P, PANEL, *t.shape[1:]).transpose(1, 2)

    header = [panels(weight.scales).contiguous().view(torch.uint8).view(P, nb, -1)]
    if weight.mins is not None:
        header.append(panels(weight.mins).contiguous().view(torch.uint8).view(P, nb, -1))
    # [P, nb, 16 columns, 32 k] -> [P, nb, 8 quads, 2 halves of 8 columns, 8 columns, 4 k]
    values = panels(weight.values()).reshape(P, nb, 2, 8, BLOCK // 4, 4).permute(0, 1, 4, 2, 3, 5)
    if weight.format.has_min:
        values = values[:, :, :, 0] | (values[:, :, :, 1] << 4)
    values = values.contiguous().view(torch.uint8).reshape(P, nb, -1)
    out = torch.cat([*header, values], dim=-1)
    assert out.shape[-1] == QUANT_RECORD[weight.format.name]
    return out


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
    if quantized is None:
        assert packed.shape[1] == K and packed.shape[0] * PANEL >= n
        code, bias_dtype = DTYPE_CODES[packed.dtype], packed.dtype
    else:
        assert packed.shape[1:] == (K // BLOCK, QUANT_RECORD[quantized]) and K % BLOCK == 0
        assert packed.shape[0] * PANEL >= n
        code, bias_dtype = QUANT_CODES[quantized], torch.float32
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


def forward(model: Model, step: Step, x: torch.Tensor) -> None:
    """The decoder stack over `x` [T, hidden] fp32 (the embeddings in, the final normed hidden out)."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    _check(library().motet_forward(ctypes.byref(model), ctypes.byref(step), x.data_ptr()), "forward")
