"""An on-disk cache of lowered kernels, so a new process does not render them again.

tinygrad turns each kernel of a graph into a program in two steps: lowering (the optimizer and the
renderer write the kernel's C, CUDA or Metal source: Python, ~30 ms per kernel) and compiling (clang,
nvrtc, ...). Compiled binaries are cached on disk, keyed by source (`~/.cache/tinygrad/cache.db`), but
lowered programs only in memory (`tinygrad.codegen.to_program_cache`), so every process lowers every
kernel again. For SmolLM2-135M's first decode graph that is ~0.6 s of the ~2 s it takes to build it.

This module saves that in-memory cache at exit and loads it at start:

    process 1:  lower 24 kernels -> to_program_cache -> at exit: pickle to <cache dir>/programs-<version>.pkl
    process 2:  load the pickle -> to_program_cache already holds the 24 -> lowering is a lookup

An entry's key is tinygrad's own (the kernel's AST hash, the renderer, its target and the codegen
settings), so a changed kernel, device or setting is a new entry, never a wrong hit; the file name
carries the tinygrad and Python versions. Programs hold machine code compiled for this machine (clang
`-march=native`), as tinygrad's own cache does: do not share the directory between different CPUs.

`TINYVLLM_PROGRAM_CACHE=0` turns it off; `TINYVLLM_CACHE_DIR` moves it (default `~/.cache/tinyvllm`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import tempfile
import threading
from importlib.metadata import version
from pathlib import Path

from tinygrad.codegen import to_program_cache

ENABLED = os.getenv("TINYVLLM_PROGRAM_CACHE", "1") != "0"

_lock = threading.Lock()
_loaded_keys: set | None = None  # what the file held when this process read it; None: not read yet


def cache_path() -> Path:
    root = Path(os.getenv("TINYVLLM_CACHE_DIR") or Path.home() / ".cache" / "tinyvllm")
    return root / f"programs-tinygrad{version('tinygrad')}-py{sys.version_info[0]}{sys.version_info[1]}.pkl"


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            entries = pickle.load(f)
        return entries if isinstance(entries, dict) else {}
    except FileNotFoundError:
        return {}
    except Exception as e:  # a truncated or foreign file: start over (it is only a cache)
        print(f"tinyvllm: ignoring the program cache {path} ({type(e).__name__}: {e})", file=sys.stderr)
        return {}


def load(path: Path | None = None) -> int:
    """Fill tinygrad's in-memory program cache from disk (once per process); returns how many entries were read."""
    global _loaded_keys
    with _lock:
        if not ENABLED or _loaded_keys is not None:
            return 0
        entries = _read(path or cache_path())
        for key, program in entries.items():
            to_program_cache.setdefault(key, program)
        _loaded_keys = set(entries)
        atexit.register(save)
        return len(entries)


def save(path: Path | None = None) -> int:
    """Write the in-memory program cache to disk, merged with what the file holds now (another process may
    have added to it); returns how many entries this process added. Written to a temporary file and renamed,
    so a reader never sees half a file."""
    with _lock:
        if not ENABLED:
            return 0
        path = path or cache_path()
        new = {k: v for k, v in list(to_program_cache.items()) if _loaded_keys is None or k not in _loaded_keys}
        if not new:
            return 0
        merged = {**_read(path), **new}
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(merged, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except Exception as e:  # a read-only home, a full disk, an entry that does not pickle: keep going uncached
            print(f"tinyvllm: could not write the program cache {path} ({type(e).__name__}: {e})", file=sys.stderr)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return 0
        if _loaded_keys is not None:
            _loaded_keys.update(new)
        return len(new)
