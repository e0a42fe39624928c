"""A GGUF file's embedding table served in its own blocks: a lookup dequantizes the rows a step reads, from the
file's pages (mapped, read-only), as llama.cpp's get_rows does. No float copy of the table is made (Gemma 3's
262,144 x 640 table is 671 MB in fp32 against its 178 MB of Q8_0 blocks), and a row's values are gguf-py's
dequantization of the file's own blocks, whatever their type (a tied lm_head multiplies in blocks made from the
same tensor: motet/engine/weights/gguf_weights.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn


class GgufTable(nn.Module):
    """Rows [start, start + rows) of a GGUF tensor [N, cols] of GGML type `ggml_type` whose blocks begin at byte
    `offset` of `path`, looked up as an nn.Embedding is (ids -> [..., cols] in `dtype`)."""

    def __init__(self, path: str | Path, offset: int, ggml_type: int, shape: tuple[int, int],
                 dtype: torch.dtype = torch.float32, start: int = 0, rows: int | None = None):  # fmt: skip
        import gguf

        super().__init__()
        self.path, self.offset, self.ggml_type = str(path), int(offset), int(ggml_type)
        self.full_shape = (int(shape[0]), int(shape[1]))
        self.start, self.num_embeddings = int(start), int(rows if rows is not None else shape[0])
        self.embedding_dim, self.dtype = self.full_shape[1], dtype
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        if self.embedding_dim % block:
            raise ValueError(f"rows of {self.embedding_dim} values are not whole blocks of {block}")
        self._qtype = gguf.GGMLQuantizationType(self.ggml_type)
        row_bytes = self.embedding_dim // block * nbytes
        self._blocks = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                                 shape=(self.full_shape[0], row_bytes))  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def narrow(self, dim: int, start: int, length: int) -> GgufTable:
        """Rows [start, start + length) of these (a tensor-parallel rank's vocabulary rows)."""
        if dim != 0:
            raise ValueError("a table is split by rows")
        return self.to_dtype(self.dtype, self.start + start, length)

    def to_dtype(self, dtype: torch.dtype, start: int | None = None, rows: int | None = None) -> GgufTable:
        """The same rows (or rows [start, start + rows) of the file's tensor) looked up in `dtype`."""
        start = self.start if start is None else start
        rows = self.num_embeddings if rows is None else rows
        return GgufTable(self.path, self.offset, self.ggml_type, self.full_shape, dtype, start, rows)

    def describe(self) -> dict:
        """What `from_description` makes this table again from (a prepared-weights cache entry's layout)."""
        return {"path": self.path, "offset": self.offset, "ggml_type": self.ggml_type,
                "shape": list(self.full_shape), "start": self.start, "rows": self.num_embeddings}  # fmt: skip

    @classmethod
    def from_description(cls, d: dict, dtype: torch.dtype) -> GgufTable:
        return cls(d["path"], d["offset"], d["ggml_type"], tuple(d["shape"]), dtype, d["start"], d["rows"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import gguf

        ids = input_ids.reshape(-1).cpu().numpy().astype(np.int64) + self.start
        values = gguf.quants.dequantize(self._blocks[ids], self._qtype)
        rows = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(len(ids), -1)
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
