"""What a process's start touches in tinygrad: caches, settings, choosing a device
(docs/phases/06-appendix-measurements.md)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import re
import sqlite3
import sys
import sysconfig
import types

from tinygrad import Device, UOp, getenv
from tinygrad import codegen, helpers
from tinygrad.engine import realize
from tinygrad.helpers import DEV, NUM_CPU_THREADS, ContextVar
from tinygrad.runtime.support.c import DLL

from tinyvllm.tinygrad_ext import INSTALLED_VERSION, TINYGRAD_VERSION

# ---- lowered programs kept on disk (tinyvllm/kernels/program_cache.py) ----


def lowered_program_cache(replacement: dict | None = None) -> dict:
    """tinygrad's in-memory dict of lowered programs; with `replacement`, that dict from now on."""
    if replacement is not None:
        codegen.to_program_cache = realize.to_program_cache = replacement
    return codegen.to_program_cache


def lower_cpu_device_programs_through(cache: dict) -> None:
    """Build the CPU device's helper programs through `cache`, keyed also by the ast's tag."""
    import tinygrad.runtime.ops_cpu as ops_cpu

    lower = codegen.do_to_program

    def lower_through_cache(ast: UOp, renderer) -> UOp:
        key = (*codegen.to_program_key(ast, renderer), f"tag={ast.tag!r}")
        if (program := cache.get(key)) is None:
            cache[key] = program = lower(ast, renderer)
        return program
    ops_cpu.do_to_program = lower_through_cache


# ---- the default device, settled without probing where an earlier process did ----

def chosen_default_device() -> str | None:
    """`Device.DEFAULT` if settled without probing; else None."""
    return DEV.device or _cached_default_device()


def choose_default_device() -> str:
    """`Device.DEFAULT` (with no DEV, tinygrad probes devices until one opens)."""
    return Device.DEFAULT


def set_default_device(name: str) -> None:
    """Settle `Device.DEFAULT` on `name`, also for child processes."""
    _cached_default_device(name)
    os.environ["DEV"] = name


def _cached_default_device(name: str | None = None) -> str | None:
    """What `_Device._select_device` cached; with `name`, store that."""
    if name is not None:
        Device.__dict__["_select_device"] = name
    return Device.__dict__.get("_select_device")


# ---- the CPU device's module, imported with less ----

# renderer modules the CPU device imports but uses only when DEV names them
DEFERRED_CPU_RENDERERS = {"tinygrad.renderer.nir": "LVPRenderer", "tinygrad.renderer.isa.x86": "X86Renderer"}


def defer_unused_cpu_renderers() -> None:
    """Stand in for the costly renderer modules only DEV=CPU:LVP or CPU:X86 use, until used."""
    if "tinygrad.runtime.ops_cpu" in sys.modules or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    sys.modules.update({name: _stand_in(name, cls) for name, cls in DEFERRED_CPU_RENDERERS.items()
                        if name not in sys.modules})


def _stand_in(name: str, renderer: str) -> types.ModuleType:
    """A module `name` holding a class `renderer`; using either imports the real module."""
    module = types.ModuleType(name,
                              "imported when first used: tinyvllm.tinygrad_ext.startup.defer_unused_cpu_renderers")

    def real() -> types.ModuleType:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        return importlib.import_module(name)

    def read(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(real(), attr)

    class Deferred:
        def __new__(cls, *args, **kwargs):
            return getattr(real(), renderer)(*args, **kwargs)

    Deferred.__name__ = Deferred.__qualname__ = renderer  # the device finds its renderers by class name
    module.__getattr__ = read
    setattr(module, renderer, Deferred)
    return module


TINYGRAD_FINDLIB = None  # tinygrad's own `DLL.findlib`, once replaced


def find_libraries_quickly() -> None:
    """Replace tinygrad's `DLL.findlib` with `_findlib` (names tested before stat)."""
    global TINYGRAD_FINDLIB
    if sys.platform != "linux" or INSTALLED_VERSION != TINYGRAD_VERSION or TINYGRAD_FINDLIB is not None:
        return
    TINYGRAD_FINDLIB = DLL.findlib
    DLL.findlib = staticmethod(_findlib)


def _findlib(nm: str, paths: list[str], extra_paths=[]) -> str | None:  # noqa: B006  (tinygrad's signature)
    """tinygrad 0.14.0's `DLL.findlib` on Linux, an entry's two tests swapped."""
    if pathlib.Path(path := getenv(nm.replace("-", "_").upper() + "_PATH", "")).is_file():
        return path
    for p in paths:
        if (pth := pathlib.Path(p)).is_absolute():
            if pth.is_file():
                return p
            continue
        libpaths = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d] + [
            "/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/lib/wsl/lib/", "/lib", "/lib64",
            f"/lib/{sysconfig.get_config_var('MULTIARCH')}"]
        name = re.compile(f"lib{p}\\.so\\.?[0-9]*")
        for pre in (pathlib.Path(pre) for pre in ([path] if path else []) + libpaths + extra_paths):
            if not pre.is_dir():
                continue
            with os.scandir(pre) as entries:  # the order of `pre.iterdir()`
                for entry in entries:
                    if name.fullmatch(entry.name) and entry.is_file():
                        with open(entry.path, "rb") as f:  # a linker script is not the library
                            if f.read(4) == b"\x7fELF":
                                return str(pre / entry.name)
    return None


# ---- settings, threads, and the kernel cache shared by every thread ----

def tinygrad_settings() -> dict[str, str]:
    """The tinygrad settings (`ContextVar`s) the environment sets, by name."""
    return {key: repr(var.value) for key, var in sorted(ContextVar._cache.items()) if key in os.environ}


def default_cpu_threads() -> int:
    """tinygrad's own CPU thread count."""
    return NUM_CPU_THREADS.value


_kernel_cache_shared = False


def share_kernel_cache_across_threads() -> None:
    """Reopen tinygrad's kernel cache with check_same_thread=False (the engine thread uses it)."""
    global _kernel_cache_shared
    if _kernel_cache_shared:
        return
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    connection = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    with contextlib.suppress(sqlite3.OperationalError):
        connection.execute("PRAGMA journal_mode=WAL").fetchone()
    connection.execute("PRAGMA synchronous=NORMAL")
    helpers._db_connection, _kernel_cache_shared = connection, True
