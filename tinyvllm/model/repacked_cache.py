"""Repacked weights kept on disk (docs/phases/06-quantized-weights.md), so that a warm start does no reordering.

A weight repacked for the CPU's kernel (tinyvllm/kernels/repack.py) is the file's bytes reordered: a copy made at
every start (66 MB for the default model, 550 MB for a 1B Q4_K_M file), where a weight in the file's own layout is
used in place from the file's pages. So the first start writes a model's repacked weights into one file of this
cache once they are made, and later starts map that file and use each weight in place, as they use the GGUF: no
work, and the pages come from the page cache (read-only, shared by every process that maps them).

    one file per model: MAGIC | index length (8 bytes) | index (JSON: weight key -> [offset, shape]) | the weights,
    each from a page boundary

The model's key (the file's name) says what the bytes depend on: the model file (path, size, modification time),
the --quantization method and the repacking code; a weight's key, the tensors fused into it, its format and shape.
The directory is kept under MAX_BYTES, least recently used first (disk_cache.evict; a start touches the file it
maps). A file is written to a temporary name and renamed into place whole; `TINYVLLM_REPACK_CACHE=0` turns the cache
off, and deleting the directory empties it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
from pathlib import Path

import numpy as np

from tinyvllm.disk_cache import cache_root, write_file

ENABLED = os.getenv("TINYVLLM_REPACK_CACHE", "1") != "0"
MAGIC = b"tinyvllm-repacked 1\n"
PAGE = 4096  # each weight starts on a page: its view is aligned as the kernels want
MAX_BYTES = 8 << 30


def cache_dir() -> Path:
    return cache_root() / "repacked"


@functools.cache
def code_identity() -> str:
    """sha256 of the repacking code (tinyvllm/kernels/repack.py): a change to a layout makes new keys."""
    path = Path(__file__).resolve().parent.parent / "kernels" / "repack.py"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_identity(path: Path, quantization: str) -> str | None:
    """What a model file's repacked weights depend on: path, size, modification time, --quantization and the
    repacking code; None where the weights do not come from one file (an HF directory: repacked at every start)."""
    path = Path(path).resolve()
    if not path.is_file():
        return None
    st = path.stat()
    return repr((str(path), st.st_size, st.st_mtime_ns, quantization, code_identity()))


class KeptWeights:
    """One model's repacked weights in the cache: `get` a weight an earlier start kept, `keep` one made now (its host
    array), then `save()` once the weights are written, which writes the file if anything was made."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.path = cache_dir() / f"{hashlib.sha256(model_id.encode()).hexdigest()}.x8"
        self.index: dict[str, tuple[int, list[int]]] = {}
        self.mapping: mmap.mmap | None = None
        self.made: list[tuple[str, np.ndarray]] = []
        if ENABLED:
            self._open()

    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(MAGIC) + 8)
                if head[:len(MAGIC)] != MAGIC:
                    return
                header = json.loads(f.read(int.from_bytes(head[len(MAGIC):], "little")))
                size = os.fstat(f.fileno()).st_size
                if header.get("model") != self.model_id or any(
                        offset + math.prod(shape) > size for offset, shape in header["weights"].values()):
                    return
                self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.index = header["weights"]
            os.utime(self.path)  # used now: the last to be evicted
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.index, self.mapping = {}, None

    @staticmethod
    def weight_key(names: tuple[str, ...], ggml_type: int) -> str:
        """One weight's key in its model's file: the tensors fused into it and its format (`get` checks the shape)."""
        return repr((names, ggml_type))

    def whole(self) -> list[np.ndarray]:
        """The mapped file as one array (to map its pages in ahead of the first step), or nothing."""
        return [] if self.mapping is None else [np.frombuffer(self.mapping, dtype=np.uint8)]

    def get(self, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The weight kept under `key` (read-only, over the file's mapping), or None."""
        if self.mapping is None or key not in self.index or list(shape) != self.index[key][1]:
            return None
        offset = self.index[key][0]
        return np.frombuffer(self.mapping, dtype=np.uint8, count=math.prod(shape), offset=offset).reshape(shape)

    def keep(self, key: str, array: np.ndarray) -> None:
        """A weight made now, written to the file by `save` (read then: its bytes may still be being written)."""
        if ENABLED:
            self.made.append((key, array))

    def save(self) -> bool:
        """Write the file (every weight: those kept before and those made now) if any was made; False if it could
        not be written (a full disk, a read-only cache): the weights in memory are unaffected."""
        if not self.made:
            return False
        made = {key for key, _ in self.made}
        weights = [(k, self.get(k, shape)) for k, (_, shape) in self.index.items() if k not in made] + self.made
        relative, offset = {}, 0
        for key, array in weights:
            relative[key] = (offset, list(array.shape))
            offset += -(-array.nbytes // PAGE) * PAGE
        start = PAGE  # where the weights begin: after the header, whose length depends on the offsets' digits
        while True:
            index = {k: [start + o, shape] for k, (o, shape) in relative.items()}
            body = json.dumps({"model": self.model_id, "weights": index}).encode()
            head = MAGIC + len(body).to_bytes(8, "little") + body
            if len(head) <= start:
                break
            start = -(-len(head) // PAGE) * PAGE

        def write(f) -> None:
            f.write(head)
            for key, array in weights:
                f.seek(index[key][0])
                f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
            f.truncate(max(o + math.prod(s) for o, s in index.values()))
        if not write_file(self.path, write, MAX_BYTES):
            return False
        self.made = []
        return True
