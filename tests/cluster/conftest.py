"""What the cluster's tests share."""

from __future__ import annotations

import pytest

from tests.peft_adapters import strong_adapter


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A random PEFT LoRA on the tiny model, served by the replicas and by the offline reference engine."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return strong_adapter(base, tmp_path_factory.mktemp("cluster-adapter") / "a", seed=3)
