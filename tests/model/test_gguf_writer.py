"""Phase 6: the GGUF writer (tinyvllm/model/gguf_writer.py), read back by our reader and by the `gguf` package's
GGUFReader, an independent GGUF parser.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

from tinyvllm.model import gguf_writer as gw  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.quant import dequantize, tensor_nbytes  # noqa: E402
from tinyvllm.model.quantizer import quantize  # noqa: E402


EVERY_TYPE = {
    "t.u8": gw.MetadataValue(200, gw.UINT8), "t.i8": gw.MetadataValue(-100, gw.INT8),
    "t.u16": gw.MetadataValue(60000, gw.UINT16), "t.i16": gw.MetadataValue(-30000, gw.INT16),
    "t.u32": 4_000_000_000, "t.i32": -2_000_000_000, "t.f32": 0.5, "t.bool": True, "t.str": "héllo 🤖",
    "t.u64": 2**63 + 5, "t.i64": -(2**40), "t.f64": gw.MetadataValue(1 / 3, gw.FLOAT64),
    "t.strings": ["a", "", "Ġthe", "<|im_end|>"], "t.ints": [3, -1, 7], "t.floats": [0.25, -2.0],
    "t.bools": [True, False], "t.u8s": gw.MetadataValue([1, 2, 255], gw.ARRAY, gw.UINT8), "t.empty": [],
    "general.alignment": gw.MetadataValue(64, gw.UINT32),
}
EXPECTED_GGUF_TYPES = {  # gguf.GGUFReader's view: the value type, then an array's item type
    "t.u8": [0], "t.i8": [1], "t.u16": [2], "t.i16": [3], "t.u32": [4], "t.i32": [5], "t.f32": [6], "t.bool": [7],
    "t.str": [8], "t.u64": [10], "t.i64": [11], "t.f64": [12], "t.strings": [9, 8], "t.ints": [9, 5],
    "t.floats": [9, 6], "t.bools": [9, 7], "t.u8s": [9, 0], "general.alignment": [4],
}


def small_tensors(rng: np.random.Generator) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """name -> (ggml type, bytes or values to write, the float32 values they hold)."""
    w = rng.standard_normal((3, 64)).astype(np.float32)
    q = quantize(w, 8)
    v = rng.standard_normal(5).astype(np.float32)  # 20 bytes: the next tensor needs padding
    h = rng.standard_normal((2, 3)).astype(np.float16)
    return {"w.q8": (8, q, dequantize(q.reshape(-1), 8, (3, 64))), "v.f32": (0, v, v),
            "h.f16": (1, h, h.astype(np.float32))}


def test_writer_round_trip(tmp_path):
    tensors = small_tensors(np.random.default_rng(0))
    path = tmp_path / "all.gguf"
    size = gw.write_gguf(path, EVERY_TYPE, [gw.TensorData(n, v.shape, t, data) for n, (t, data, v) in tensors.items()])
    assert size == path.stat().st_size

    ours = GGUFFile(path)  # our reader
    for key, value in EVERY_TYPE.items():
        expected = value.value if isinstance(value, gw.MetadataValue) else value
        got = ours.metadata[key]
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key
    for name, (ggml_type, _, values) in tensors.items():
        info = ours.tensors[name]
        assert info.ggml_type == ggml_type and info.offset % 64 == 0
        raw = ours.raw(name, tensor_nbytes(ggml_type, info.shape))
        np.testing.assert_array_equal(dequantize(raw, ggml_type, info.shape), values)

    reader = gguf.GGUFReader(path)  # llama.cpp's Python reader
    for key, types in EXPECTED_GGUF_TYPES.items():
        assert [int(t) for t in reader.fields[key].types] == types, key
    assert reader.fields["t.str"].contents() == "héllo 🤖"
    assert reader.fields["t.strings"].contents() == ["a", "", "Ġthe", "<|im_end|>"]
    assert reader.fields["t.u64"].contents() == 2**63 + 5
    assert reader.alignment == 64
    for t in reader.tensors:
        ggml_type, _, values = tensors[t.name]
        assert int(t.tensor_type) == ggml_type
        got = gguf.quants.dequantize(t.data, GGMLQuantizationType(ggml_type)) if ggml_type == 8 else t.data
        np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(values.shape), values)

    typed = gw.read_metadata(path)  # types read back as written: a rewrite keeps them
    assert {k: v.type for k, v in typed.items()} == {k: gw.typed(v).type for k, v in EVERY_TYPE.items()}
    assert typed["t.u8s"].item_type == gw.UINT8 and typed["t.ints"].item_type == gw.INT32


def test_writer_layout_by_hand(tmp_path):
    """The bytes themselves, for one key and one tensor, against the GGUF spec."""
    path = tmp_path / "one.gguf"
    data = np.arange(4, dtype=np.float32)
    gw.write_gguf(path, {"k": gw.MetadataValue(7, gw.UINT32)}, [gw.TensorData("t", (4,), 0, data)])
    raw = path.read_bytes()
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    kv = struct.pack("<Q", 1) + b"k" + struct.pack("<II", 4, 7)
    info = struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 0, 0)
    head = header + kv + info
    assert raw[:len(head)] == head
    start = (len(head) + 31) // 32 * 32
    assert raw[len(head):start] == bytes(start - len(head))  # zeros up to the alignment
    assert raw[start:start + 16] == data.tobytes() and len(raw) == start + 32  # the tensor padded to 32 too


def test_default_types():
    """A value without a stated type gets the one llama.cpp's writers use for it."""
    assert gw.typed(5).type == gw.UINT32 and gw.typed(-5).type == gw.INT32 and gw.typed(2**40).type == gw.INT64
    assert gw.typed(np.int64(3)) == gw.MetadataValue(3, gw.UINT32)  # numpy scalars as the numbers they hold
    assert gw.typed(np.float32(0.5)) == gw.MetadataValue(0.5, gw.FLOAT32) and gw.typed(True).type == gw.BOOL
    assert gw.typed([1, -2]).item_type == gw.INT32  # token types
    assert gw.typed([1, 2**31]).item_type == gw.UINT32 and gw.typed([2**63]).item_type == gw.UINT64


def test_writer_errors(tmp_path):
    path = tmp_path / "bad.gguf"
    t = gw.TensorData("t", (4,), 0, np.zeros(4, np.float32))
    cases = [
        ({"general.alignment": 12}, [t], "general.alignment must be a positive multiple of 8"),
        ({}, [t, t], r"tensor names must be unique; repeated: \['t'\]"),
        ({}, [gw.TensorData("t", (5,), 0, np.zeros(4, np.float32))], "is 20 bytes, the data given is 16"),
        ({"k": gw.MetadataValue(300, gw.UINT8)}, [], r"'k': 300 is not a value of GGUF type 0"),
        ({"k": gw.MetadataValue([1, -1], gw.ARRAY, gw.UINT32)}, [], "do not all fit GGUF type 4"),
        ({"k": [1, "a"]}, [], "items of one type"),
        ({"k": {"a": 1}}, [], "cannot write a dict"),
        ({"k": 2**64}, [], "does not fit a GGUF integer"),
    ]
    for metadata, tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            gw.write_gguf(path, metadata, tensors)
