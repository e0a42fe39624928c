"""Reading a local Hugging Face checkpoint of a declared family (motet/models/): config and weights.

Only safetensors are read: a single `model.safetensors`, or shards listed in
`model.safetensors.index.json`. Pickle checkpoints (`pytorch_model.bin`, `*.pt`, ...) are refused,
since unpickling can run arbitrary code. Names and shapes are checked by the model loader, not here.

A tensor is yielded unread (`StoredTensor`) and read with plain file reads, a bounded run of rows at a time
(`row_chunks`): the loader converts each run into its parameter, so loading holds the weights and one run,
never a whole checkpoint tensor or mapped file pages besides them (safetensors' own reader maps the file, and
every page read stays resident until it is closed).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from motet.models.config import read_json
from motet.models.declaration import ModelLoadError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# Buffers some old checkpoints saved; they are derived from the config, never weights.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' dtype names
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
# The most a loader reads of a tensor at once (`row_chunks`): a run of whole rows, at least one.
CHUNK_BYTES = 8 << 20


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights, all present; ModelLoadError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    index = path / SAFETENSORS_INDEX
    if index.exists():
        try:
            weight_map = read_json(index)["weight_map"]
            shards = list(dict.fromkeys(weight_map.values()))
            if not all(isinstance(s, str) for s in shards):
                raise TypeError("each shard must be named by a string")
        except (KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        if not shards:
            raise ModelLoadError(f"{index}: weight_map lists no shards")
        missing = [s for s in shards if not (path / s).is_file()]  # (or not a regular file)
        if missing:
            raise ModelLoadError(
                f"{index} lists shard(s) that are missing from {path}: {', '.join(missing)}; "
                f"copy the complete checkpoint"
            )
        return [path / s for s in shards]
    # Only regular files are read: a FIFO would block the loader for ever, a directory fail deep in safetensors.
    loose = sorted(path.glob("model*.safetensors"))
    odd = [p.name for p in loose if not p.is_file()]
    if odd:
        raise ModelLoadError(
            f"{path / odd[0]}: not a regular file; a checkpoint's weights are safetensors files"
        )
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    if loose:
        return loose
    pickles = sorted(p.name for pat in _PICKLE_PATTERNS for p in path.glob(pat))
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoint files ({', '.join(pickles[:3])}); motet does not load "
            f"pickle checkpoints for safety (unpickling can run code). Convert them to safetensors, e.g. "
            f"`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)` with transformers"
        )
    raise ModelLoadError(
        f"{path}: no model weights found (expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX})"
    )


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor of a safetensors file, not read yet: rows `row_range` of the stored tensor (along dim 0; row 0 at
    `offset`), in the stored dtype, with `narrowed` (dim, start, length) applied to the other dims once read (a
    tensor-parallel rank's columns)."""

    file: Path
    offset: int  # of row 0
    dtype: torch.dtype
    stored_shape: tuple[int, ...]
    row_range: tuple[int, int] = (0, -1)  # first row, count (-1: all)
    narrowed: tuple[tuple[int, int, int], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.stored_shape)
        if shape:
            shape[0] = self._count
        for dim, _, length in self.narrowed:
            shape[dim] = length
        return tuple(shape)

    @property
    def _count(self) -> int:
        return self.row_range[1] if self.row_range[1] >= 0 else self.stored_shape[0]

    @property
    def _row_bytes(self) -> int:
        n = 1
        for d in self.stored_shape[1:]:
            n *= d
        return n * self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def narrow(self, dim: int, start: int, length: int) -> StoredTensor:
        """torch's narrow, without reading anything."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise RuntimeError(f"narrow({dim}, {start}, {length}) out of range for shape {self.shape}")
        if dim == 0:
            return dataclasses.replace(self, row_range=(self.row_range[0] + start, length))
        return dataclasses.replace(self, narrowed=(*self.narrowed, (dim, start, length)))

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of this tensor, read from the file (into `out`'s bytes where given, which must
        hold them)."""
        if not self.stored_shape:  # a scalar
            start, stop = 0, 1
        nbytes = (stop - start) * self._row_bytes
        buffer = out[:nbytes] if out is not None else torch.empty(nbytes, dtype=torch.uint8)
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.offset + (self.row_range[0] + start) * self._row_bytes)
            view, done = memoryview(buffer.numpy()), 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ModelLoadError(f"{self.file}: ends inside a tensor (truncated file?)")
                done += n
        t = buffer.view(self.dtype).view(stop - start, *self.stored_shape[1:])
        for dim, begin, length in self.narrowed:
            t = t.narrow(dim, begin, length)
        return t if self.stored_shape else t.reshape(())

    def load(self) -> torch.Tensor:
        """The whole tensor, read (a new tensor of its own)."""
        return self.read_rows(0, self._count if self.stored_shape else 1).contiguous()


def row_chunks(
    tensor: torch.Tensor | StoredTensor, max_bytes: int = CHUNK_BYTES, buffer: torch.Tensor | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) runs of `tensor` along dim 0, each of at most `max_bytes` as stored (at least one
    row): views of a torch tensor; reads of a stored one into `buffer` (uint8; a new one where it is None or too
    small), so a run is valid until the next is read."""
    if not isinstance(tensor, StoredTensor):
        if tensor.dim() == 0:
            yield 0, tensor
            return
        per_row = max(1, tensor[:1].numel() * tensor.element_size())
        step = max(1, max_bytes // per_row)
        for start in range(0, tensor.shape[0], step):
            yield start, tensor[start : start + step]
        return
    if not tensor.stored_shape:
        yield 0, tensor.load()
        return
    step = max(1, max_bytes // max(1, tensor._row_bytes))
    count = tensor._count
    need = min(step, count) * tensor._row_bytes
    if buffer is None or buffer.numel() < need:
        buffer = torch.empty(need, dtype=torch.uint8)
    for start in range(0, count, step):
        yield start, tensor.read_rows(start, min(start + step, count), out=buffer)


def _stored_tensors(file: Path) -> list[tuple[str, StoredTensor]]:
    """The tensors of one safetensors file, in the order they are stored. safetensors checks the header (offsets
    within the file, sizes that match the shapes) and reports a broken file; the offsets are read here."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu"):
            pass
    except SafetensorError as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has dtype {entry['dtype']}, which motet does not read"
            )
        begin = 8 + size + entry["data_offsets"][0]
        out.append((name, StoredTensor(file, begin, dtype, tuple(entry["shape"]))))
    return sorted(out, key=lambda item: item[1].offset)


def iter_weights(path: str | Path) -> Iterator[tuple[str, StoredTensor]]:
    """(name, tensor not read yet) for every weight of the checkpoint, in the stored dtype.

    All files are located (and a missing shard reported) before the first tensor is yielded.
    """
    seen: set[str] = set()
    for file in weight_files(path):
        for name, tensor in _stored_tensors(file):
            if name in seen:
                raise ModelLoadError(f"{file}: tensor {name!r} appears in more than one shard")
            seen.add(name)
            if name.endswith(_DERIVED_SUFFIXES):
                continue
            yield name, tensor
