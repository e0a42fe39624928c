"""A GGUF file's weights as the model loader takes them, its quantized projections kept in their own blocks.

`--quantization gguf` serves a model directory's GGUF file (the default model keeps the Q4_1 file it was
pulled from, as `model.gguf`) without dequantizing its projections: Q4_1 blocks become the int4 format,
Q8_0 blocks the int8 format (motet/kernels/quant.py: the same bytes), with llama.cpp's rotary row order of
q/k undone by permuting whole rows. Float tensors (F32, F16, BF16) and the embedding table and norms in any
type are read as fp32 (the table is a lookup, kept in the model's dtype as with `--quantization int4`). A
projection in another block type (the K-quants, IQ, Q4_0, ...) is refused, naming the tensor and its type.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from motet.engine.config import ModelLoadError
from motet.engine.gguf_convert import hf_name, unpermute_qk
from motet.kernels.quant import FORMATS, QuantizedWeight

GGUF_FILE = "model.gguf"  # the name `motet pull` gives the default model's GGUF in its directory
_FLOAT_TYPES = ("F32", "F16", "BF16")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gguf_file(model_dir: str | Path) -> Path:
    """The GGUF file of a model directory: `model.gguf`, else its only `*.gguf`."""
    model_dir = Path(model_dir)
    if (model_dir / GGUF_FILE).is_file():
        return model_dir / GGUF_FILE
    found = sorted(model_dir.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelLoadError(
            f"--quantization gguf: {model_dir} holds no .gguf file (a default model pulled before motet kept "
            f"its GGUF: run `motet pull --force`)"
        )
    raise ModelLoadError(
        f"--quantization gguf: {model_dir} holds several .gguf files ({', '.join(f.name for f in found)}); "
        f"name the one to serve {GGUF_FILE}"
    )


def _int(meta, key: str, default: int | None = None) -> int:
    field = meta.get_field(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    return int(field.contents())


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, fp32 tensor or QuantizedWeight) for every tensor of a llama GGUF file."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    n_head = _int(reader, "llama.attention.head_count")
    heads = {"q_proj": n_head, "k_proj": _int(reader, "llama.attention.head_count_kv", n_head)}
    by_type = {f.ggml_type: f for f in FORMATS.values()}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        module = name.split(".")[-2]
        type_name = gguf.GGMLQuantizationType(t.tensor_type).name
        if module in _PROJECTIONS and name.endswith(".weight") and type_name not in _FLOAT_TYPES:
            fmt = by_type.get(int(t.tensor_type))
            if fmt is None:
                raise ModelLoadError(
                    f"{path.name}: tensor {t.name!r} is {type_name}; motet serves GGUF projections in "
                    f"{', '.join(gguf.GGMLQuantizationType(f.ggml_type).name for f in FORMATS.values())} "
                    f"blocks or {'/'.join(_FLOAT_TYPES)} (requantize the file with llama.cpp's llama-quantize, "
                    f"or serve a float checkpoint with --quantization {'|'.join(FORMATS)})"
                )
            raw = torch.from_numpy(np.array(t.data, order="C")).reshape(-1)  # a writable copy
            try:
                weight = fmt.from_gguf_blocks(raw, shape)
            except ValueError as e:
                raise ModelLoadError(f"{path.name}: tensor {t.name!r}: {e}") from None
            if module in heads:  # llama.cpp's rotary row order, undone on whole rows
                order = unpermute_qk(torch.arange(shape[0])[:, None], heads[module])[:, 0]
                weight = weight.rows(order)
            yield name, weight
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).reshape(shape)
        if module in heads and name.endswith(".weight"):
            w = unpermute_qk(w, heads[module])
        yield name, w
