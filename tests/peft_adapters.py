"""Random PEFT LoRA adapters for the tests, and PEFT's own output with them: the reference the engine's adapters
are held to. lora_B is drawn non-zero everywhere (PEFT inits it to zero: a no-op delta would prove nothing)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from motet.engine.llm import LLM
from motet.lora.adapter import TARGET_MODULES

# (name, rank, target modules): every fused shard alone and together, and every rank bucket.
ADAPTERS = [
    ("qv4", 4, ["q_proj", "v_proj"]),
    ("all8", 8, list(TARGET_MODULES)),
    ("kod16", 16, ["k_proj", "o_proj", "down_proj"]),
    ("gu64", 64, ["gate_proj", "up_proj"]),
]


def save_peft_adapters(model_dir, out_dir, specs, std: float, seed: int = 0) -> PeftModel:
    """Save random PEFT adapters (non-zero A and B) under out_dir/<name>; returns the PeftModel holding all."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model = None
    for name, r, targets in specs:
        cfg = LoraConfig(r=r, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        for pname, p in model.named_parameters():
            if f"lora_A.{name}." in pname:  # N(0, 1/in): the shrink keeps the activations' scale
                p.data = torch.randn_like(p) / p.shape[1] ** 0.5
            elif f"lora_B.{name}." in pname:  # PEFT inits B to zero: a no-op delta would prove nothing
                p.data = torch.randn_like(p) * std
            elif pname.endswith(f"lora_embedding_A.{name}"):  # PEFT inits the embedding's A to zero
                p.data = torch.randn_like(p)
            elif pname.endswith(f"lora_embedding_B.{name}"):
                p.data = torch.randn_like(p) * std
        model.save_pretrained(out_dir, selected_adapters=[name])
        # PEFT puts every adapter but "default" in a subfolder named after it
        assert (out_dir / name / "adapter_model.safetensors").is_file()
    return model.eval()


def peft_reference(model: PeftModel, adapter: str | None, prompt: list[int], new_tokens: int):
    """(prompt + greedy continuation, its logits) from PEFT with one adapter active, or none.

    min_new_tokens masks EOS as the engine's min_tokens does, so both generate exactly `new_tokens`."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), model.disable_adapter() if adapter is None else contextlib.nullcontext():
        if adapter is not None:
            model.set_adapter(adapter)
        if new_tokens:
            ids = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return ids[0].tolist(), model(ids).logits[0]


def peft_teacher_forced(model: PeftModel, adapter: str | None, prompt: list[int], continuation: list[int],
                        no_eos: list[int] = ()) -> torch.Tensor:  # fmt: skip
    """PEFT's logits over prompt + `continuation` (one adapter active, or none), after checking that the
    continuation is PEFT's greedy one: each token the argmax of the logits before it (a tie within 1e-4 may go
    either way), the ids `no_eos` masked as min_new_tokens masks them. One forward where generate takes one a
    token: the same verdict on the real model in a fraction of the time."""
    logits = peft_reference(model, adapter, prompt + continuation, 0)[1]
    chosen = logits[len(prompt) - 1 : -1].clone()
    chosen[:, list(no_eos)] = float("-inf")
    picked = chosen.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    assert (picked >= chosen.max(-1).values - 1e-4).all(), (adapter, continuation)
    return logits


# -- the tiny random model's adapters (the `tiny_loras` fixture in tests/conftest.py) and requests

TINY_ADAPTERS = [(n, min(r, 32), t) for n, r, t in ADAPTERS]  # rank 32 caps the tiny model's slots


def tiny_llm(model_dir, paths, **options) -> LLM:
    llm = LLM(str(model_dir), num_kv_blocks=256, block_size=8, max_lora_rank=32, **options)
    for name, path in paths.items():
        llm.add_lora(name, path)
    return llm


# Each request: (prompt, adapter name or None). One adapter in several sequences, base rows between.
def tiny_requests():
    prompts = [
        [(i * 7 + j * 13) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 17, 40, 9, 33, 3, 26, 12))
    ]
    names = ["qv4", None, "all8", "qv4", "kod16", None, "gu64", "all8"]
    return prompts, names


def make_adapter(model_dir, out, seed: int):
    """A random rank-4 PEFT LoRA on q_proj / v_proj of the model in model_dir, saved in out."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p) * 0.2
    model.save_pretrained(out)
    return out


def strong_adapter(base, out: Path, seed: int) -> Path:
    """A random rank-8 PEFT LoRA on q_proj / v_proj / o_proj of a loaded model, saved in out; lora_B is non-zero
    (PEFT inits it to zero) so that it changes the output."""
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"])
    model = get_peft_model(copy.deepcopy(base), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn_like(p) * 0.2  # strong enough to change 8 greedy tokens
    model.save_pretrained(out)
    return out
