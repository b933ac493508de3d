"""tinygrad's lowered kernels kept on disk, and its default device remembered, so a new process redoes neither.

Chapter: docs/phases/06-appendix-measurements.md (what a new process reuses).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path

from tinyvllm.disk_cache import cache_root
from tinyvllm.tinygrad_ext import INSTALLED_VERSION, compiling
from tinyvllm.tinygrad_ext.startup import (
    choose_default_device,
    chosen_default_device,
    defer_unused_cpu_renderers,
    find_libraries_quickly,
    lower_cpu_device_programs_through,
    lowered_program_cache,
    set_default_device,
)

ENABLED = os.getenv("TINYVLLM_PROGRAM_CACHE", "1") != "0"

_lock = threading.Lock()


def cache_dir() -> Path:
    return cache_root() / f"programs-tinygrad{INSTALLED_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"


def key_digest(key) -> str:
    """A stable name for tinygrad's key (ast.key bytes, renderer class, target, settings): the same in every process."""
    parts = [p.hex() if isinstance(p, bytes) else f"{p.__module__}.{p.__qualname__}" if isinstance(p, type) else repr(p)
             for p in (key if isinstance(key, tuple) else (key,))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class DiskProgramCache(dict):
    """tinygrad's lowered-program dict, written through to one file per program and read back on a miss."""

    def __init__(self, directory: Path, entries: dict | None = None):
        super().__init__(entries or {})
        self.directory = directory
        self.hits = 0  # programs read from disk (not lowered) in this process
        self.lowered = 0  # programs lowered and compiled in this process
        self.write_failed = False

    def _path(self, key) -> Path:
        return self.directory / f"{key_digest(key)}.pkl"

    def _load(self, key) -> bool:
        try:
            with open(self._path(key), "rb") as f:
                program = pickle.load(f)
        except FileNotFoundError:
            return False
        except Exception:  # a truncated or foreign file: a miss; the program is lowered and written again
            return False
        super().__setitem__(key, program)
        self.hits += 1
        return True

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or self._load(key)

    def __getitem__(self, key):
        if not super().__contains__(key) and not self._load(key):
            raise KeyError(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, program) -> None:
        super().__setitem__(key, program)
        self.lowered += 1
        tmp = None
        try:  # a temporary file renamed into place: a reader never sees half a program
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(program, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))
        except Exception as e:  # a read-only home, a full disk, a program that does not pickle: stay in memory
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if not self.write_failed:  # say it once, not once per kernel
                print(f"tinyvllm: could not write to the program cache {self.directory} ({type(e).__name__}: {e}); "
                      "lowered kernels stay in memory only", file=sys.stderr)
            self.write_failed = True


def install(directory: Path | None = None, device: str | None = None) -> DiskProgramCache | None:
    """Make tinygrad's lowered-program cache a `DiskProgramCache` (None when turned off); idempotent."""
    with _lock:
        current = lowered_program_cache()
        if isinstance(current, DiskProgramCache):
            return current
        compiling.install(cache_root() / "clang-pch")  # with or without this cache (no result is kept there)
        if not ENABLED:
            return None
        cache = DiskProgramCache(directory or cache_dir(), current)
        lowered_program_cache(cache)
        defer_unused_cpu_renderers()  # before the CPU device's module is first imported (just below)
        find_libraries_quickly()  # and before it loads libc, libm, libgcc_s
        lower_cpu_device_programs_through(cache)
        if device is None:
            settle_default_device(cache.directory / "default_device.json")
        return cache


# where tinygrad looks for an accelerator: the platform, device nodes, and the environment
ACCELERATOR_NODES = ("nvidia", "kfd", "dri", "kgsl", "accel")
DEVICE_NAMES = ("METAL", "AMD", "NV", "CUDA", "HIP", "QCOM", "CL", "GPU")  # as variables, and NV_..., CUDA_... ones


def machine_fingerprint() -> dict:
    """What tinygrad's choice of default device depends on, as far as it can be read cheaply."""
    try:
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith(ACCELERATOR_NODES))
    except OSError:
        nodes = []
    env = {k: v for k, v in sorted(os.environ.items()) if k in DEVICE_NAMES or k == "LD_LIBRARY_PATH"
           or k.startswith(tuple(f"{name}_" for name in DEVICE_NAMES)) or k.endswith("_VISIBLE_DEVICES")}
    return {"platform": sys.platform, "tinygrad": INSTALLED_VERSION, "dev_nodes": nodes, "env": env}


def without_accelerator(fingerprint: dict) -> bool:
    """Linux with no accelerator device node and no device variable: every accelerator tinygrad would probe fails
    (up to half a second of trying), so the CPU is the device."""
    return (fingerprint["platform"] == "linux" and not fingerprint["dev_nodes"]
            and not any(k != "LD_LIBRARY_PATH" for k in fingerprint["env"]))


def settle_default_device(path: Path) -> str:
    """tinygrad's default device: the one remembered in `path` if the machine still looks the same, else the CPU on a
    machine without an accelerator, else tinygrad's own probe (remembered for the next process)."""
    if (chosen := chosen_default_device()) is not None:
        return chosen
    fingerprint = machine_fingerprint()
    try:
        remembered = json.loads(path.read_text())
        if remembered["fingerprint"] == fingerprint and isinstance(remembered["device"], str):
            set_default_device(remembered["device"])
            return remembered["device"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: probe
    if without_accelerator(fingerprint):
        set_default_device("CPU")
        chosen = "CPU"
    else:
        chosen = choose_default_device()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"device": chosen, "fingerprint": fingerprint}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: probe again next time
    return chosen
