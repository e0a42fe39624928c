"""Shared fixtures. The real default model is pulled once per machine (cached under ~/.cache/motet)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU machines; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir():
    from motet.engine.model_store import pull

    if os.environ.get("MOTET_MODEL_DIR"):  # a checkpoint staged elsewhere (scripts/gpu/run.sh)
        from pathlib import Path

        return Path(os.environ["MOTET_MODEL_DIR"])
    return pull(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
