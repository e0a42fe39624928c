"""The native CPU step's weights kept ready across starts (the prepared-weights cache: its files, keys and bound in
motet/engine/weights/prepared_store.py).

A start that misses reads the checkpoint as always (motet/engine/worker/decoder_weights.py: a GGUF file's blocks
requantized where motet's kernels need int8), packs the projections into the native GEMM's panels
(motet/engine/worker/cpu_forward.py), and then writes what the step reads into an entry: the packed weights as one
run of bytes with where each weight begins (`WeightArena.puts`), every other tensor the model still holds (norms,
biases, an untied float embedding table), and the layout a later start needs to rebuild the model around them:
which projections are in which block format, which were packed, and where the embedding table is read (the packed
lm_head's panels, a GGUF file's own blocks, or a tensor of the entry). A start that hits builds the model on the
meta device (`CausalLM.on_meta`), its tensors mapped from the entry's file, and replays the packing (the
layers write their ops as always; `WeightArena.put` hands back each packed weight instead of packing it): it
reads no checkpoint, requantizes and packs nothing.

The entry's key holds the model's files (config.json and the weight files, or the GGUF file), the dtype, the
quantization, the instruction-set tier whose kernels run (cpu_isa), the kernels' ABI version and a digest of the
source of the packages that decide these bytes (this one, engine/weights, kernels, models): a change to any of them
makes a new entry, and an entry of another file, tier or version is never read. Tensor parallelism, the eager step
and CUDA do not use the cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from motet.engine.config import GGUF_QUANTIZATION, EngineConfig
from motet.engine.weights.checkpoint import weight_files
from motet.engine.weights.gguf_table import GgufTable
from motet.engine.weights.gguf_weights import gguf_file
from motet.engine.weights.prepared_store import Entry, PreparedStore, entry_key, file_identity
from motet.engine.worker.cpu_forward import CpuForward, PackedTable
from motet.engine.worker.layers import Linear
from motet.engine.worker.model import CausalLM, Experts, QuantizedExperts
from motet.engine.worker.op_writer import WeightArena
from motet.engine.worker.parallel import SINGLE, Parallel
from motet.kernels import cpu_native
from motet.kernels.quant import FORMATS, MXFP4, QuantizedWeight, WeightFormat
from motet.models.config import ModelConfig

log = logging.getLogger("motet.engine")

ARENA = "arena"  # the entry's tensor of the packed weights
_PACKAGES = ("engine/worker", "engine/weights", "kernels", "models")  # whose source decides an entry's bytes
_FORMATS = {**FORMATS, MXFP4.name: MXFP4}
_QUANT_CONFIGS = ("quantize_config.json", "quant_config.json")  # besides config.json's quantization_config


@functools.cache
def code_digest() -> str:
    """A sha256 of the source of the packages whose code decides what an entry holds (_PACKAGES)."""
    root = Path(__file__).resolve().parents[2]  # motet/
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for f in sorted((root / package).rglob("*.py")):
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def applies(config: EngineConfig, device: torch.device, parallel: Parallel) -> bool:
    """Whether this start reads and writes the cache: the native CPU step runs (compiled, on a CPU, its kernels
    built), on one rank, with the cache on (`EngineConfig.weights_cache_gb`)."""
    return (
        config.weights_cache_gb > 0
        and config.compile_step
        and device.type == "cpu"
        and not parallel.enabled
        and cpu_native.library() is not None
    )


def source_files(model_dir: str | Path, quantization: str | None) -> list[Path]:
    """The files whose contents make the model's weights: config.json (and a quantization config), the GGUF file
    (`--quantization gguf`) or the checkpoint's weight files."""
    d = Path(model_dir)
    files = [d / name for name in ("config.json", *_QUANT_CONFIGS) if (d / name).is_file()]
    return files + ([gguf_file(d)] if quantization == GGUF_QUANTIZATION else weight_files(d))


def entry_of(
    model_dir: str | Path, quantization: str | None, dtype: torch.dtype
) -> tuple[list[dict], dict, str]:
    """The source files' identities, the settings and the key of the entry a start of `model_dir` with
    `quantization` in `dtype` reads and writes (a fine-tuning job's worker finds the served weights by it:
    motet/training/shared_base.py)."""
    source = [file_identity(f) for f in source_files(model_dir, quantization)]
    settings = {
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": quantization,
        "isa": cpu_native.isa(),
        "abi": cpu_native.ABI_VERSION,
        "code": code_digest(),
    }
    return source, settings, entry_key(source, settings)


def quantized_formats(model: CausalLM) -> dict[str, dict[str, str]]:
    """The block format of each projection and stacked experts' weight held quantized, by module name (read before
    the packing releases them): a restored model's layers are told their formats (`_stub`)."""
    linears = {
        n: m.quantized.format.name for n, m in model.named_modules() if isinstance(m, Linear) and m.quantized
    }
    experts = {
        f"{n}.{key}": q.weight.format.name
        for n, m in model.named_modules()
        if isinstance(m, Experts)
        for key, q in m.quantized.items()
    }
    return {"linears": linears, "experts": experts}


class PreparedWeights:
    """This start's entry: looked up at once (`hit`), then either the model rebuilt from it (`model`, `arena`)
    or, on a miss, written once the native step has packed the weights (`save`)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, dtype: torch.dtype):
        self.store = PreparedStore(max_bytes=int(config.weights_cache_gb * 2**30))
        self.source, self.settings, self.key = entry_of(model_dir, config.quantization, dtype)
        files = source_files(model_dir, config.quantization)
        name = files[-1].resolve().stem if files[-1].suffix == ".gguf" else Path(model_dir).name
        self.label = f"{name}-{self.settings['dtype']}"
        self.entry: Entry | None = self.store.open(self.key)

    @property
    def hit(self) -> bool:
        return self.entry is not None

    def discard(self, why: str) -> None:
        """Forget the entry (it does not fit this model: removed, to be written again by this start)."""
        if self.entry is not None:
            log.warning("prepared weights %s: %s; removed, to be prepared again", self.entry.path.name, why)
            self.store.remove(self.key)
            self.entry = None

    def model(self, cfg: ModelConfig, max_positions: int | None, device: torch.device) -> CausalLM | None:
        """The model rebuilt from the entry: the packed projections left on the meta device (with their formats),
        every other tensor mapped from the entry's file. None (the entry discarded) where they do not fit it."""
        if self.entry is None:
            return None
        t0 = time.perf_counter()
        try:
            model = self._restore(cfg, max_positions, device)
        except (
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            RuntimeError,
        ) as e:  # (an index of another shape)
            self.discard(f"it does not fit the model ({type(e).__name__}: {e})")
            return None
        if model is not None:
            log.info(
                "prepared weights: the model mapped from %s in %.2f s",
                self.entry.path,
                time.perf_counter() - t0,
            )
        return model

    def _restore(self, cfg: ModelConfig, max_positions: int | None, device: torch.device) -> CausalLM | None:
        entry = self.entry
        layout = entry.layout
        model = CausalLM.on_meta(cfg, max_positions, SINGLE, device)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name in entry.names():
            if name == ARENA:
                continue
            if name not in params:
                self.discard(f"its tensor {name} has no place in the model")
                return None
            module, _, key = name.rpartition(".")
            model.get_submodule(module)._parameters[key] = nn.Parameter(
                entry.tensor(name), requires_grad=False
            )
        for name, fmt in layout["quantized"]["linears"].items():
            lin = model.get_submodule(name)
            lin.quantized = _stub(_FORMATS[fmt], lin.out_features, lin.in_features)
        for name, fmt in layout["quantized"]["experts"].items():
            module, _, key = name.rpartition(".")
            experts = model.get_submodule(module)
            E, N, K = getattr(experts, key).shape
            experts.quantized[key] = QuantizedExperts(_stub(_FORMATS[fmt], E * N, K), E)
        table = layout["table"]
        if table["kind"] == "gguf":
            model.embed_tokens = GgufTable.from_description(table["gguf"], model.weight_dtype)
        packed = set(layout["packed"])
        if table["kind"] == "head":  # (looked up in the packed lm_head: `CpuForward` replaces it)
            packed.add("embed_tokens.weight")
        missing = [
            n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta and n not in packed
        ]
        if missing:
            self.discard(f"it holds no {missing[0]}")
            return None
        return model.eval().requires_grad_(False)

    def arena(self) -> WeightArena:
        """The entry's packed weights, to replay (`CpuForward`'s arena)."""
        puts = [(o, getattr(torch, d), tuple(s)) for o, d, s in self.entry.layout["puts"]]
        return WeightArena(replay=(self.entry.tensor(ARENA), puts))

    @property
    def table_from_head(self) -> bool:
        return self.entry.layout["table"]["kind"] == "head"

    def save(self, model: CausalLM, forward: CpuForward, formats: dict) -> None:
        """Write the entry of a model the native step has just packed (`formats`: `quantized_formats`, read before
        the packing). A failure to write (a full disk) is logged; the start goes on."""
        t0 = time.perf_counter()
        writer = None
        try:
            writer = self.store.writer(self.key, self.label, self.source, self.settings)
            writer.add(ARENA, forward.arena.written())
            packed, seen = [], set()
            for name, p in model.named_parameters(remove_duplicate=False):
                if p.is_meta or p.numel() == 0:
                    packed.append(name)
                elif id(p) not in seen:
                    seen.add(id(p))
                    writer.add(name, p)
            table = model.embed_tokens
            kind = (
                "head"
                if isinstance(table, PackedTable)
                else "gguf"
                if isinstance(table, GgufTable)
                else "tensor"
            )
            layout = {
                "puts": [[o, str(d).removeprefix("torch."), list(s)] for o, d, s in forward.arena.puts],
                "quantized": formats,
                "packed": packed,
                "table": {"kind": kind, **({"gguf": table.describe()} if kind == "gguf" else {})},
            }
            path = writer.finish(layout)
        except OSError as e:  # (a full disk, a cache directory that cannot be written)
            if writer is not None:
                writer.abandon()
            log.warning(
                "prepared weights: could not write the cache entry (%s); the next start prepares them again",
                e,
            )
            return
        log.info(
            "prepared weights: written to %s (%.0f MiB) in %.1f s; later starts map them",
            path, writer.nbytes / 2**20, time.perf_counter() - t0,
        )  # fmt: skip


def _stub(fmt: WeightFormat, rows: int, cols: int) -> QuantizedWeight:
    """A weight's format and shape without its blocks (on the meta device): what a layer reads of a weight that a
    replayed arena holds packed."""
    values = torch.empty(
        (rows, cols * fmt.bits // 8), dtype=torch.int8 if fmt.bits == 8 else torch.uint8, device="meta"
    )
    scales = torch.empty((rows, cols // 32), dtype=fmt.scale_dtype, device="meta")
    mins = torch.empty((rows, cols // 32), dtype=torch.float16, device="meta") if fmt.has_min else None
    return QuantizedWeight(fmt, values, scales, mins)
