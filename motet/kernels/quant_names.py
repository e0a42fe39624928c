"""The block formats' plain facts, which the flags' parser and the start-up checks read before torch is imported
(`motet serve` answers its port within a second): the values a block holds and the formats `--quantization`
quantizes a float checkpoint into. motet/kernels/quant.py defines the formats themselves under these names."""

from __future__ import annotations

BLOCK = 32  # values per block along the input dimension, each block with its own scale (and min)
INT8 = "int8"  # llama.cpp's Q8_0 layout
INT4 = "int4"  # llama.cpp's Q4_1 layout
QUANTIZE_FORMATS = (INT8, INT4)  # --quantization's formats a float checkpoint is quantized into on load
