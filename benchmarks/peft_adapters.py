"""Random LoRA adapters written by PEFT itself (not by motet's own writer): what a user would upload or load,
for the benchmarks that serve adapters through the HTTP API."""

from __future__ import annotations

from pathlib import Path


def random_peft_adapters(model_dir: Path, out: Path, n: int) -> list[Path]:
    """`n` PEFT LoRA adapters for the HF checkpoint `model_dir` (rank 8 on q/v, B drawn non-zero so that each
    changes the outputs), seeded 0 .. n-1, saved as `out`/adapter-{seed}; their directories."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for seed in range(n):
        torch.manual_seed(seed)
        model = get_peft_model(
            copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        )
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn_like(p) * 0.05
        model.save_pretrained(out / f"adapter-{seed}")
        paths.append(out / f"adapter-{seed}")
    return paths
