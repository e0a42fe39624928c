"""A GGUF file's weights as the model loader takes them, its quantized projections kept in blocks.

`--quantization gguf` serves a model directory's GGUF file (the default model keeps the Q4_1 file it was pulled
from, as `model.gguf`) without dequantizing its projections to floats: each block type maps onto motet's int4 or
int8 format (motet/kernels/ggml_blocks.py: Q8_0 and Q4_1 as they are, Q4_0 and Q4_K as int4, every other type
gguf-py can dequantize requantized into int8, logged once per file), with llama.cpp's rotary row order of q/k
undone by permuting whole rows (llama's and granite's files; the others keep Hugging Face's order), a fused
tensor (Phi-3's attn_qkv, ffn_up) split by rows into its projections, blocks and all, and the norm weights'
offset taken back out where the converter added it (Gemma's 1 + w: the model adds it as it loads). A projection
whose family folds a constant into it as it loads (Granite's multipliers, ModelConfig.weight_scales) comes as
fp32, its blocks dequantized, logged once per file. The lm_head comes in blocks
the same way (and a tied embedding table, which is the lm_head too: `_keep_quantized`); float projections (F32,
F16, BF16), norms and an untied embedding table are read as fp32. A mixture of experts' stacked experts
(ffn_*_exps) come as each expert's projections in their blocks, an expert at a time (the decoder holds them
quantized: motet/engine/worker/model.py's QuantizedExperts; GPT-OSS's MXFP4 experts in their MXFP4 blocks), its
shared expert as a projection. A tensor the converter split in two (GPT-OSS's gate / up biases, an attention's
that its declaration joins) comes joined back as fp32 (gguf_names.JOINS); an attention's other projections, not
the decoder's Linear projections (PROJECTIONS), come as fp32 too. LongRoPE's factor tensors are the config's, not
weights. A tensor in a type gguf-py cannot dequantize is refused, naming the tensor and its type.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from motet.engine.weights.gguf_config import reader_config
from motet.engine.weights.gguf_model import GGUF_FILE
from motet.engine.weights.gguf_names import (
    CONFIG_TENSORS,
    EXPERT,
    expert_names,
    hf_name,
    join,
    joined,
    norm_offset,
    unpermute_qk,
)
from motet.engine.weights.gguf_reader import open_gguf
from motet.engine.weights.gguf_table import GgufTable
from motet.kernels import ggml_blocks
from motet.kernels.quant import FORMATS, INT8, MXFP4, QuantizedWeight, WeightFormat
from motet.models import from_gguf
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from motet.models.projections import FUSED_SHARD, PROJECTIONS

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")
_TABLE, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


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


def _str(meta, key: str) -> str | None:
    field = meta.get_field(key)
    return None if field is None else str(field.contents())


def _parts(t, name: str, decl, cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(Hugging Face name, first row, rows) of each projection a GGUF tensor holds: itself whole, or a fused
    tensor's parts (its family's fused_modules: q, k, v of attn_qkv; gate, up of Phi-3's ffn_up)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in decl.fused_modules:
        return [(name, 0, -1)]
    rows = cfg.projection_rows
    out, start = [], 0
    for part in decl.fused_modules[parts[-2]]:
        out.append((".".join([*parts[:-2], part, parts[-1]]), start, rows[part]))
        start += rows[part]
    if start != int(t.shape[-1]):
        raise ModelLoadError(
            f"GGUF tensor {t.name!r} has {int(t.shape[-1])} rows; it holds "
            f"{' + '.join(decl.fused_modules[parts[-2]])}: {start}"
        )
    return out


def _keep_quantized(name: str) -> bool:
    """Whether a tensor (by its Hugging Face name) in a block type is yielded as a QuantizedWeight rather than
    dequantized to fp32: every decoder projection and the lm_head (motet/engine/worker/decoder_weights.py keeps
    them in their blocks). (The embedding table: a GgufTable, looked up in the file's blocks; a mixture of
    experts' experts: `_experts`.)"""
    return name == _LM_HEAD or (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS)


def _refusal(path: Path, tensor_name: str, type_name: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path.name}: tensor {tensor_name!r} is {type_name}, which gguf-py cannot dequantize; motet serves "
        f"GGUF tensors in {', '.join(ggml_blocks.NATIVE_TYPES)} blocks as they are, {'/'.join(_FLOAT_TYPES)} as "
        f"floats, and any other type gguf-py dequantizes (the other K-quants, Q5_0/Q5_1, IQ*) requantized to "
        f"int8 (requantize the file with llama.cpp's llama-quantize, or serve a float checkpoint with "
        f"--quantization {'|'.join(FORMATS)})"
    )


def _formats(kept: dict[str, tuple[int, str]]) -> dict[str, WeightFormat | None]:
    """The format each tensor kept quantized (by name: its GGML type and that type's name) is yielded in:
    its type's own (ggml_blocks.native_format; None, fp32, for a float type), except that the parts of one
    fused layer (q/k/v, gate/up: the model holds each fused layer in one format) all go to int8 where
    they differ (llama.cpp's Q4_K_M files hold attn_v in Q6_K beside Q4_K attn_q/attn_k)."""
    own = {
        n: None if tn in _FLOAT_TYPES else ggml_blocks.native_format(gt) or INT8
        for n, (gt, tn) in kept.items()
    }
    fused: dict[str, set[WeightFormat | None]] = {}  # fused layer -> its parts' formats
    for name, fmt in own.items():
        fused.setdefault(_fused_layer(name), set()).add(fmt)
    return {name: INT8 if len(fused[_fused_layer(name)]) > 1 else fmt for name, fmt in own.items()}


def _fused_layer(name: str) -> str:
    """The name of the model's layer that holds a projection (model.layers.0.qkv_proj.weight for its k_proj)."""
    parts = name.split(".")
    parts[-2] = FUSED_SHARD.get(parts[-2], (parts[-2],))[0]
    return ".".join(parts)


def _model_config(path: Path, reader, decl) -> ModelConfig | None:
    """What the weights need of the model's config (a fused tensor's parts, the constants folded in): its
    directory's (a bare file's derived one, a pulled model's), else the metadata's. None where the metadata makes
    no config (a file of tables alone) and the family needs none (nothing fused, no GGUF keys of its own)."""
    if (path.parent / "config.json").is_file():
        return ModelConfig.from_dir(path.parent)
    try:
        return ModelConfig.from_dict(reader_config(reader, path.name)[1])
    except ModelLoadError:
        if decl.fused_modules or decl.gguf_config is not None:
            raise
        return None


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, fp32 tensor or QuantizedWeight) for every tensor of a GGUF file of a declared family. Every
    tensor's type is checked before the first is yielded."""
    import gguf

    path = Path(path)
    try:
        reader = open_gguf(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _str(reader, "general.architecture")
    decl = from_gguf(arch, _int(reader, f"{arch}.expert_count", 0) > 0)
    if decl is None:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not one motet serves")
    cfg = _model_config(path, reader, decl)
    n_head = _int(reader, f"{arch}.attention.head_count")
    heads = {"q_proj": n_head, "k_proj": _int(reader, f"{arch}.attention.head_count_kv", n_head)}
    if not decl.gguf_permuted_qk:  # rows in Hugging Face's order already
        heads = {}
    weights = [
        t for t in reader.tensors if t.name not in CONFIG_TENSORS
    ]  # (LongRoPE's factors: the config's)
    stacked = [t for t in weights if EXPERT in hf_name(t.name, decl)]
    for t in stacked:
        if not ggml_blocks.dequantizable(int(t.tensor_type)):
            raise _refusal(path, t.name, ggml_blocks.type_name(int(t.tensor_type)))
    weights = [t for t in weights if t not in stacked]
    tensors = [(t, part) for t in weights for part in _parts(t, hf_name(t.name, decl), decl, cfg)]
    tied = all(name != _LM_HEAD for _, (name, _, _) in tensors)
    # the layers a constant is folded into as they load (each part of a fused one): floats
    scales = cfg.weight_scales if cfg is not None else {}
    scaled = {_fused_layer(n) for _, (n, _, _) in tensors if n.split(".")[-2] in scales}
    kept = {}  # Hugging Face name -> (GGML type, its name), for the tensors kept quantized
    unfolded = set()  # the types of the blocks dequantized for a folded constant
    for t, (name, _, _) in tensors:
        ggml_type = int(t.tensor_type)
        if not ggml_blocks.dequantizable(ggml_type):
            raise _refusal(path, t.name, ggml_blocks.type_name(ggml_type))
        if name == _TABLE and tied:  # the lm_head too: in blocks made from the table's
            name = _LM_HEAD
        if _keep_quantized(name):
            if _fused_layer(name) in scaled:
                unfolded.add(ggml_blocks.type_name(ggml_type))
                continue
            kept[name] = (ggml_type, ggml_blocks.type_name(ggml_type))
    if unfolded - set(_FLOAT_TYPES):
        log.warning(
            "%s: %s blocks of %s served as fp32: the model folds its constants into them as they load",
            path.name, ", ".join(sorted(unfolded - set(_FLOAT_TYPES))), ", ".join(sorted(set(cfg.weight_scales))),
        )  # fmt: skip
    formats = _formats(kept)
    requantized = sorted(
        {tn for n, (gt, tn) in kept.items() if formats[n] not in (None, ggml_blocks.native_format(gt))}
    )
    if requantized:
        log.warning(
            "%s: %s tensors requantized to int8 (Q8_0 blocks): motet keeps %s blocks as they are, and the parts "
            "of a fused layer (q/k/v, gate/up) in one format",
            path.name, ", ".join(requantized), ", ".join(ggml_blocks.NATIVE_TYPES),
        )  # fmt: skip
    yield from _experts(path, stacked, decl)
    whole = None  # (GGUF tensor, its blocks or values), kept while its parts are yielded
    # a tensor the converter split in two (gguf_names.JOINS) -> its parts by their GGUF names
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for t, (name, start, rows) in tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if (
            name == _TABLE
        ):  # looked up in its own blocks; a tied lm_head multiplies in blocks of the same tensor
            yield name, GgufTable(path.resolve(), t.data_offset, int(t.tensor_type), shape)
            if not tied:
                continue
            name = _LM_HEAD
        if joined(t.name, decl):
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            halves.setdefault(name, {})[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
                shape
            )
            continue
        module = name.split(".")[-2] if name.endswith(".weight") else None
        rows = shape[0] if rows < 0 else rows
        if formats.get(name) is not None:
            if whole is None or whole[0] is not t:
                try:
                    whole = t, ggml_blocks.from_ggml(t.data, int(t.tensor_type), shape, formats[name])
                except ValueError as e:
                    raise ModelLoadError(f"{path.name}: tensor {t.name!r} ({kept[name][1]}): {e}") from None
            weight = whole[1] if rows == shape[0] else whole[1].narrow(0, start, rows)
            if module in heads:  # llama.cpp's rotary row order, undone on whole rows
                order = unpermute_qk(torch.arange(rows)[:, None], heads[module])[:, 0]
                weight = weight.rows(order)
            yield name, weight
            continue
        if whole is None or whole[0] is not t:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            whole = t, torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).reshape(shape)
        w = whole[1] if rows == shape[0] else whole[1].narrow(0, start, rows).clone()
        if offset := norm_offset(name, decl):
            w = w - offset
        if module in heads:
            w = unpermute_qk(w, heads[module])
        yield name, w
    for name, parts in halves.items():
        yield name, join(name, parts, decl)


def _experts(path: Path, stacked: list, decl) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each expert's projections of a mixture of experts' stacked tensors (ffn_gate_exps [E, I, H], ...), an
    expert at a time: in their blocks where the type is one of motet's (another type gguf-py dequantizes:
    requantized to int8, as a projection's), each layer's gate and up in one format (the decoder stacks them in
    one weight: int8 for both where their types differ); float types as fp32."""
    import gguf

    fmt = {}
    for t in stacked:  # (MXFP4: gpt-oss's experts, in their blocks as OpenAI's checkpoints hold them)
        name = ggml_blocks.type_name(int(t.tensor_type))
        native = (
            MXFP4 if int(t.tensor_type) == MXFP4.ggml_type else ggml_blocks.native_format(int(t.tensor_type))
        )
        fmt[t.name] = None if name in _FLOAT_TYPES else native or INT8
    for t in stacked:  # a layer's ffn_gate_exps and ffn_up_exps: one format
        up = t.name.replace("_gate_exps.", "_up_exps.")
        if ".ffn_gate_exps." in t.name and up in fmt and fmt[t.name] != fmt[up]:
            fmt[t.name] = fmt[up] = INT8 if None not in (fmt[t.name], fmt[up]) else None
    requantized = sorted(
        {
            ggml_blocks.type_name(int(t.tensor_type))
            for t in stacked
            if fmt[t.name] not in (None, MXFP4, ggml_blocks.native_format(int(t.tensor_type)))
        }
    )
    if requantized:
        log.warning("%s: the experts' %s blocks requantized to int8", path.name, ", ".join(requantized))
    for t in stacked:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # [E, rows, columns]
        if len(shape) != 3:
            raise ModelLoadError(
                f"{path.name}: tensor {t.name!r} has shape {shape}: experts stack [E, rows, cols]"
            )
        for e, name in enumerate(expert_names(hf_name(t.name, decl), shape[0])):
            if fmt[t.name] is MXFP4 and int(t.tensor_type) == MXFP4.ggml_type:
                raw = torch.from_numpy(np.array(t.data[e], dtype=np.uint8, order="C")).reshape(-1)
                try:
                    yield name, MXFP4.from_gguf_blocks(raw, shape[1:])
                except ValueError as err:
                    raise ModelLoadError(f"{path.name}: tensor {t.name!r}: {err}") from None
                continue
            if fmt[t.name] is not None:
                try:
                    yield name, ggml_blocks.from_ggml(t.data[e], int(t.tensor_type), shape[1:], fmt[t.name])
                except ValueError as err:
                    raise ModelLoadError(f"{path.name}: tensor {t.name!r}: {err}") from None
                continue
            arr = gguf.quants.dequantize(t.data[e], t.tensor_type)
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).reshape(shape[1:])
