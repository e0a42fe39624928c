"""A GGUF tensor's Hugging Face name in its family's checkpoints (motet/models/: each declaration's `gguf_names`
beside Llama's), and what llama.cpp's converter did to its values on the way: q/k rows interleaved for its
rotary (llama, granite), norm weights offset (Gemma's 1 + w). A mixture of experts' stacked tensors
(ffn_gate_exps [E, I, H], ...; older files' one tensor an expert, ffn_gate.E) name each expert's projection
through `EXPERT` in their Hugging Face name; LongRoPE's factors (rope_factors_long / _short) are the config's,
not weights (`CONFIG_TENSORS`). A family may name a GGUF tensor with its suffix (attn_sinks.weight: GPT-OSS's
self_attn.sinks, which has none), and two GGUF tensors one Hugging Face tensor the converter split (`JOINS`:
GPT-OSS's experts' gate / up biases, and those an attention's declaration joins: motet/models/attention.py's
`gguf_joins`), joined back by `join`."""

from __future__ import annotations

import re

import torch

from motet.models import DECLARATIONS, Architecture
from motet.models.declaration import ModelLoadError

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

EXPERT = "{e}"  # in a stacked tensor's Hugging Face name: the place of its expert's number

BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q / k norms
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # a mixture of experts (Qwen-MoE's names; Mixtral's in its declaration): the router, the stacked experts,
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

# LongRoPE's factors, one per rotated pair (Phi-3's converter writes them as tensors): read into the config
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ONE_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")  # older MoE files


def hf_name(gguf_name: str, decl: Architecture) -> str:
    """A GGUF tensor's Hugging Face name in the checkpoints of `decl`'s family; a stacked experts tensor's with
    `EXPERT` where each expert's number goes."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    module = None
    if (m := _BLOCK_RE.match(gguf_name)) and (whole := decl.gguf_names.get(f"{m.group(2)}.{m.group(3)}")):
        return f"model.layers.{m.group(1)}.{whole}"  # (the family's name with its own suffix, or none)
    if m := _ONE_EXPERT_RE.match(gguf_name):  # one expert's projection: the stacked tensor's name, for it
        stacked = f"{m.group(2)}_exps"
        module = (decl.gguf_names.get(stacked) or BLOCK_NAMES[stacked]).replace(EXPERT, m.group(3))
        suffix = "weight"
    elif m := _BLOCK_RE.match(gguf_name):
        module = decl.gguf_names.get(m.group(2)) or BLOCK_NAMES.get(m.group(2))
        suffix = m.group(3)
    if module:
        return f"model.layers.{m.group(1)}.{module}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face {decl.name} counterpart")


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gate_up bias [E, 2I] from the converter's gate and up halves [E, I]: columns alternating."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


# A Hugging Face tensor (its name's end) llama.cpp's converter writes as two GGUF tensors -> how their values
# join back, in the order of the GGUF names the family maps to it (motet/models/: `gguf_names`); an attention's
# own by its declaration (`gguf_joins`)
JOINS = {"mlp.experts.gate_up_proj_bias": _interleaved} | {
    end: f for decl in DECLARATIONS for end, f in decl.attention.gguf_joins.items()
}


def join(name: str, parts: dict[str, torch.Tensor], decl: Architecture) -> torch.Tensor:
    """The Hugging Face tensor `name` (one of `JOINS`) from its GGUF parts by their GGUF names, in the order of
    the family's names for them (gate before up, k before v); ModelLoadError where one is missing."""
    order = {key: i for i, key in enumerate(decl.gguf_names)}
    keys = sorted(parts, key=lambda n: order.get(n.split(".", 2)[-1], len(order)))
    want = sum(1 for key, v in decl.gguf_names.items() if name.endswith(f"{v}") and "." in key)
    if len(keys) != want:
        raise ModelLoadError(f"GGUF tensors {', '.join(keys)} are only part of {name!r}: it joins {want}")
    return next(f for end, f in JOINS.items() if name.endswith(end))(*(parts[k] for k in keys))


def joined(gguf_name: str, decl: Architecture) -> bool:
    """Whether a GGUF tensor is a part of a Hugging Face tensor the converter split in two (`JOINS`: the family
    names each part with its suffix; an older file's whole tensor, under a name without one, is not)."""
    m = _BLOCK_RE.match(gguf_name)
    whole = decl.gguf_names.get(f"{m.group(2)}.{m.group(3)}") if m else None
    return whole is not None and whole.endswith(tuple(JOINS))


def expert_names(name: str, experts: int) -> list[str]:
    """The Hugging Face names of a stacked tensor's experts (its name by `hf_name`), in order."""
    return [name.replace(EXPERT, str(e)) for e in range(experts)]


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of q_proj/k_proj rows.

    llama.cpp stores each head's rows with the two rotary halves interleaved (pairs (i, i + d/2) next
    to each other, for GPT-J-style rope); Hugging Face keeps the halves apart (rotate_half). The GGUF
    layout is `hf.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`, so the inverse swaps back.
    """
    rows = weight.shape[0]
    head_dim = rows // n_head
    w = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def norm_offset(name: str, decl: Architecture) -> float:
    """What llama.cpp's converter added to a tensor (by its Hugging Face name): the family's norm weight offset
    to each norm weight (Gemma's RMSNorm multiplies by 1 + w; llama.cpp's by the weight as stored)."""
    return decl.norm_weight_offset if name.endswith("norm.weight") else 0.0
