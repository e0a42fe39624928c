"""GGML block types (a GGUF tensor's bytes) mapped onto motet's two block formats (motet/kernels/quant.py).

`from_ggml` turns a weight [N, K] stored in any GGML type that gguf-py (llama.cpp's Python package) can
dequantize into a QuantizedWeight; `native_format` says which format holds a type's values as they are:

- Q8_0 and Q4_1 are the int8 and int4 layouts byte for byte.
- Q4_0 (an fp16 scale d per 32 values, q in 0..15 meaning d * (q - 8)) is int4 with min = -8 * d: exact,
  since a power-of-two multiple of an fp16 stays an fp16 (and q * d - 8 * d = d * (q - 8) exactly in fp32).
- Q4_K (super-blocks of 256: fp16 d and dmin, 6-bit sc and m per 32-value sub-block, meaning d * sc * q -
  dmin * m) is int4 per sub-block with scale = d * sc and min = -dmin * m rounded to fp16 (their products
  need up to 17 bits of mantissa; fp16 keeps 11): each within 2^-11 of its value, so a weight moves by at
  most 3 * 2^-11 of its sub-block's largest |weight|. Against gguf-py's dequantization of Q4_K blocks of
  Gaussian weights: at most 1.4e-3 of the sub-block's largest |weight|, 6.4e-4 of the weights' rms (Q4_K's
  own rounding: 7.8%); tests/kernels/test_quant_formats.py holds it to the bound.
- Every other type (Q5_0/Q5_1, Q2_K/Q3_K/Q5_K/Q6_K, the IQ and TQ types, MXFP4, floats, ...) is dequantized by
  gguf-py and requantized into int8 (Q8_0's blocks): a second rounding of at most half an int8 step, 1/254
  of a block's largest |weight|. (So is a native type where the reader needs int8: a fused layer's parts
  share one format.)

Everything is vectorized over blocks (a 7B file holds millions of them): numpy views and torch ops, no
per-block Python; a tensor requantized a run of rows at a time (REQUANTIZE_VALUES), so that its floats are never
held whole. A start does this once: later starts map the result (the prepared-weights cache,
motet/engine/worker/prepared_weights.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from motet.kernels.quant import BLOCK, INT4, INT8, QuantizedWeight, WeightFormat

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12  # GGMLQuantizationType values (gguf.constants)
SUPER_BLOCK = 256  # values per K-quant super-block
_Q4_K_BYTES = 144  # d, dmin (fp16), 12 bytes of packed 6-bit scales and mins, 128 bytes of 4-bit values

NATIVE_TYPES = ("Q8_0", "Q4_1", "Q4_0", "Q4_K")  # the types kept in their own values (`native_format`)


def type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@functools.cache
def dequantizable(ggml_type: int) -> bool:
    """Whether gguf-py can dequantize this type (tried on one all-zero block: its public API says no other way)."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def native_format(ggml_type: int) -> WeightFormat | None:
    """The format whose blocks hold this type's values without requantizing (None: int8 after gguf-py)."""
    return {Q8_0: INT8, Q4_1: INT4, Q4_0: INT4, Q4_K: INT4}.get(ggml_type)


def from_ggml(data: np.ndarray, ggml_type: int, shape: tuple[int, int], fmt: WeightFormat) -> QuantizedWeight:
    """A weight [N, K] (N rows of K values) in `fmt` from its GGUF tensor's data in `ggml_type`: `fmt` is the
    type's `native_format`, or int8 (any type gguf-py dequantizes, floats included, requantized). ValueError
    where the bytes do not make that weight or a scale or min is not a finite fp16."""
    N, K = shape
    if fmt == native_format(ggml_type):
        if ggml_type in (Q8_0, Q4_1):
            return fmt.from_gguf_blocks(_bytes(data), shape)
        return _from_q4_0(_bytes(data), shape) if ggml_type == Q4_0 else _from_q4_k(_bytes(data), shape)
    if fmt != INT8:
        raise ValueError(f"{type_name(ggml_type)} blocks are not {fmt.name}; only int8 takes any type")
    if K % BLOCK:
        raise ValueError(f"the input dimension ({K}) must be a multiple of {BLOCK} to requantize it")
    rows = np.ascontiguousarray(data).reshape(N, -1) if np.asarray(data).size else None
    if rows is None or rows.nbytes != N * _row_bytes(ggml_type, K):
        raise ValueError(
            f"{np.asarray(data).nbytes} bytes are not a {N}x{K} weight in {type_name(ggml_type)}"
        )
    step = max(1, REQUANTIZE_VALUES // K)  # rows at once: the floats of a run of rows, never a whole tensor's
    parts = [INT8.quantize(dequantize(rows[i : i + step], ggml_type, K)) for i in range(0, N, step)]
    return _finite(QuantizedWeight.cat(parts))


REQUANTIZE_VALUES = 1 << 22  # the values `from_ggml` dequantizes at once (16 MiB of fp32)


def _row_bytes(ggml_type: int, K: int) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    if K % block:
        raise ValueError(f"rows of {K} values are not whole {type_name(ggml_type)} blocks of {block}")
    return K // block * size


def dequantize(rows: np.ndarray, ggml_type: int, K: int) -> torch.Tensor:
    """fp32 [N, K] of N rows of a GGUF tensor's blocks (uint8 [N, row bytes]), as gguf-py dequantizes them: its
    per-type dequantizer over every block at once (its `dequantize` loops over groups of 16 rows in Python,
    2-3x slower on Q5_0 and Q6_K), where gguf-py has one; else its `dequantize`."""
    import gguf

    N = rows.shape[0]
    qtype = gguf.GGMLQuantizationType(ggml_type)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    trait = getattr(gguf.quants, "_type_traits", {}).get(qtype)  # (gguf-py's per-type dequantizer)
    try:
        if trait is not None:
            values = trait.dequantize_blocks(np.ascontiguousarray(rows).reshape(-1, size))
        else:
            values = gguf.quants.dequantize(rows, qtype)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"gguf-py cannot dequantize {type_name(ggml_type)} ({e})") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(N, K)


def _bytes(data: np.ndarray) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 torch tensor (a writable copy: the reader's arrays are memory maps)."""
    return torch.from_numpy(np.array(data, dtype=np.uint8, order="C")).reshape(-1)


def _blocks(raw: torch.Tensor, shape: tuple[int, int], values: int, nbytes: int, name: str) -> torch.Tensor:
    N, K = shape
    if K % values or raw.numel() != N * (K // values) * nbytes:
        raise ValueError(f"{name}: {raw.numel()} bytes are not the blocks of a {N}x{K} weight")
    return raw.reshape(N, K // values, nbytes)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their two little-endian bytes (the last dimension)."""
    return b.contiguous().view(torch.float16)[..., 0]


def _finite(q: QuantizedWeight) -> QuantizedWeight:
    parts = [q.scales] + ([q.mins] if q.mins is not None else [])
    if not all(torch.isfinite(p).all() for p in parts):
        raise ValueError("a block's scale or min is not a finite fp16")
    return q


def _from_q4_0(raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    N, K = shape
    blocks = _blocks(raw, shape, BLOCK, 18, "Q4_0")  # fp16 d, 16 bytes: value j low nibble, j + 16 high
    scales = _fp16(blocks[..., 0:2])
    mins = (scales.float() * -8).half()  # exact (a power-of-two multiple), unless it overflows: _finite
    return _finite(QuantizedWeight(INT4, blocks[..., 2:].reshape(N, K // 2).contiguous(), scales, mins))


def _from_q4_k(raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    N, K = shape
    blocks = _blocks(raw, shape, SUPER_BLOCK, _Q4_K_BYTES, "Q4_K")
    d, dmin = _fp16(blocks[..., 0:2]).float(), _fp16(blocks[..., 2:4]).float()
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])  # [N, K/256, 8] each, 0..63
    # scale d * sc and min -dmin * m of each 32-value sub-block, rounded to fp16 (the module docstring)
    scales = (d[..., None] * sc).half().reshape(N, K // BLOCK)
    mins = (-(dmin[..., None] * m)).half().reshape(N, K // BLOCK)
    # 128 bytes = 4 groups of 32: sub-block 2j is the low nibbles of group j, sub-block 2j + 1 the high ones.
    qs = blocks[..., 16:].reshape(N, K // SUPER_BLOCK, 4, 32)
    sub = torch.stack((qs & 0xF, qs >> 4), dim=3)  # [N, K/256, 4, 2, 32]: values in order
    sub = sub.reshape(N, K // BLOCK, BLOCK)
    data = sub[..., : BLOCK // 2] | (sub[..., BLOCK // 2 :] << 4)  # int4's packing: value j low, j + 16 high
    return _finite(QuantizedWeight(INT4, data.reshape(N, K // 2).contiguous(), scales, mins))


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of each Q4_K super-block from its 12 bytes (ggml's get_scale_min_k4):
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the
    mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    b = packed.to(torch.int32)
    lo_s, lo_m, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 2) & 0x30)), dim=-1)
    m = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)), dim=-1)
    return sc.float(), m.float()
