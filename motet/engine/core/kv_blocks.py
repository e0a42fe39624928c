"""KV blocks as data: the layout of one block, copies between the paged KV cache and host tensors, and the
identity of what a block's values depend on (the model's weights, the KV dtype and layout).

The paged cache is a list of per-layer tuples of tensors, one [num_blocks, block_size, heads, width] per part of the
attention's cache layout (ModelConfig.cache_layout, motet/models/attention.py: per-head attention's K and V, each
[num_blocks, block_size, kv_heads, head_dim]; motet/engine/worker/model_runner.py allocates them). A block off the
device is one host tensor shaped [layers, parts, block_size, heads, width]. `read_blocks` and `write_blocks` move a
set of blocks at once, one gather or scatter per layer: under tensor parallelism each rank holds its shard of the
KV heads (or all of a replicated layout), and a rank runs these same two functions on its own `kv_caches` (the
layout's `kv_heads` being its shard's).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# What an entry's bytes mean: bump when the block layout or the entry format changes, so that entries written
# by an older motet are never read as this one's.
KV_FORMAT_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_SAMPLES = 16  # chunks of a weights file read for its identity, evenly spaced
_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class KVLayout:
    """A block's layout, as the cache tensors give it: `num_parts` tensors a layer (the parts of the attention's
    cache layout: 2, K and V), each [block_size, num_kv_heads, head_dim], heads and width alike in every part."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_parts: int = 2

    @classmethod
    def of(cls, kv_caches) -> KVLayout:
        _, block_size, heads, head_dim = kv_caches[0][0].shape
        return cls(len(kv_caches), block_size, heads, head_dim, kv_caches[0][0].dtype, len(kv_caches[0]))

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_parts, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.element_size

    def describe(self) -> dict:
        return {
            "layers": self.num_layers,
            "block_size": self.block_size,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            **(
                {} if self.num_parts == 2 else {"parts": self.num_parts}
            ),  # (K / V layouts' identities unchanged)
        }


def read_blocks(kv_caches, block_ids: list[int]) -> torch.Tensor:
    """The blocks' KV as one host tensor [len(block_ids), *layout.block_shape] (a copy)."""
    layout = KVLayout.of(kv_caches)
    device = kv_caches[0][0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    out = torch.empty((len(block_ids), *layout.block_shape), dtype=layout.dtype)
    for layer, parts in enumerate(kv_caches):
        for i, part in enumerate(parts):
            out[:, layer, i] = part.index_select(0, ids)
    return out


def write_blocks(kv_caches, block_ids: list[int], data: torch.Tensor) -> None:
    """Copy `data` ([len(block_ids), *layout.block_shape], as read_blocks returns) into the blocks. The
    blocks must belong to no running sequence (the forward pass never reads them meanwhile)."""
    device = kv_caches[0][0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = data.to(device)  # blocking: the caller reuses `data`'s memory next
    for layer, parts in enumerate(kv_caches):
        for i, part in enumerate(parts):
            part.index_copy_(0, ids, data[:, layer, i])


def model_identity(model_dir: str | Path, quantization: str | None, layout: KVLayout) -> str:
    """A digest of everything a KV block's values depend on: the model's config and weights (each weights
    file's name, size and evenly spaced samples of its bytes: another checkpoint, a fine-tune of the same
    shape included, differs in them), the quantization, and the KV dtype and layout. Entries stored under one
    identity are never read under another."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([KV_FORMAT_VERSION, quantization, layout.describe()]).encode())
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(0, size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()
