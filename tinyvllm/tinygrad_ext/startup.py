"""What a process's start touches in tinygrad: its caches, its settings, how it chooses and opens a device.

    kernels/program_cache.py --install()--> lowered_program_cache(disk cache)    lowered kernels kept on disk
                                            defer_unused_cpu_renderers()          before ops_cpu is imported
                                            find_libraries_quickly()              before it loads libc, libm
                                            lower_cpu_device_programs_through()   the CPU device's own programs
                                            chosen / choose / set_default_device  the default device, remembered

Chapter: docs/phases/06-appendix-measurements.md (what a new process reuses).
"""

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
    """tinygrad's in-memory dict of lowered programs (`tinygrad.codegen.to_program_cache`); with `replacement`,
    that dict from now on: `tinygrad.codegen` and `tinygrad.engine.realize` each look it up by its global name at
    every call, so rebinding the name in both is enough."""
    if replacement is not None:
        codegen.to_program_cache = realize.to_program_cache = replacement
    return codegen.to_program_cache


def lower_cpu_device_programs_through(cache: dict) -> None:
    """Build the CPU device's helper programs through `cache` (a lowered-program dict, as `to_program_cache`).

    tinygrad's CPU device, when it opens, lowers and compiles four programs of its own (the worker thread's
    loop, signal, wait, timestamp: `tinygrad.runtime.ops_cpu.CPUDevice.__init__`) by calling `do_to_program`
    directly, past `to_program_cache`. ops_cpu looks `do_to_program` up by its global name, so rebinding that
    name routes the calls through `cache`. The key is tinygrad's own (`to_program_key`) plus the ast's tag,
    which tinygrad's key leaves out and which says "do not optimize"."""
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
    """The device tinygrad's `Device.DEFAULT` is, if that is already settled without probing: DEV names it, or
    this process has probed."""
    return DEV.device or _cached_default_device()


def choose_default_device() -> str:
    """`Device.DEFAULT`: with no DEV set, tinygrad opens METAL, AMD, NV, CUDA, QCOM, CL in turn until one works
    (`_Device.get_available_devices`); on a machine with none of them, imports and failures before it settles on
    CPU."""
    return Device.DEFAULT


def set_default_device(name: str) -> None:
    """Settle `Device.DEFAULT` on `name` without probing, and, as tinygrad does once it has chosen, in the
    environment for child processes."""
    _cached_default_device(name)
    os.environ["DEV"] = name


def _cached_default_device(name: str | None = None) -> str | None:
    """What `_Device._select_device` (a cached property) has stored in the instance dict of `Device`, if it has run;
    with `name`, store that as its answer, so that it never runs."""
    if name is not None:
        Device.__dict__["_select_device"] = name
    return Device.__dict__.get("_select_device")


# ---- the CPU device's module, imported with less ----

# the modules of CPU renderers a process uses only when DEV names them, and the class each gives the CPU device
DEFERRED_CPU_RENDERERS = {"tinygrad.renderer.nir": "LVPRenderer", "tinygrad.renderer.isa.x86": "X86Renderer"}


def defer_unused_cpu_renderers() -> None:
    """Let the CPU device's module import without the modules of renderers this process does not use.

    `tinygrad.runtime.ops_cpu` imports the module of every renderer the CPU device can pick (Clang, LLVM, Mesa's
    llvmpipe "LVP", x86) to list their classes. LVP's defines ctypes classes for all of Mesa's NIR API as it is
    imported and x86's builds instruction tables, for renderers only DEV=CPU:LVP or CPU:X86 choose. Until ops_cpu
    is imported, each of those modules is a stand-in in `sys.modules` (`_stand_in`): instantiating its renderer
    class (the device picked it) or reading any other name imports the real module in its place. Pinned tinygrad
    only."""
    if "tinygrad.runtime.ops_cpu" in sys.modules or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    sys.modules.update({name: _stand_in(name, cls) for name, cls in DEFERRED_CPU_RENDERERS.items()
                        if name not in sys.modules})


def _stand_in(name: str, renderer: str) -> types.ModuleType:
    """A module `name` that holds a class `renderer` and imports the real module when either is used."""
    module = types.ModuleType(name, "imported when first used: tinyvllm.tinygrad_ext.startup.defer_unused_cpu_renderers")

    def real() -> types.ModuleType:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        return importlib.import_module(name)

    def read(attr: str):  # what the import system asks of any module (__path__, __spec__, ...) is absent
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(real(), attr)

    class Deferred:
        def __new__(cls, *args, **kwargs):  # the device picked this renderer: build the real one
            return getattr(real(), renderer)(*args, **kwargs)

    Deferred.__name__ = Deferred.__qualname__ = renderer  # the device finds its renderers by class name
    module.__getattr__ = read
    setattr(module, renderer, Deferred)
    return module


TINYGRAD_FINDLIB = None  # tinygrad's own `DLL.findlib`, kept here once `find_libraries_quickly` has replaced it


def find_libraries_quickly() -> None:
    """Make tinygrad's search for a shared library (`runtime.support.c.DLL.findlib`) cheaper, finding the same file.

    Opening the CPU device loads libc, libm and libgcc_s through `DLL`, which looks for `lib<name>.so[.N]` in the
    usual directories in turn, and in each asks of every entry whether it is a file (a `stat` per entry) before
    asking whether its name fits: the system's library directory holds over a thousand entries, read once per
    library. `_findlib` reads the same directories in the same order and returns the same first match, but tests
    an entry's name first and looks on disk only at a name that fits. Linux only (elsewhere tinygrad's own search
    runs); pinned tinygrad only. Call it before the CPU device's module is imported."""
    global TINYGRAD_FINDLIB
    if sys.platform != "linux" or INSTALLED_VERSION != TINYGRAD_VERSION or TINYGRAD_FINDLIB is not None:
        return
    TINYGRAD_FINDLIB = DLL.findlib
    DLL.findlib = staticmethod(_findlib)


def _findlib(nm: str, paths: list[str], extra_paths=[]) -> str | None:  # noqa: B006  (tinygrad's signature)
    """`DLL.findlib` of tinygrad 0.14.0 on Linux, step for step, with each directory's entries filtered by name
    before they are stat'ed (the order of the two tests of an entry swapped; both must hold either way)."""
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
    """The settings tinygrad read from the environment (its `ContextVar`s: DEV, BEAM, NOOPT, ...) that the
    environment sets, by name, as text: what a kernel tinygrad built may depend on beyond its defaults. (Only
    those set: which ContextVars exist depends on which tinygrad modules this process happened to import.)"""
    return {key: repr(var.value) for key, var in sorted(ContextVar._cache.items()) if key in os.environ}


def default_cpu_threads() -> int:
    """How many threads tinygrad itself would use on the CPU (`tinygrad.helpers.NUM_CPU_THREADS`)."""
    return NUM_CPU_THREADS.value


_kernel_cache_shared = False


def share_kernel_cache_across_threads() -> None:
    """Let the engine thread use tinygrad's on-disk kernel cache even if another thread opened it first.

    tinygrad keeps one sqlite connection for the cache (`tinygrad.helpers._db_connection`, opened by
    `db_connection()`), and sqlite refuses a connection made on another thread: a process that compiled
    kernels on its main thread before starting the engine thread would fail on the first cache lookup there.
    Open it with check_same_thread=False instead (sqlite serializes the calls; tinygrad's writes are IMMEDIATE
    transactions), with tinygrad's own settings."""
    global _kernel_cache_shared
    if _kernel_cache_shared:
        return
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    connection = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    with contextlib.suppress(sqlite3.OperationalError):
        connection.execute("PRAGMA journal_mode=WAL").fetchone()
    connection.execute("PRAGMA synchronous=NORMAL")
    helpers._db_connection, _kernel_cache_shared = connection, True
