"""Reading a local Hugging Face Llama-family checkpoint (Llama, Mistral, Qwen2, SmolLM): config and weights.

Only safetensors are read: a single `model.safetensors`, or shards listed in
`model.safetensors.index.json`. Pickle checkpoints (`pytorch_model.bin`, `*.pt`, ...) are refused,
since unpickling can run arbitrary code. Names and shapes are checked by the model loader, not here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from motet.engine.config import ModelConfig, ModelLoadError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# Buffers some old checkpoints saved; they are derived from the config, never weights.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory; generation_config.json's eos ids win over config.json's."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return cfg
    try:
        gen = json.loads(gen_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{gen_file}: not valid JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ModelLoadError(f"{gen_file}: expected a JSON object")
    changes = {}
    eos = gen.get("eos_token_id")
    if eos is not None:
        try:
            changes["eos_token_ids"] = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        except (TypeError, ValueError):
            raise ModelLoadError(
                f"{gen_file}: eos_token_id must be an int or a list of ints, got {eos!r}"
            ) from None
    if cfg.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
        changes["bos_token_id"] = gen["bos_token_id"]
    return dataclasses.replace(cfg, **changes) if changes else cfg


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights, all present; ModelLoadError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        if not shards:
            raise ModelLoadError(f"{index}: weight_map lists no shards")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} lists shard(s) that are missing from {path}: {', '.join(missing)}; "
                f"copy the complete checkpoint"
            )
        return [path / s for s in shards]
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    loose = sorted(path.glob("model*.safetensors"))
    if loose:
        return loose
    pickles = sorted(p.name for pat in _PICKLE_PATTERNS for p in path.glob(pat))
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoint files ({', '.join(pickles[:3])}); motet does not load "
            f"pickle checkpoints for safety (unpickling can run code). Convert them to safetensors, e.g. "
            f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)` with transformers"
        )
    raise ModelLoadError(
        f"{path}: no model weights found (expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX})"
    )


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of the checkpoint, on the CPU in the stored dtype.

    All files are located (and a missing shard reported) before the first tensor is yielded.
    """
    from safetensors import SafetensorError, safe_open

    seen: set[str] = set()
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open is not a dict
                    if name in seen:
                        raise ModelLoadError(f"{file}: tensor {name!r} appears in more than one shard")
                    seen.add(name)
                    if name.endswith(_DERIVED_SUFFIXES):
                        continue
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None


def load_state_dict(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All weights of a checkpoint, floating-point ones cast to `dtype`, on `device`.

    A tied checkpoint (tie_word_embeddings) without `lm_head.weight` stays without it: the model ties.
    """
    device = torch.device(device)
    state = {}
    for name, t in iter_weights(path):
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return state
