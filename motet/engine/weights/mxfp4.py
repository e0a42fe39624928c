"""MXFP4 tensors of a checkpoint (the OCP microscaling format: FP4 E2M1 values in blocks of 32 sharing one E8M0
exponent), dequantized as they are read.

A checkpoint quantized this way (config.json `quantization_config: {"quant_method": "mxfp4", ...}`, as OpenAI's
gpt-oss checkpoints are) stores each quantized weight `W` as two tensors: `W_blocks` [E, R, G, 16] uint8, two
FP4 values a byte (the low nibble first), and `W_scales` [E, R, G] uint8, each block's exponent biased by 127.
Dequantized, row r of expert e is its G blocks of 32 values side by side: [E, R, G * 32]; transformers holds
the result transposed, [E, G * 32, R] (its stacked experts' layout: inputs first). `paired` turns the two tensors
into one `Mxfp4Tensor` of that shape, read lazily: `narrow` along the experts reads nothing, and `load` reads
and dequantizes only the experts left, so a loader that takes one expert at a time holds one expert's floats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from motet.engine.weights.checkpoint import StoredTensor
from motet.kernels import quant
from motet.kernels.quant import QuantizedWeight
from motet.models.declaration import ModelLoadError

BLOCK = 32  # values sharing one exponent
SCALE_BIAS = 127  # E8M0: the exponent is the byte minus 127
FP4_VALUES = quant.FP4_VALUES


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values [..., G * 32] of `blocks` [..., G, 16] (uint8) and `scales` [..., G] (uint8), computed as
    transformers does (`convert_moe_packed_tensors`): exact, as every FP4 value times 2^-127 ... 2^127 is an fp32
    number (the scale 255, NaN in OCP's spec, makes infinities there and here)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    *prefix, groups, half = blocks.shape
    codes = blocks.reshape(-1, half)
    out = torch.empty(codes.shape[0], 2 * half, dtype=torch.float32)
    out[:, 0::2] = lut[(codes & 0x0F).int()]
    out[:, 1::2] = lut[(codes >> 4).int()]
    exponents = scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    return torch.ldexp(out, exponents).view(*prefix, groups * 2 * half)


@dataclasses.dataclass(frozen=True)
class Mxfp4Tensor:
    """A stacked MXFP4 weight of a checkpoint as transformers holds it dequantized, [E, G * 32, R], not read
    yet (`blocks` [E, R, G, 16] and `scales` [E, R, G], stored or in memory). `name`: the blocks tensor's."""

    name: str
    blocks: StoredTensor | torch.Tensor
    scales: StoredTensor | torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups, half = self.blocks.shape
        return experts, groups * 2 * half, rows

    def narrow(self, dim: int, start: int, length: int) -> Mxfp4Tensor:
        """Experts [start, start + length) (dim 0 only), without reading anything."""
        if dim != 0:
            raise ValueError("an MXFP4 tensor narrows along its experts only")
        return dataclasses.replace(
            self, blocks=self.blocks.narrow(0, start, length), scales=self.scales.narrow(0, start, length)
        )

    def expert(self, e: int) -> QuantizedWeight:
        """Expert e's weight [R, G * 32] in its MXFP4 blocks, read (not dequantized): the codes repacked from the
        checkpoint's order (byte j: values 2j and 2j + 1) into GGML's (byte j: values j and j + 16)."""
        blocks, scales = (t.narrow(0, e, 1) for t in (self.blocks, self.scales))
        blocks, scales = (t.load() if isinstance(t, StoredTensor) else t for t in (blocks, scales))
        rows, groups, half = blocks.shape[1:]
        codes = torch.empty(rows, groups, 2 * half, dtype=torch.uint8)
        codes[..., 0::2], codes[..., 1::2] = blocks[0] & 0x0F, blocks[0] >> 4
        data = codes[..., :half] | (codes[..., half:] << 4)
        return QuantizedWeight(quant.MXFP4, data.reshape(rows, groups * half), scales[0].contiguous(), None)

    def load(self) -> torch.Tensor:
        """The experts' fp32 values, read and dequantized: [E, G * 32, R] (a transposed view)."""
        blocks, scales = (t.load() if isinstance(t, StoredTensor) else t for t in (self.blocks, self.scales))
        return dequantize(blocks, scales).transpose(1, 2)


def paired(weights, source: str) -> Iterator[tuple[str, StoredTensor | torch.Tensor | Mxfp4Tensor]]:
    """The checkpoint's tensors with each `W_blocks` / `W_scales` pair yielded as one `Mxfp4Tensor` named `W`
    (once both are read: neither is loaded), the others as they come; ModelLoadError naming the tensor where a
    pair is malformed (dtypes, shapes) or incomplete."""
    pending: dict[str, dict[str, StoredTensor | torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition("_")
        if not base or part not in ("blocks", "scales"):
            yield name, tensor
            continue
        found = pending.setdefault(base, {})
        found[part] = tensor
        if len(found) == 2:
            del pending[base]
            yield base, _checked(base, found["blocks"], found["scales"], source)
    for base, found in pending.items():
        (have,) = found
        lacking = "scales" if have == "blocks" else "blocks"
        raise ModelLoadError(f"checkpoint (MXFP4, {source}): {base}_{have} has no {base}_{lacking} tensor")


def _checked(base: str, blocks, scales, source: str) -> Mxfp4Tensor:
    where = f"checkpoint (MXFP4, {source}): {base}_blocks"
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(
            f"{where} and _scales must be uint8, got {_dtype_name(blocks)} and {_dtype_name(scales)}"
        )
    if len(blocks.shape) != 4 or blocks.shape[-1] != BLOCK // 2:
        raise ModelLoadError(
            f"{where} has shape {tuple(blocks.shape)}; stacked experts' blocks are [experts, rows, groups, "
            f"{BLOCK // 2}] (two values a byte, {BLOCK} a block)"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelLoadError(
            f"{where} has shape {tuple(blocks.shape)} and {base}_scales {tuple(scales.shape)}: one scale a block, "
            f"{tuple(blocks.shape[:-1])}"
        )
    return Mxfp4Tensor(f"{base}_blocks", blocks, scales)


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")
