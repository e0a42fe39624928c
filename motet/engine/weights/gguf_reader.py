"""A GGUF file's header read at the speed of its bytes: the metadata and the tensors' infos as gguf-py's GGUFReader
gives them (`fields[key].contents()`, `get_field`, `tensors` with name, type, shape, data offset and a numpy view of
the data), for the loaders that read a file at start-up (motet/engine/weights/gguf_model.py, gguf_weights.py,
gguf_convert.py).

gguf-py's reader makes a numpy view of every element of every metadata array: a 262,144-token vocabulary is a
million views, 10-60 s of a start on a small CPU before any weight is read (Gemma 3's file). Here a numeric array is
one view, read as a list only when asked; a string array is its strings' bytes, decoded when asked. The file is
checked as gguf-py checks it (its magic, version 2 or 3, a power-of-two alignment, no key or tensor twice, known
value and tensor types, every tensor's data inside the file): ValueError otherwise. A file written in the other byte
order is read by gguf-py's own reader (`open_gguf`).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = 0x46554747  # "GGUF", little-endian
_VERSIONS = (2, 3)  # gguf-py's READER_SUPPORTED_VERSIONS
_DEFAULT_ALIGNMENT = 32
# GGUFValueType -> (struct format, numpy dtype) of the scalar types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}  # fmt: skip
_STRING, _ARRAY = 8, 9
# the numpy item type gguf-py gives a tensor's data, by GGML type (others: bytes, uint8)
_ITEM_TYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


class Field:
    """A metadata value: `contents()` as gguf-py's ReaderField gives it (a Python scalar, a str, or a list)."""

    def __init__(self, name: str, types: list[int], value: Any):
        self.name, self.types, self._value = name, types, value

    def contents(self) -> Any:
        value, kind = self._value, self.types[-1]
        if self.types[0] == _ARRAY:
            if kind == _STRING:
                return [str(b, encoding="utf-8") for b in value]
            return value.tolist()
        if kind == _STRING:
            return str(value, encoding="utf-8")
        return value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order (columns first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (`fields`, `get_field`) and tensors (`tensors`), its data mapped read-only."""

    def __init__(self, path: str | Path):
        import gguf

        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._buf, dtype=np.uint8)
        self._off = 0
        try:
            if self._scalar("<I") != _MAGIC:
                raise ValueError("GGUF magic invalid")
            version = self._scalar("<I")
            if version & 0xFFFF == 0:
                raise _OtherByteOrder
            if version not in _VERSIONS:
                raise ValueError(f"GGUF version {version}, not one of {_VERSIONS}")
            tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
            self.fields: dict[str, Field] = {
                "GGUF.version": Field("GGUF.version", [4], version),
                "GGUF.tensor_count": Field("GGUF.tensor_count", [10], tensor_count),
                "GGUF.kv_count": Field("GGUF.kv_count", [10], kv_count),
            }
            for _ in range(kv_count):
                key = str(self._string(), encoding="utf-8")
                types, value = self._value(self._scalar("<I"))
                if key in self.fields:
                    raise ValueError(f"duplicate key {key!r}")
                self.fields[key] = Field(key, types, value)
            infos = [self._tensor_info() for _ in range(tensor_count)]
            alignment = _DEFAULT_ALIGNMENT
            if (field := self.fields.get("general.alignment")) is not None:
                alignment = field.contents()
                if field.types != [4] or alignment == 0 or alignment & (alignment - 1):
                    raise ValueError(f"invalid alignment {alignment!r}: a power of two (uint32) is expected")
            start = -(-self._off // alignment) * alignment
            self.tensors = self._tensors(infos, start, gguf)
        except struct.error as e:
            raise ValueError(f"the file ends inside its header ({e})") from None

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return value

    def _string(self) -> bytes:
        n = self._scalar("<Q")
        if self._off + n > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        out = self._buf[self._off : self._off + n]
        self._off += n
        return out

    def _value(self, kind: int) -> tuple[list[int], Any]:
        if kind == _STRING:
            return [kind], self._string()
        if kind in _SCALARS:
            value = self._scalar(_SCALARS[kind][0])
            return [kind], value
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item == _STRING:
            strings = []
            for _ in range(count):
                strings.append(self._string())
            return [kind, item], strings
        if item not in _SCALARS:  # (gguf-py reads no nested arrays either)
            raise ValueError(f"metadata arrays of type {item} are not read")
        dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
        end = self._off + count * dtype.itemsize
        if end > len(self._buf):
            raise ValueError("an array runs past the end of the file")
        values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._off)
        self._off = end
        return [kind, item], values

    def _tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = str(self._string(), encoding="utf-8")
        n_dims = self._scalar("<I")
        dims = np.frombuffer(self._buf, dtype="<u8", count=n_dims, offset=self._off).copy()
        self._off += 8 * n_dims
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensors(self, infos, start: int, gguf) -> list[Tensor]:
        tensors, names = [], set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor {name!r}")
            names.add(name)
            qtype = gguf.GGMLQuantizationType(raw_type)  # ValueError for a type gguf-py does not know
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except KeyError:
                raise ValueError(f"tensor {name!r}: type {qtype.name} has no known block size") from None
            n_elements = int(np.prod(dims)) if len(dims) else 1
            n_bytes = n_elements * type_size // block
            data_offset = start + offset
            if data_offset + n_bytes > len(self._buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            item = _ITEM_TYPES.get(raw_type)
            if item is None:
                item, count = np.uint8, n_bytes
                np_dims = gguf.quant_shape_to_byte_shape(np_dims, qtype)
            else:
                count = n_elements
            data = np.frombuffer(self._buf, dtype=item, count=count, offset=data_offset).reshape(np_dims)
            tensors.append(Tensor(name, qtype, dims, n_elements, n_bytes, data_offset, data))
        return tensors


class _OtherByteOrder(Exception):
    pass


def open_gguf(path: str | Path):
    """The file's reader: a GGUFFile, or gguf-py's GGUFReader for a file in the other byte order. ValueError or
    OSError where it is not a readable GGUF file."""
    try:
        return GGUFFile(path)
    except _OtherByteOrder:
        import gguf

        return gguf.GGUFReader(str(path))
