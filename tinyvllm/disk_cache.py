"""What the on-disk caches share: a cache directory kept under a size, the least recently used files going first.

The graph cache (kernels/graph_cache.py), the tokenizer cache (model/tokenizer_cache.py) and the GGUF header cache
(model/gguf.py) each touch a file when they read it (`os.utime`), so its modification time says when it was last
used.
"""

from __future__ import annotations

from pathlib import Path


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
