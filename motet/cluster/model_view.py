"""What the API needs to know of the model when no engine runs in its process: the tokenizer (chat templates,
routing, decoding token ids), the engine's configuration, the model's configuration (adapter validation)
and the context length, all read from the model's files without loading its weights."""

from __future__ import annotations

import functools
from pathlib import Path

from motet.engine.config import EngineConfig, context_length
from motet.engine.tokenizer import Tokenizer, load_tokenizer
from motet.engine.weights.checkpoint import load_model_config
from motet.models.config import ModelConfig


class ModelView:
    def __init__(self, config: EngineConfig, model_dir: Path):
        self.config = config
        self.model_dir = model_dir
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.max_model_len = context_length(self.model_config, config.max_model_len)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.model_dir)
