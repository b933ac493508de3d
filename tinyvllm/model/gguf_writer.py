"""Writing a GGUF v3 file: the inverse of tinyvllm/model/gguf.py (whose docstring has the layout)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

from tinyvllm.model.gguf import GGUF_MAGIC, GGUFFile, StringArray, _Cursor
from tinyvllm.ggml_types import type_name
from tinyvllm.model.quant import tensor_nbytes

GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# metadata value types (gguf_type in ggml's gguf.h)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
            BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_INT_RANGES = {UINT8: (0, 2**8), INT8: (-2**7, 2**7), UINT16: (0, 2**16), INT16: (-2**15, 2**15),
               UINT32: (0, 2**32), INT32: (-2**31, 2**31), UINT64: (0, 2**64), INT64: (-2**63, 2**63)}


@dataclass(frozen=True)
class MetadataValue:
    """A metadata value with its GGUF type: `type` is one of the ids above; `item_type` for an ARRAY."""

    value: Any
    type: int
    item_type: int | None = None


@dataclass(frozen=True)
class TensorData:
    """One tensor to write (numpy shape order): its bytes in `ggml_type`, or a function returning them in its turn."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: np.ndarray | Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)


def _int_type(values: list[int]) -> int:
    lo, hi = min(values, default=0), max(values, default=0)
    for t in (UINT32, INT32, INT64, UINT64):
        if _INT_RANGES[t][0] <= lo and hi < _INT_RANGES[t][1]:
            return t
    raise ValueError(f"integer {lo if lo < 0 else hi} does not fit a GGUF integer (64 bits at most)")


def typed(value: Any) -> MetadataValue:
    """`value` with its GGUF type: kept if it is a MetadataValue already, else the usual one for it."""
    if isinstance(value, MetadataValue):
        return value
    if isinstance(value, np.generic):  # np.int64(5), np.float32(0.5): as the Python number they hold
        value = value.item()
    if isinstance(value, bool):
        return MetadataValue(value, BOOL)
    if isinstance(value, int):
        return MetadataValue(value, _int_type([value]))
    if isinstance(value, float):
        return MetadataValue(value, FLOAT32)
    if isinstance(value, str):
        return MetadataValue(value, STRING)
    if isinstance(value, (list, tuple, StringArray)):  # StringArray: an array read from a GGUF
        items = list(value)
        if all(isinstance(v, str) for v in items):
            return MetadataValue(items, ARRAY, STRING)
        if all(isinstance(v, bool) for v in items):
            return MetadataValue(items, ARRAY, BOOL)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            lo, hi = _INT_RANGES[INT32]
            fits = all(lo <= v < hi for v in items)  # llama.cpp's integer arrays are i32 (token types)
            return MetadataValue(items, ARRAY, INT32 if fits else _int_type(items))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            return MetadataValue(items, ARRAY, FLOAT32)
        raise ValueError(f"a GGUF array holds items of one type; got {sorted({type(v).__name__ for v in items})}")
    raise ValueError(f"cannot write a {type(value).__name__} as GGUF metadata: use bool, int, float, str or a list")


# ---- encoding ----

def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _scalar(t: int, v: Any, key: str) -> bytes:
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v < hi:
            raise ValueError(f"metadata {key!r}: {v!r} is not a value of GGUF type {t} (integers in [{lo}, {hi}))")
    return struct.pack(_SCALARS[t], v)


def _array_items(item_type: int, items: list, key: str) -> bytes:
    if item_type == STRING:
        return b"".join(_string(s) for s in items)
    if item_type in _SCALARS and item_type != BOOL:
        # numbers in one go (a vocabulary's token types), range-checked by the conversion
        dtype = np.dtype(_SCALARS[item_type])
        array = np.asarray(items)
        if item_type in _INT_RANGES and array.size:
            lo, hi = _INT_RANGES[item_type]
            if not (np.issubdtype(array.dtype, np.integer) and lo <= array.min() and array.max() < hi):
                raise ValueError(f"metadata {key!r}: items do not all fit GGUF type {item_type}")
        return array.astype(dtype).tobytes()
    return b"".join(_value(item_type, v, key) for v in items)


def _value(t: int, v: Any, key: str, item_type: int | None = None) -> bytes:
    if t == STRING:
        return _string(v)
    if t == ARRAY:
        if item_type is None or item_type == ARRAY:
            raise ValueError(f"metadata {key!r}: an array needs an item type, and arrays of arrays are not written")
        return struct.pack("<IQ", item_type, len(v)) + _array_items(item_type, list(v), key)
    if t not in _SCALARS:
        raise ValueError(f"metadata {key!r}: unknown GGUF value type {t}")
    return _scalar(t, v, key)


def encode_metadata(key: str, value: Any) -> bytes:
    """One key/value pair as it is stored in the file."""
    mv = typed(value)
    return _string(key) + struct.pack("<I", mv.type) + _value(mv.type, mv.value, key, mv.item_type)


def _padding(n: int, alignment: int) -> int:
    return -n % alignment


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: list[TensorData]) -> int:
    """Write a GGUF v3 file; return its size in bytes."""
    alignment = typed(metadata.get("general.alignment", DEFAULT_ALIGNMENT)).value
    if not isinstance(alignment, int) or alignment <= 0 or alignment % 8 != 0:
        raise ValueError(f"general.alignment must be a positive multiple of 8, got {alignment!r}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names must be unique; repeated: {sorted({n for n in names if names.count(n) > 1})}")

    header = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    header += [encode_metadata(key, value) for key, value in metadata.items()]
    offset = 0
    for t in tensors:
        dims = tuple(reversed(t.shape))  # ggml order: fastest-varying first
        header.append(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, t.ggml_type, offset))
        offset += t.nbytes + _padding(t.nbytes, alignment)

    path = Path(path)
    with open(path, "wb") as f:
        head = b"".join(header)
        f.write(head + bytes(_padding(len(head), alignment)))
        for t in tensors:
            data = t.data() if callable(t.data) else t.data
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor {t.name!r}: {type_name(t.ggml_type)} of shape {t.shape} is {t.nbytes} "
                                 f"bytes, the data given is {data.nbytes}")
            f.write(np.ascontiguousarray(data).data)  # no copy into bytes: the buffer is written as it is
            f.write(bytes(_padding(t.nbytes, alignment)))
        return f.tell()


def read_metadata(path: str | os.PathLike) -> dict[str, MetadataValue]:
    """A GGUF file's metadata with each value's type, for a faithful rewrite."""
    GGUFFile(path)  # checks the magic and the version
    with open(path, "rb") as f:
        cur = _Cursor(memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
    cur.pos = 4 + 4
    _n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    out: dict[str, MetadataValue] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I")
        item_type = struct.unpack_from("<I", cur.buf, cur.pos)[0] if vtype == ARRAY else None
        out[key] = MetadataValue(cur.value(vtype), vtype, item_type)
    return out
