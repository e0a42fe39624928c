"""motet's GGUF header reader (motet/engine/weights/gguf_reader.py) against gguf-py's GGUFReader, the reference: the same
metadata values and types, the same tensors (names, types, shapes, offsets, data views), on a file of every value
type gguf-py writes and on the default model's own file; a malformed file is a ValueError, as gguf-py's is."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from motet.engine.weights.gguf_config import metadata_of
from motet.engine.weights.gguf_reader import GGUFFile, open_gguf

T = gguf.GGMLQuantizationType


def write_file(path, tensors=None, extra=None) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 9.9999997e-06)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strings", ["a", "", "ß✓", "<|im_end|>"] * 1000)
    w.add_array("t.ints", list(range(-5, 500)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.bools", [True, False, True])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    rng = np.random.default_rng(0)
    for name, (shape, qtype) in (tensors or {
        "a.weight": ((3, 64), T.F32), "b.weight": ((4, 64), T.F16), "c.weight": ((5, 64), T.Q8_0),
        "d.weight": ((2, 256), T.Q4_1), "e.weight": ((7,), T.F32),
    }).items():  # fmt: skip
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, x)
        elif qtype == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    mine, want = metadata_of(ours), metadata_of(theirs)
    assert list(mine) == list(want)
    for key in want:
        assert mine[key] == want[key] and type(mine[key]) is type(want[key]), key
        if isinstance(want[key], list) and want[key]:
            assert {type(v) for v in mine[key]} == {type(v) for v in want[key]}, key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset,
        )  # fmt: skip
        assert a.shape.tolist() == b.shape.tolist()
        assert (
            a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
        )


def test_metadata_and_tensors_as_gguf_py_reads_them(tmp_path):
    write_file(tmp_path / "all.gguf")
    assert_same(tmp_path / "all.gguf")


def test_the_default_models_file(default_model_dir):
    assert_same(default_model_dir / "model.gguf")


@pytest.mark.parametrize("damage", ["magic", "version", "truncated header", "truncated data", "alignment"])
def test_a_malformed_file_is_a_value_error(tmp_path, damage):
    path = tmp_path / "bad.gguf"
    write_file(path, extra={"general.alignment": 48} if damage == "alignment" else None)
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[0:4] = b"GGUG"
    elif damage == "version":
        raw[4:8] = (7).to_bytes(4, "little")
    elif damage == "truncated header":
        raw = raw[:300]
    elif damage == "truncated data":
        raw = raw[:-64]
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError):
        open_gguf(path)
