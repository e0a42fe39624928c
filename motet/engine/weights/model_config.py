"""A checkpoint's ModelConfig: its config.json read through its family's declaration (motet/models/), with the ids
that end an answer from generation_config.json or the tokenizer. Plain JSON, read before any weight (and, but for
a checkpoint whose configs name no eos id, before torch or transformers is imported: `motet serve` checks the
model before it binds its port)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from motet.models.config import ModelConfig, read_json, token_ids
from motet.models.declaration import ModelLoadError


def load_model_config(path: str | Path, tokenizer: str | Path | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint directory; generation_config.json's eos ids win over config.json's, and
    where neither names one the tokenizer's eos_token is the one (its tokenizer_config.json's, as vLLM stops at
    it; `tokenizer`: the --tokenizer directory that serves the model instead of its own). None anywhere:
    ModelLoadError naming eos_token_id and the files looked in, before the weights are read (an answer would have
    nothing to end at, and the grammars nothing to stop at)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    gen_file = path / "generation_config.json"
    changes = {}
    if gen_file.exists():
        gen = read_json(gen_file)
        if not isinstance(gen, dict):
            raise ModelLoadError(f"{gen_file}: expected a JSON object")
        eos = gen.get("eos_token_id")
        if eos is not None:
            changes["eos_token_ids"] = token_ids(eos, "eos_token_id", str(gen_file))
        if cfg.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            changes["bos_token_id"] = gen["bos_token_id"]
    if not changes.get("eos_token_ids", cfg.eos_token_ids):
        tokenizer_dir = Path(tokenizer) if tokenizer is not None else path
        from motet.engine.tokenizer import (
            load_tokenizer,  # (transformers: only where the configs name no eos)
        )

        eos = load_tokenizer(tokenizer_dir).hf.eos_token_id
        if eos is None:
            raise ModelLoadError(
                f"{path}: no eos_token_id: {path / 'config.json'} and {gen_file}"
                f"{'' if gen_file.exists() else ' (absent)'} name none, and the tokenizer's "
                f"{tokenizer_dir / 'tokenizer_config.json'} has no eos_token; add the id of the token that ends an "
                f"answer to generation_config.json's eos_token_id"
            )
        changes["eos_token_ids"] = (eos,)
    return dataclasses.replace(cfg, **changes) if changes else cfg
