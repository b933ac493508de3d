"""A GGUF's parsed header kept on disk, read back instead of parsing ~100k vocabulary strings
(docs/phases/06-appendix-measurements.md)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

from tinyvllm.disk_cache import cache_root, read_record, write_record
from tinyvllm.model import gguf
from tinyvllm.model.gguf import GGUFTensorInfo, StringArray

HEADER_CACHE = os.getenv("TINYVLLM_GGUF_HEADER_CACHE", "1") != "0"
HEADER_MAGIC = b"tinyvllm-gguf-header 1\n"
HEADER_CACHE_BYTES = 16 << 20  # of header files kept, least recently used out first


class _StringsAt(NamedTuple):
    """A `StringArray` as kept: where in the GGUF its strings begin, and how many."""

    start: int
    n: int


@functools.cache
def _code_identity() -> str:
    """sha256 of the parser's source."""
    return hashlib.sha256(Path(gguf.__file__).read_bytes()).hexdigest()


class HeaderCache:
    """A GGUF's parsed header in `<cache>/gguf-headers/<sha256 of key>.header` (a `disk_cache` record)."""

    def __init__(self, path: str, mtime_ns: int, size: int):
        self.key = repr((path, mtime_ns, size, _code_identity(), sys.version_info[:2]))
        self.directory = cache_root() / "gguf-headers"
        self.file = self.directory / f"{hashlib.sha256(self.key.encode()).hexdigest()}.header"

    def read(self, buf: memoryview) -> tuple[dict, dict[str, GGUFTensorInfo]] | None:
        """The header kept, its string arrays over `buf` (the mapped file); None on a miss."""
        try:
            metadata, infos = read_record(self.file, HEADER_MAGIC, self.key)
            metadata = {k: StringArray(buf, *v) if isinstance(v, _StringsAt) else v for k, v in metadata.items()}
            tensors = {info[0]: GGUFTensorInfo(*info) for info in infos}
        except Exception:  # missing or unreadable: parse the file
            return None
        return metadata, tensors

    def write(self, metadata: dict, tensors: dict[str, GGUFTensorInfo]) -> None:
        """Keep a parse for later processes (quietly not on a read-only home or full disk)."""
        kept = {k: _StringsAt(v._start, v._n) if isinstance(v, StringArray) else v for k, v in metadata.items()}
        infos = [(t.name, t.shape, t.ggml_type, t.offset) for t in tensors.values()]
        write_record(self.file, HEADER_MAGIC, self.key, (kept, infos), HEADER_CACHE_BYTES)


def header_cache(path: str, mtime_ns: int, size: int) -> HeaderCache | None:
    """Where this GGUF's parse is kept; None when turned off."""
    return HeaderCache(path, mtime_ns, size) if HEADER_CACHE else None
