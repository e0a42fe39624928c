"""The error of a pull: the default model's download or a GGUF file's conversion failed (motet/engine/weights/
model_store.py, gguf_convert.py); its message says what to check. A module of its own, light, for both."""

from __future__ import annotations

from motet.models.declaration import ModelLoadError


class PullError(ModelLoadError):
    """`pull()` could not fetch or convert the default model; the message says what to check."""
