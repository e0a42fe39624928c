"""Shared fixtures. The real default model is pulled once per machine (cached under ~/.cache/motet)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from engine.model_store import pull

    return pull(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
