"""Hugging Face checkpoints quantized by GPTQ or AWQ (4-bit), served in their own weights.

Such a checkpoint declares its method in config.json's `quantization_config` (or, as AutoGPTQ writes it, in
`quantize_config.json`): `declared_quantization` (motet/engine/weights/quantization_config.py) reads and checks
it, and refuses a `--quantization` other than none or the checkpoint's own. `iter_checkpoint_weights` yields the
checkpoint's tensors with each quantized projection's parts (`qweight`, `qzeros`, `scales`, GPTQ's `g_idx`)
replaced by one int4 weight (motet/kernels/gptq_awq.py converts them), the other tensors (embeddings, norms,
lm_head, biases, modules left unquantized) as stored. An MXFP4 checkpoint (OpenAI's gpt-oss: its experts' `*_blocks` and `*_scales`) is
served in its blocks: each pair yielded as one tensor whose experts are read in MXFP4 (motet/engine/weights/mxfp4.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from motet.engine.weights.checkpoint import StoredTensor, iter_weights
from motet.engine.weights.mxfp4 import Mxfp4Tensor, paired
from motet.engine.weights.quantization_config import MXFP4, CheckpointQuantization
from motet.kernels.gptq_awq import from_awq, from_gptq
from motet.kernels.quant import QuantizedWeight
from motet.models.declaration import ModelLoadError

_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
_REQUIRED = ("qweight", "qzeros", "scales")  # g_idx may be absent: each input in group k // group_size


def iter_checkpoint_weights(
    model_dir: str | Path, declared: CheckpointQuantization | None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | Mxfp4Tensor]]:
    """The checkpoint's tensors (checkpoint.iter_weights), each projection `declared` quantized as one
    QuantizedWeight named `<module>.weight`, yielded once all its parts are read; in an MXFP4 checkpoint each
    `W_blocks` / `W_scales` pair as one Mxfp4Tensor `W` (read and dequantized by the loader, an expert at a
    time). Every other tensor is a float parameter's: one stored in an integer (or bool) dtype is refused by
    name, where the loader would copy its integers in as the weight's values."""
    for name, tensor in _checkpoint_weights(model_dir, declared):
        if isinstance(tensor, torch.Tensor | StoredTensor) and not tensor.is_floating_point():
            where = f" ({tensor.file})" if isinstance(tensor, StoredTensor) else ""
            raise ModelLoadError(
                f"checkpoint tensor {name!r}{where} is stored as {str(tensor.dtype).removeprefix('torch.')}: a "
                f"model's weights are floating-point (F32, F16, BF16)"
            )
        yield name, tensor


def _checkpoint_weights(model_dir: str | Path, declared: CheckpointQuantization | None) -> Iterator:
    if declared is None:
        yield from iter_weights(model_dir)
        return
    if declared.method == MXFP4:
        yield from paired(iter_weights(model_dir), declared.source)
        return
    parts = _PARTS[declared.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> its parts read so far
    for name, tensor in iter_weights(model_dir):
        module, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        pending.setdefault(module, {})[part] = tensor.load()
        if all(p in pending[module] for p in parts):
            yield f"{module}.weight", _convert(module, pending.pop(module), declared)
    for module, found in pending.items():  # GPTQ without g_idx, or a module missing parts
        missing = [p for p in _REQUIRED if p not in found]
        if missing:
            raise ModelLoadError(
                f"checkpoint ({declared.method.upper()}) is missing {', '.join(f'{module}.{p}' for p in missing)}"
            )
        yield f"{module}.weight", _convert(module, found, declared)


def _convert(
    module: str, parts: dict[str, torch.Tensor], declared: CheckpointQuantization
) -> QuantizedWeight:
    try:
        if declared.method == "gptq":
            return from_gptq(
                parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                declared.group_size, declared.zeros_minus_one,
            )  # fmt: skip
        return from_awq(parts["qweight"], parts["qzeros"], parts["scales"], declared.group_size)
    except ValueError as e:
        raise ModelLoadError(
            f"checkpoint ({declared.method.upper()}, {declared.source}): {module}: {e}"
        ) from None
