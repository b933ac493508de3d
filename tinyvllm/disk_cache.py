"""What the on-disk caches share: a directory kept under a size, least recently used files first (a read touches
its file), and a checksummed record of one pickled value per file:

    MAGIC | sha256(payload) | payload = pickle((key, value))
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def cache_root() -> Path:
    """Where tinyvllm keeps its caches: $TINYVLLM_CACHE_DIR, else ~/.cache/tinyvllm."""
    return Path(os.getenv("TINYVLLM_CACHE_DIR") or Path.home() / ".cache" / "tinyvllm")


def read_record(file: Path, magic: bytes, key: str) -> object:
    """The value kept in `file` under `key`, the file touched as used; ValueError for a wrong header, checksum or
    key, OSError if unreadable."""
    data = file.read_bytes()
    if not data.startswith(magic):
        raise ValueError(f"{file.name} is not a file of this cache")
    digest, payload = data[len(magic):len(magic) + 32], data[len(magic) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"{file.name}: checksum mismatch")
    stored_key, value = pickle.loads(payload)
    if stored_key != key:
        raise ValueError(f"{file.name} holds another key")
    os.utime(file)  # used now: the last to be evicted
    return value


def write_record(file: Path, magic: bytes, key: str, value: object, max_bytes: int) -> bool:
    """Keep `value` under `key` in `file` (`write_file`)."""
    try:
        payload = pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    return write_file(file, lambda f: f.write(magic + hashlib.sha256(payload).digest() + payload), max_bytes)


def write_file(file: Path, write: Callable[[BinaryIO], object], max_bytes: int) -> bool:
    """`write(f)` into a temporary file beside `file`, renamed into place whole, then the directory's files of that
    suffix evicted down to `max_bytes`; False, and nothing left behind, if it could not be written."""
    tmp = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, file)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return False
    evict(file.parent, f"*{file.suffix}", max_bytes)
    return True


def evict(directory: Path, pattern: str, max_bytes: int) -> None:
    """Delete the least recently used files matching `pattern` until those left take at most `max_bytes`."""
    files = []
    for path in directory.glob(pattern):
        try:
            st = path.stat()
        except OSError:  # deleted meanwhile by another process
            continue
        files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        try:
            path.unlink()
        except OSError:
            pass
        total -= size
