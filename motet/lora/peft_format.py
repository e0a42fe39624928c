"""The PEFT LoRA format as motet serves it: the modules LoRA may target, the files, module names and shapes,
and the error every refusal raises (motet/lora/peft_config.py reads the config, motet/lora/adapter.py the weights)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from motet.models import DECLARATIONS, OWN_PROJECTIONS, fused_modules
from motet.models.attention import PER_HEAD
from motet.models.config import ModelConfig
from motet.models.projections import PROJECTIONS, QKV, projection_shapes

# a per-head attention's and an MLP's (an attention's own besides: `base_modules`)
TARGET_MODULES = PROJECTIONS
# Checkpoint modules that hold several of those (Phi-3's qkv_proj, gate_up_proj), as the declarations name them
# (motet/models/): an adapter for such a base targets them, and its factors are split as the base's weights are.
FUSED_MODULES = {name: parts for decl in DECLARATIONS for name, parts in decl.fused_modules.items()}
MODULE_PARENT = {
    m: "self_attn" if m in (*QKV, "o_proj", *OWN_PROJECTIONS) else "mlp"
    for m in (*TARGET_MODULES, *OWN_PROJECTIONS)
}
MODULE_PARENT |= {name: MODULE_PARENT[parts[0]] for name, parts in FUSED_MODULES.items()}
LINEAR_MODULES = frozenset(MODULE_PARENT)  # every decoder-layer linear module name of any declared family
# Outside the decoder layers: the token embedding (PEFT's lora.Embedding: the delta of token id t is
# B @ A[:, t] * scale) and the output head (a linear module like the others). Keyed by layer 0 in an adapter.
MODEL_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for the Llama family when target_modules is null


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the key or field to fix."""


class AdapterTooLarge(AdapterError):
    """An adapter (or one of its files) above a size limit: HTTP 413 rather than 400."""


def base_modules(base: ModelConfig) -> tuple[str, ...]:
    """The linear modules of the base's decoder layers as its checkpoint, and so PEFT, names them."""
    attention = getattr(base, "attention", PER_HEAD).checkpoint_modules(base)
    if attention is not None:  # (an attention of its own: its projections, then the MLP's)
        return (*attention, "gate_proj", "up_proj", "down_proj")
    fused = fused_modules(getattr(base, "architecture", None))
    out: list[str] = []
    for m in TARGET_MODULES:
        owner = next((name for name, parts in fused.items() if m in parts), m)
        if owner not in out:
            out.append(owner)
    return tuple(out)


def module_shape(base: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder layer's linear module, or of the embedding (in: the vocabulary)
    or the output head."""
    h = base.hidden_size
    shapes = projection_shapes(
        h, base.num_attention_heads, base.num_key_value_heads, base.head_dim, base.intermediate_size
    )
    # the base's attention's own (another attention's modules are empty in it)
    shapes |= {m: (0, 0) for m in OWN_PROJECTIONS}
    shapes |= getattr(base, "attention", PER_HEAD).projection_shapes(base)
    if module in FUSED_MODULES:
        parts = [shapes[p] for p in FUSED_MODULES[module]]
        return parts[0][0], sum(out for _, out in parts)
    if module == "embed_tokens":
        return base.vocab_size, h
    if module == "lm_head":
        return h, base.vocab_size
    if module not in shapes:
        raise AdapterError(f"unknown module {module!r}; LoRA applies to {', '.join(TARGET_MODULES)}")
    return shapes[module]


# safetensors' element types an adapter's tensors may have, in the order of its `Dtype` enum (a file holds its
# tensors by that order descending, then by name), and their sizes
SAFETENSORS_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
PEFT_METADATA = {"format": "pt"}  # what PEFT's save_pretrained gives the weights file


def safetensors_bytes(
    tensors: Mapping[str, tuple[str, Sequence[int]]], metadata: dict = PEFT_METADATA
) -> int:
    """The size of the safetensors file of `tensors` (name -> (dtype, shape)) as safetensors writes it: the header's
    length (8 bytes), its JSON header padded with spaces to 8 bytes, then the tensors' data, in its order."""
    order = list(SAFETENSORS_DTYPES)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape) in sorted(tensors.items(), key=lambda t: (-order.index(t[1][0]), t[0])):
        size = SAFETENSORS_DTYPES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = len(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())
    return 8 + -(-text // 8) * 8 + offset


def lora_tensors(
    base: ModelConfig, modules: Sequence[str], rank: int
) -> dict[str, tuple[str, tuple[int, int]]]:
    """The tensors of a LoRA adapter of `rank` on the decoder layers' linear `modules` of `base` as PEFT saves them:
    A [rank, in] and B [out, rank] of each module of each layer, named as PEFT names them, in float32 (PEFT's dtype
    for a trained adapter, whatever the base's). (An adapter of embed_tokens or lm_head PEFT saves with the base's
    embeddings beside it: not these.)"""
    out = {}
    for module in modules:
        n_in, n_out = module_shape(base, module)
        for layer in range(base.num_hidden_layers):
            name = f"base_model.model.{module_name(layer, module)}"
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = (
                ("F32", (rank, n_in)),
                ("F32", (n_out, rank)),
            )
    return out


def module_name(layer: int, module: str) -> str:
    """The module's name inside the HF model, as PEFT matches target_modules against it."""
    if module in MODEL_MODULES:
        return MODEL_MODULES[module]
    return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
