"""Block-quantized weight formats (llama.cpp's Q8_0 and Q4_1 layouts) and their torch reference.

A weight [N, K] (N outputs, K inputs) is cut along K into blocks of 32 values, each with its own fp16
scale: `int8` stores each value as round(w / scale) in [-127, 127] (Q8_0: scale = max |w| / 127); `int4`
stores round((w - min) / scale) in [0, 15] with a per-block fp16 min as well (Q4_1: scale = (max - min) /
15), two values per byte as Q4_1 packs them (byte j of a block: value j in the low nibble, value j + 16 in
the high one), so a GGUF file's blocks map onto it without dequantizing. A weight's value is
`q * scale (+ min)`, computed in fp32: `QuantizedWeight.dequantize` is that meaning.

The product on CPU quantizes the activations too, as llama.cpp's CPU kernels do (Q8_0 / Q8_1 activations):
each row of x in blocks of 32 as int8 with a scale (`quantize_activations`), so the native kernels
(motet/kernels/csrc/qgemm.h) multiply blocks in 8-bit integers, exactly, with results independent of the
batch a row runs in. `QuantizedWeight.linear` is that product in torch (dequantized weights times
dequantized activations), the reference the native kernels are held to; GPU kernels
(motet/kernels/triton_quant.py) keep 16-bit activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from motet.kernels import quant_names
from motet.kernels.quant_names import BLOCK


@dataclass(frozen=True)
class WeightFormat:
    """A block format: its name (the `--quantization` value), bits per value, whether blocks carry a min, and
    the GGML type whose blocks hold the same bytes (a GGUF tensor of that type: `from_gguf_blocks`). Scales are
    fp16, or (`codebook` given: MXFP4) one E8M0 byte, 2^(byte - 127), each code standing for codebook[code]."""

    name: str
    bits: int
    has_min: bool
    ggml_type: int
    codebook: tuple[float, ...] | None = None

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.codebook is not None else torch.float16

    @property
    def header_bytes(self) -> int:
        """Bytes of a block's scale (and min)."""
        return self.scale_dtype.itemsize * (1 + self.has_min)

    @property
    def gguf_block_bytes(self) -> int:
        """Bytes of one GGUF block: its scale, (its min), the values."""
        return self.header_bytes + BLOCK * self.bits // 8

    def from_gguf_blocks(self, raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
        """A weight [N, K] from its GGUF blocks (uint8, N * K / 32 blocks of `gguf_block_bytes`), as stored."""
        N, K = shape
        if K % BLOCK or raw.dtype != torch.uint8 or raw.numel() != N * K // BLOCK * self.gguf_block_bytes:
            raise ValueError(
                f"{self.name}: {raw.numel()} bytes ({raw.dtype}) are not the GGUF blocks of a {N}x{K} weight"
            )
        blocks = raw.reshape(N, K // BLOCK, self.gguf_block_bytes)
        header, width = self.header_bytes, self.scale_dtype.itemsize
        scales = blocks[..., 0:width].contiguous().view(self.scale_dtype)[..., 0]
        mins = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if self.has_min else None
        data = blocks[..., header:].contiguous().reshape(N, -1)
        return QuantizedWeight(self, data.view(torch.int8) if self.bits == 8 else data, scales, mins)

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        """`weight` [N, K] (K a multiple of BLOCK) in this format, on its device; rounding to nearest."""
        N, K = weight.shape
        if K % BLOCK:
            raise ValueError(f"{self.name}: the input dimension ({K}) must be a multiple of {BLOCK}")
        if self.codebook is not None:
            raise ValueError(f"{self.name} weights are read as checkpoints hold them, not quantized here")
        w = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
        if self.has_min:
            lo, hi = w.amin(-1), w.amax(-1)
            scales = ((hi - lo) / (2**self.bits - 1)).half()
            mins = lo.half()
            q = (w - mins.float()[..., None]) / _safe(scales)[..., None]
            q = q.round().clamp(0, 2**self.bits - 1).to(torch.uint8)
            data = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(N, K // 2)
        else:
            limit = 2 ** (self.bits - 1) - 1
            scales = (w.abs().amax(-1) / limit).half()
            mins = None
            q = (w / _safe(scales)[..., None]).round().clamp(-limit, limit)
            data = q.to(torch.int8).reshape(N, K)
        return QuantizedWeight(self, data.contiguous(), scales.contiguous(), mins)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of BLOCK) as the CPU product sees it: each block of 32 as Q8_0 rounds it, to
    int8 steps of d = max|x| / 127 (q = x * (1 / d) rounded, in fp32; ties to even where llama.cpp's
    reference rounds them away from zero), d kept in fp16 as Q8_0 does, returned dequantized (q * d) in fp32."""
    *lead, K = x.shape
    xb = x.float().reshape(*lead, K // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return ((xb * inv).round() * d.half().float()).reshape(*lead, K)  # Q8_0 keeps d in fp16


def _safe(scales: torch.Tensor) -> torch.Tensor:
    """fp32 scales with zeros (all-equal blocks) replaced by one: every value of such a block is its min/0."""
    s = scales.float()
    return torch.where(s == 0, torch.ones_like(s), s)


INT8 = WeightFormat(quant_names.INT8, bits=8, has_min=False, ggml_type=8)  # Q8_0's layout
INT4 = WeightFormat(quant_names.INT4, bits=4, has_min=True, ggml_type=3)  # Q4_1's layout
# --quantization's formats, as the parser names them (quant_names: it reads them before torch is imported)
FORMATS = {name: {INT8.name: INT8, INT4.name: INT4}[name] for name in quant_names.QUANTIZE_FORMATS}
# FP4 E2M1's 16 values by their code (sign bit 3, exponent bits 2-1, mantissa bit 0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# OCP's MXFP4 (gpt-oss's experts; GGML_TYPE_MXFP4's blocks: the E8M0 byte, then the codes as Q4_1 packs them)
MXFP4 = WeightFormat("mxfp4", bits=4, has_min=False, ggml_type=39, codebook=FP4_VALUES)


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class QuantizedWeight:
    """A weight [N, K] in a block format: `data` int8 [N, K] (int8) or uint8 [N, K / 2] (int4, two values a
    byte), `scales` and (int4) `mins` fp16 [N, K / BLOCK]."""

    format: WeightFormat
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __post_init__(self):
        N, blocks = self.scales.shape
        per_byte = 8 // self.format.bits
        expected = (N, blocks * BLOCK // per_byte)
        if tuple(self.data.shape) != expected or self.scales.dtype != self.format.scale_dtype:
            raise ValueError(
                f"{self.format.name}: data {tuple(self.data.shape)} / scales {tuple(self.scales.shape)} "
                f"{self.scales.dtype} do not make a weight (data {expected}, {self.format.scale_dtype} scales expected)"
            )
        if self.format.has_min != (self.mins is not None) or (
            self.mins is not None
            and (self.mins.shape != self.scales.shape or self.mins.dtype != torch.float16)
        ):
            raise ValueError(
                f"{self.format.name}: mins must be fp16 {tuple(self.scales.shape)} exactly when the format has them"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        parts = [self.data, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def _map(self, fn) -> QuantizedWeight:
        return QuantizedWeight(
            self.format, fn(self.data), fn(self.scales), None if self.mins is None else fn(self.mins)
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self._map(lambda t: t.to(device))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Output rows [start, start + length) (dim 0), or input columns (dim 1), which must be whole blocks
        (a tensor-parallel rank's part of the weight)."""
        if dim == 0:
            return self._map(lambda t: t.narrow(0, start, length))
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"columns {start}:{start + length} do not fall on blocks of {BLOCK}")
        per_byte = 8 // self.format.bits
        data = self.data.narrow(1, start // per_byte, length // per_byte)
        blocks = [
            t.narrow(1, start // BLOCK, length // BLOCK) for t in (self.scales, self.mins) if t is not None
        ]
        return QuantizedWeight(self.format, data, blocks[0], blocks[1] if len(blocks) > 1 else None)

    def padded(self, rows: int) -> QuantizedWeight:
        """The weight with zero rows appended up to `rows` (scale and min 0: they compute 0)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        return QuantizedWeight.cat([self, self._map(lambda t: t.new_zeros((extra, *t.shape[1:])))])

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight's rows `index` (a permutation or a selection of output rows)."""
        return self._map(lambda t: t[index].contiguous())

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after the other (a fused layer's shards); one format for all."""
        if len({p.format for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only weights of one format and one input size are concatenated")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(
            parts[0].format, torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]), mins
        )

    def values(self) -> torch.Tensor:
        """The stored integers [N, K / BLOCK, BLOCK] (4 bits: 0..15 in the order of the weight's columns)."""
        N, K = self.shape
        if self.format.bits == 4:
            packed = self.data.reshape(N, K // BLOCK, BLOCK // 2)
            return torch.cat((packed & 0xF, packed >> 4), dim=-1)
        return self.data.reshape(N, K // BLOCK, BLOCK)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the format stands for (computed in fp32, then cast to `dtype`)."""
        N, K = self.shape
        if self.format.codebook is not None:  # codebook values times 2^(e - 127): exact in fp32
            values = torch.tensor(self.format.codebook, device=self.data.device)[self.values().long()]
            return torch.ldexp(values, self.scales.int()[..., None] - 127).reshape(N, K).to(dtype)
        w = self.values().float() * self.scales.float()[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        return w.reshape(N, K).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` as the CPU computes it: the reference product of the dequantized weight and
        the int8-block activations (`quantize_activations`), in fp32, returned in x's dtype."""
        out = F.linear(quantize_activations(x), self.dequantize(), None if bias is None else bias.float())
        return out.to(x.dtype)
