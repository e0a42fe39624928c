"""The registry of model declarations (motet/models/declaration.py): one short module per family."""

from __future__ import annotations

from motet.models.declaration import Architecture, ModelLoadError
from motet.models.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from motet.models.gemma2 import GEMMA2
from motet.models.gemma3 import GEMMA3
from motet.models.gpt_oss import GPT_OSS
from motet.models.granite import GRANITE
from motet.models.llama import LLAMA
from motet.models.mixtral import MIXTRAL
from motet.models.olmo2 import OLMO2
from motet.models.phi3 import PHI3
from motet.models.qwen2 import QWEN2
from motet.models.qwen3 import QWEN3
from motet.models.qwen_moe import QWEN2_MOE, QWEN3_MOE

DECLARATIONS: tuple[Architecture, ...] = (
    LLAMA,
    QWEN2,
    QWEN3,
    PHI3,
    GRANITE,
    OLMO2,
    GEMMA2,
    GEMMA3,
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
    GPT_OSS,
    DEEPSEEK_V2,
    DEEPSEEK_V3,
)
_BY_NAME = {name: decl for decl in DECLARATIONS for name in decl.names}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_NAME)
# Every declared attention's own projections (AttentionShape.own_projections), in declaration order: the LoRA
# pool's groups after the shared four, and modules a LoRA adapter may name
OWN_PROJECTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(m for d in DECLARATIONS for m in d.attention.own_projections)
)
# The GGUF files' `general.architecture` values the families read (llama.cpp's names), each once: llama.cpp writes
# Mixtral as "llama" too (from_gguf tells them apart by their experts).
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(d.gguf for d in DECLARATIONS if d.gguf))


def find(names) -> Architecture | None:
    """The declaration of the first of config.json's `architectures` that motet serves."""
    return next((_BY_NAME[n] for n in names if n in _BY_NAME), None)


def get(name: str) -> Architecture:
    return _BY_NAME[name]


def fused_modules(architecture: str | None) -> dict[str, tuple[str, ...]]:
    """The checkpoint modules that hold several projections, for an architecture name (none when unknown)."""
    decl = _BY_NAME.get(architecture) if architecture is not None else None
    return decl.fused_modules if decl is not None else {}


def from_gguf(gguf_architecture: str, experts: bool = False) -> Architecture | None:
    """The declaration of a GGUF file's `general.architecture`: of a mixture of experts where the file has experts
    (llama.cpp writes Mixtral as "llama"), of a dense model where it has none, else the only one."""
    found = [d for d in DECLARATIONS if d.gguf == gguf_architecture]
    return next((d for d in found if (d.experts is not None) == experts), found[0] if found else None)


__all__ = [
    "OWN_PROJECTIONS",
    "DECLARATIONS",
    "GGUF_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "ModelLoadError",
    "find",
    "from_gguf",
    "get",
]
