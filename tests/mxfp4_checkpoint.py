"""MXFP4 checkpoints as OpenAI's gpt-oss ones are stored (an independent reading of the OCP Microscaling spec
v1.0), written from a float checkpoint: for tests and benchmarks that need experts in MXFP4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# An independent reading of the OCP Microscaling spec (v1.0): FP4 E2M1 elements by their 4-bit code, a block of
# 32 sharing one E8M0 scale 2^(byte - 127), the scale's exponent floor(log2(max |x|)) - 2 (E2M1's largest
# exponent), elements rounded to the nearest FP4 value (saturating at 6); two codes a byte, the first element
# in the low nibble (transformers' layout for gpt-oss).
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] floats (C a multiple of 32) -> blocks [..., R, C / 32, 16] uint8, scales [..., R, C / 32]."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-120)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent).unsqueeze(-1)).clamp(-6, 6)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1)  # the nearest value (+0 before -0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = FP4[codes].flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def save_mxfp4(model_dir: Path, out_dir: Path, drop: str | None = None, change: dict | None = None):
    """`model_dir`'s checkpoint with its experts in MXFP4, as OpenAI's are stored: each expert's gate_up
    [2I, H] and down [H, I] (inputs last, gate/up rows interleaved) as `*_blocks` and `*_scales`; biases as they
    are. `drop`: a tensor left out; `change`: tensors replaced."""
    shutil.copytree(model_dir, out_dir)
    weights = load_file(model_dir / "model.safetensors")
    out = {}
    for name, t in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = [quantize_mxfp4(e.t().contiguous()) for e in t]  # an expert at a time (memory)
            out[f"{name}_blocks"] = torch.stack([b for b, _ in parts])
            out[f"{name}_scales"] = torch.stack([s for _, s in parts])
        else:
            out[name] = t
    out.update({k: v.contiguous() for k, v in (change or {}).items()})
    out.pop(drop, None)
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": MXFP4_CONFIG}))
    return out_dir
