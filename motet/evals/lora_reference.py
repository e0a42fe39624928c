"""Random LoRA adapters in PEFT's format, and the HF + PEFT model holding several: what the LoRA benches, suites
and checks run motet's adapters against (one place for PEFT's names and the factors' scale)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from motet.lora.peft_format import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_name, module_shape
from motet.models.config import ModelConfig


def random_lora_factors(
    base: ModelConfig,
    modules: Iterable[str],
    rank: int,
    seed: int,
    *,
    b_std: float,
    a_std: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random A [rank, in] and B [out, rank] for `modules` of every decoder layer, under PEFT's tensor names.
    A's entries have std `a_std` (default 1/sqrt(in), so x @ A^T keeps x's scale), B's `b_std` (small keeps a
    model's output fluent but changed)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_hidden_layers):
        for m in modules:
            n_in, n_out = module_shape(base, m)
            key = f"base_model.model.{module_name(layer, m)}"
            a = torch.randn(rank, n_in, generator=g)
            tensors[f"{key}.lora_A.weight"] = a / n_in**0.5 if a_std is None else a * a_std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
    return tensors


def lora_config(rank: int, modules: Iterable[str], alpha: float | None = None) -> dict:
    """A PEFT adapter_config.json's content (lora_alpha 2 * rank unless given)."""
    alpha = 2 * rank if alpha is None else alpha
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)}


def write_random_adapter(
    path: Path,
    base: ModelConfig,
    rank: int,
    seed: int,
    *,
    modules: Iterable[str] = TARGET_MODULES,
    alpha: float | None = None,
    a_std: float | None = None,
    b_std: float = 0.01,
) -> Path:
    """A PEFT-format adapter directory with random factors (`random_lora_factors`), all seven modules unless
    told; returns `path`."""
    from safetensors.torch import save_file

    modules = list(modules)
    path.mkdir(parents=True, exist_ok=True)
    save_file(random_lora_factors(base, modules, rank, seed, a_std=a_std, b_std=b_std), path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(lora_config(rank, modules, alpha)))
    return path


def peft_model(base_model, adapters: Mapping[str, Path]):
    """`base_model` (an HF model) as one PeftModel holding every adapter of `adapters` (name -> directory), the
    first one active; `base_model` itself when there are none."""
    from peft import PeftModel

    model = None
    for name, path in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(base_model, str(path), adapter_name=name)
        else:
            model.load_adapter(str(path), adapter_name=name)
    return base_model if model is None else model
