"""The motet cache's root directory: the default model (motet/engine/weights/model_store.py), the config derived
from GGUF files, the prepared weights, the native kernels and the tokenizer classes picked for model directories
(motet/engine/tokenizer.py) live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | Path | None = None) -> Path:
    """The motet cache root: `override`, else $MOTET_CACHE_DIR, else ~/.cache/motet."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("MOTET_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "motet"
