"""Reading a GGUF file (llama.cpp's format, github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    | "GGUF" | u32 version | u64 n_tensors | u64 n_kv | metadata: key, type, value ... |
    | tensor infos: name, dims, type, offset ... | padding to the alignment | tensor data |

Taught in docs/phases/01-foundation.md; the cold start in 06-appendix-measurements.md.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.plugins import provided

GGUF_MAGIC = b"GGUF"
MADV_POPULATE_READ = 22  # Linux's madvise advice (its mmap module constant is Python 3.13's)

# metadata value types -> struct format (8 = string, 9 = array are handled separately)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_U64 = struct.Struct("<Q")  # a string's length


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest-varying first)
    ggml_type: int  # see tinyvllm.ggml_types.GGML_TYPES
    offset: int  # absolute byte offset of the tensor's data in the file

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


class StringArray(Sequence):
    """A GGUF array of strings decoded on first use (often never: the tokenizer comes from its cache); a read-only
    sequence of str, equal to a list or tuple of the same strings."""

    def __init__(self, buf: memoryview | bytes, start: int, n: int):
        self._buf, self._start, self._n = buf, start, n  # buf: the mapped file, which this keeps alive
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:  # the loop is kept tight: ~50k strings
            buf, pos, out, length_at = self._buf, self._start, [], _U64.unpack_from
            for _ in range(self._n):
                (length,) = length_at(buf, pos)
                out.append(str(buf[pos + 8:pos + 8 + length], "utf-8", "replace"))
                pos += 8 + length
            self._items = out
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        return self._decoded()[index]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # a list-like value

    def __repr__(self) -> str:
        return f"StringArray({self._decoded()!r})" if self._n <= 8 else f"StringArray(<{self._n} strings>)"


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: memoryview | bytes):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, n: int) -> StringArray:
        """n strings back to back, stepped over (one length read each)."""
        start, pos, buf, length_at = self.pos, self.pos, self.buf, _U64.unpack_from
        try:
            for _ in range(n):
                pos += 8 + length_at(buf, pos)[0]
        except struct.error:
            raise ValueError(f"corrupt GGUF: an array of {n} strings at byte {start} runs past the end") from None
        if pos > len(buf):
            raise ValueError(f"corrupt GGUF: an array of {n} strings at byte {start} runs past the end")
        self.pos = pos
        return StringArray(buf, start, n)

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item_type, n = self.unpack("<I"), self.unpack("<Q")
            if item_type == 8:
                return self.strings(n)
            if item_type in _SCALAR_FORMATS and item_type != 7:  # numbers: one read for the whole array
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
                self.pos += n * dtype.itemsize
                return items
            return [self.value(item_type) for _ in range(n)]
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"corrupt GGUF: unknown metadata value type {vtype}")
        return self.unpack(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """An opened GGUF file: `metadata` (dict), `tensors` (name -> GGUFTensorInfo), raw bytes by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        stat = self.path.stat()
        self.metadata, self.tensors = _read_header(str(self.path.resolve()), stat.st_mtime_ns, stat.st_size)

    def raw(self, name: str, nbytes: int) -> np.ndarray:
        """The tensor's bytes as a uint8 array view into the mapped file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=info.offset)


def _mapped_span(a: np.ndarray) -> tuple[mmap.mmap, int, int] | None:
    """(the mapping, first, last byte offset) of an array that views a GGUF file's mapping; None if it does not."""
    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.base if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    if base is None or base.closed:
        return None
    offset = a.ctypes.data - np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
    return base, offset, offset + a.nbytes


def populate(arrays: Sequence[np.ndarray]) -> None:
    """Map in now the pages of `arrays` that view a GGUF file (`madvise(MADV_POPULATE_READ)`, Linux 5.14+; a no-op
    elsewhere): a weight the model uses in place, read by the first step without a page fault per 64 KiB."""
    _advise(arrays, MADV_POPULATE_READ, shared_pages=True)


def let_go(arrays: Sequence[np.ndarray]) -> None:
    """Drop from this process the pages of `arrays` that view a GGUF file, once their bytes were copied out (a weight
    fused with another, or moved to a device): a mapped page counts in the process's resident memory for as long as
    it is mapped in, so each such weight was counted twice. The page cache keeps the pages (a later read maps them in
    again). A page the array shares with a neighbouring tensor is kept. Linux only."""
    _advise(arrays, mmap.MADV_DONTNEED, shared_pages=False)


def _advise(arrays: Sequence[np.ndarray], advice: int, shared_pages: bool) -> None:
    """madvise the pages of each array that views a GGUF file's mapping: with the pages it shares with its
    neighbours at either end, or without them. Through libc, which lets other threads run meanwhile (mmap's own
    madvise holds the GIL); where the system does not take the advice, nothing is done."""
    if sys.platform != "linux":
        return
    page, libc = mmap.PAGESIZE, _libc()
    for a in arrays:
        if (span := _mapped_span(a)) is not None:
            _, first, last = span
            base = a.ctypes.data - first  # the mapping's first byte (page aligned)
            if shared_pages:
                start, end = first // page * page, last
            else:
                start, end = -(-first // page) * page, last // page * page
            if end > start:
                libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), advice)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.lru_cache(maxsize=8)
def _read_header(path: str, mtime_ns: int, size: int) -> tuple[dict, dict[str, GGUFTensorInfo]]:
    """The metadata and tensor infos of a GGUF file, parsed once per (path, mtime, size) in a process and across
    processes (model/gguf_header_cache.py)."""
    with open(path, "rb") as f:
        buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    # Phase 6: the parse kept on disk (model/gguf_header_cache.py); asked here, that module imports this one
    cache = provided("gguf_header_cache", lambda path, mtime_ns, size: None)(path, mtime_ns, size)
    if cache is not None and bytes(buf[:4]) == GGUF_MAGIC and (header := cache.read(buf)) is not None:
        return header
    header = _parse_header(path, buf)
    if cache is not None:
        cache.write(*header)
    return header


def _parse_header(path: str, buf: memoryview) -> tuple[dict, dict[str, GGUFTensorInfo]]:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")

    metadata: dict = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = {name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
               for name, shape, ggml_type, offset in infos}
    return metadata, tensors
