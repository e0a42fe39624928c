"""What a layer writes its ops with into the native CPU step's program (motet/engine/worker/cpu_forward.py).

Each layer class writes its own ops beside its eager forward (`write_ops`: model.py's Attention, MLP, SparseMoE and
DecoderLayer, latent_attention.py's LatentAttention), as llama.cpp's graph builders sit beside their layers: a layer
type's forward and its ops are one module (what else a new layer type takes: docs/DESIGN.md, "A layer written
once"). An `OpWriter` is what they write through: the program being written (`w`,
motet/kernels/cpu_native.ProgramWriter), the arena its packed weights go into, the tensors it points at kept alive,
and the model-wide pieces a layer reads (its config, its rotary tables, its ranks).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from motet.engine.worker.layers import Linear, RMSNorm
from motet.engine.worker.parallel import Parallel
from motet.kernels import cpu_native
from motet.kernels.quant import BLOCK
from motet.lora.pool import GROUP_OF
from motet.models.config import ModelConfig

_HUGE_PAGE = 2 << 20


class WeightArena:
    """One buffer for the packed weights, backed by transparent huge pages where the kernel allows it; or, to
    replay (`replay`), the packed weights a previous start wrote (a prepared-weights cache entry, mapped from
    its file: motet/engine/worker/prepared_weights.py), handed out again in the order they were put.

    Every weight goes in through `put(make)`, `make` a function that packs it: a replayed arena never calls it,
    so a start from the cache neither reads the checkpoint's projections nor packs them."""

    def __init__(self, nbytes: int = 0, replay: tuple[torch.Tensor, list] | None = None):
        self.puts: list[tuple[int, torch.dtype, tuple[int, ...]]] = []  # (offset, dtype, shape) of each put
        self.replay = replay is not None
        self._next = 0  # replaying: the next put's index
        if replay is not None:
            self._bytes, self.puts = replay
            self._used = self._bytes.numel()
            return
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._bytes = raw[(-raw.data_ptr()) % _HUGE_PAGE :]
        self._used = 0

    def put(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The weight `make()` packs, in the arena (64-byte aligned); replaying, the next weight put before (the
        same weight: the cache entry's key holds everything its packing depends on), `make` never called."""
        if self.replay:
            if self._next >= len(self.puts):
                raise ReplayMismatch(f"the entry holds {len(self.puts)} packed weights; the model packs more")
            offset, dtype, shape = self.puts[self._next]
            self._next += 1
            n = dtype.itemsize * math.prod(shape)
            return self._bytes[offset : offset + n].view(dtype).view(shape)
        tensor = make()
        n = tensor.numel() * tensor.element_size()
        start = -(-self._used // 64) * 64
        out = self._bytes[start : start + n].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._used = start + n
        self.puts.append((start, tensor.dtype, tuple(tensor.shape)))
        return out

    def finish(self) -> None:
        """Replaying: check that every weight the entry holds was handed out (ReplayMismatch: another model's)."""
        if self.replay and self._next != len(self.puts):
            raise ReplayMismatch(
                f"the entry holds {len(self.puts)} packed weights; the model packs {self._next}"
            )

    def written(self) -> torch.Tensor:
        """The packed weights' bytes (uint8), in the order they were put."""
        return self._bytes[: self._used]


class ReplayMismatch(RuntimeError):
    """A replayed arena's weights do not fit the model's ops (a cache entry of another model)."""


def panel_bytes(rows: int, cols: int, elem: int, quantized: str | None = None) -> int:
    """Bytes of a [rows, cols] weight packed for the native GEMM: panels of 16 rows, in the model's dtype (`elem`
    bytes an element) or, `quantized`, in that format's block records per panel."""
    panels = -(-rows // cpu_native.PANEL)
    if quantized is not None:
        return panels * (cols // BLOCK) * cpu_native.QUANT_RECORD[quantized]
    return panels * cpu_native.PANEL * cols * elem


def packed_bytes(lin: Linear, elem: int) -> int:
    """Bytes of a linear layer's packed weight, in its own format."""
    if lin.quantized is not None:
        return panel_bytes(*lin.quantized.shape, elem, lin.quantized.format.name)
    return panel_bytes(*lin.weight.shape, elem)


class OpWriter:
    """The program a model's layers write their ops into, and what they write them with."""

    def __init__(
        self,
        w: cpu_native.ProgramWriter,
        arena: WeightArena,
        weight_dtype: torch.dtype,
        config: ModelConfig,
        rope,
        local_rope,
        parallel: Parallel,
    ):
        self.w, self.arena, self.weight_dtype = w, arena, weight_dtype
        self.config, self.parallel = config, parallel
        self._rope, self._local_rope = rope, local_rope  # (the model's RotaryEmbedding tables)
        self.keep: list[torch.Tensor] = []  # everything the program points at

    def rope(self, layer: int):
        """Layer `layer`'s rotary table: a sliding layer's own where the model has one (Gemma 3's local base)."""
        if layer in self.config.sliding_layers and self._local_rope is not None:
            return self._local_rope
        return self._rope

    def ptr(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> int | None:
        """The address of `t` (in `dtype`, contiguous), kept alive with the program; None for None."""
        if t is None:
            return None
        t = t.detach().to(dtype or t.dtype).contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def release(self, lin: Linear) -> None:
        """Drop a layer's own copy of its weight (the arena holds it now)."""
        lin.weight = torch.nn.Parameter(torch.empty(0, dtype=self.weight_dtype), requires_grad=False)
        lin.packed_weight = lin.quantized = None

    def packed(self, lin: Linear) -> tuple[int, int]:
        """The layer's weight in the arena, in its own format (the model's dtype or a quantized one): (address,
        format code). The layer's own copy is released."""
        if lin.quantized is not None:
            quantized = lin.quantized
            data = self.arena.put(lambda: cpu_native.pack_quantized(quantized))
            code = cpu_native.QUANT_CODES[quantized.format.name]
        else:
            weight = lin.weight.detach()
            data = self.arena.put(lambda: cpu_native.pack(weight))
            code = cpu_native.DTYPE_CODES[self.weight_dtype]
        self.release(lin)
        return data.data_ptr(), code

    def linear(self, lin: Linear, src: str, dst: str, layer: int = -1, lora: tuple[str, ...] | None = None,
               sizes=(), accumulate: bool = False) -> None:  # fmt: skip
        """A linear layer (its bias in the model's dtype, whatever the weight's format), with the layer's LoRA
        deltas of the module group `lora` where adapters may target it."""
        bias = self.ptr(lin.bias, self.weight_dtype)
        k, n = lin.in_features, lin.out_features
        weight, code = self.packed(lin)
        group = GROUP_OF[lora] if lora is not None else -1
        self.w.linear(src, dst, weight, code, k, n, bias, accumulate, layer, group, sizes)

    def norm(self, module: RMSNorm | None, src: str = "x", dst: str = "h") -> str:
        """What a block reads: `src` normed by `module` into `dst`, or `src` itself where there is no norm."""
        if module is None:
            return src
        self.w.rms_norm(src, dst, self.ptr(module.weight), module.eps, self.config.hidden_size)
        return dst

    def joins(self, post: RMSNorm | None) -> None:
        """A block's output ("out") joins the stream, normed first by `post`, a norm after the block, where given."""
        self.w.add_residual(
            "out", self.config.hidden_size, self.ptr(post.weight) if post else None, post.eps if post else 0.0
        )
