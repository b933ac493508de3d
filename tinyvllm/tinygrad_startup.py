"""tinygrad's internals that the start of a process uses (tinyvllm/kernels/program_cache.py): its in-memory cache of
lowered programs, how it chooses and opens the default device, and what the CPU device's module imports.

The second half of tinyvllm/tinygrad_adapter.py, split from it along this seam (every use of tinygrad's internals
is in one of the two files; read both when tinygrad is upgraded). What each function wraps is said in it.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import sys
import sysconfig
import types

import tinygrad.codegen
import tinygrad.engine.realize
from tinygrad import Device, UOp
from tinygrad.helpers import DEV, getenv
from tinygrad.runtime.support import c as tinygrad_c

from tinyvllm.tinygrad_adapter import INSTALLED_VERSION, TINYGRAD_VERSION


# ---- lowered programs kept on disk (tinyvllm/kernels/program_cache.py) ----

def lowered_program_cache() -> dict:
    """tinygrad's in-memory dict of lowered programs, `tinygrad.codegen.to_program_cache`."""
    return tinygrad.codegen.to_program_cache


def set_lowered_program_cache(cache: dict) -> None:
    """Replace that dict: `tinygrad.codegen` and `tinygrad.engine.realize` each look it up by its global name at
    every call, so rebinding the name in both is enough."""
    tinygrad.codegen.to_program_cache = cache
    tinygrad.engine.realize.to_program_cache = cache


# ---- opening the device without redoing what an earlier process did (tinyvllm/kernels/program_cache.py) ----

def chosen_default_device() -> str | None:
    """The device tinygrad's `Device.DEFAULT` is, if that is already settled without probing: DEV names it, or
    this process has probed (`_Device._select_device`, a cached property, is in the instance dict)."""
    return DEV.device or Device.__dict__.get("_select_device")


def choose_default_device() -> str:
    """`Device.DEFAULT`: with no DEV set, tinygrad opens METAL, AMD, NV, CUDA, QCOM, CL in turn until one works
    (`_Device.get_available_devices`); on a machine with none of them that is ~0.45 s of imports and failures
    before it settles on CPU."""
    return Device.DEFAULT


def set_default_device(name: str) -> None:
    """Settle `Device.DEFAULT` on `name` without probing: store it where `_Device._select_device` caches its answer
    and, as that method does, in the environment for child processes."""
    Device.__dict__["_select_device"] = name
    os.environ["DEV"] = name


def lower_cpu_device_programs_through(cache: dict) -> None:
    """Build the CPU device's helper programs through `cache` (a lowered-program dict, as `to_program_cache`).

    tinygrad's CPU device, when it opens, lowers and compiles four programs of its own (the worker thread's
    loop, signal, wait, timestamp: `tinygrad.runtime.ops_cpu.CPUDevice.__init__`) by calling `do_to_program`
    directly, past `to_program_cache`: ~0.25 s of rewrites in every process. ops_cpu looks `do_to_program` up by
    its global name, so rebinding that name routes the calls through `cache`. The key is tinygrad's own
    (`to_program_key`) plus the ast's tag, which tinygrad's key leaves out and which says "do not optimize"."""
    import tinygrad.runtime.ops_cpu as ops_cpu

    lower = tinygrad.codegen.do_to_program

    def lower_through_cache(ast: UOp, renderer) -> UOp:
        key = (*tinygrad.codegen.to_program_key(ast, renderer), f"tag={ast.tag!r}")
        if (program := cache.get(key)) is None:
            cache[key] = program = lower(ast, renderer)
        return program
    ops_cpu.do_to_program = lower_through_cache


# the modules of CPU renderers a process uses only when DEV names them, and the class each gives the CPU device
DEFERRED_CPU_RENDERERS = {"tinygrad.renderer.nir": "LVPRenderer", "tinygrad.renderer.isa.x86": "X86Renderer"}


def defer_unused_cpu_renderers() -> None:
    """Let the CPU device's module import without the modules of renderers this process does not use.

    `tinygrad.runtime.ops_cpu` imports the module of every renderer the CPU device can pick (Clang, LLVM, Mesa's
    llvmpipe "LVP", x86) to list their classes. LVP's, `tinygrad.renderer.nir`, defines ctypes classes for all of
    Mesa's NIR API as it is imported (`runtime.autogen.mesa`, Mesa installed or not) and x86's builds instruction
    tables: the largest imports of a start, for renderers only DEV=CPU:LVP or CPU:X86 choose. Until ops_cpu is
    imported, each of those modules is a stand-in in `sys.modules` (`_stand_in`): instantiating its renderer class
    (the device picked it) or reading any other name imports the real module in its place. Pinned tinygrad only."""
    if "tinygrad.runtime.ops_cpu" in sys.modules or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    sys.modules.update({name: _stand_in(name, cls) for name, cls in DEFERRED_CPU_RENDERERS.items()
                        if name not in sys.modules})


def _stand_in(name: str, renderer: str) -> types.ModuleType:
    """A module `name` that holds a class `renderer` and imports the real module when either is used."""
    module = types.ModuleType(name, "imported when first used: tinyvllm.tinygrad_startup.defer_unused_cpu_renderers")

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


# ---- finding the C libraries the CPU device loads (libc, libm, libgcc_s) ----

TINYGRAD_FINDLIB = tinygrad_c.DLL.findlib  # tinygrad's own search, before `find_libraries_quickly` replaces it


def find_libraries_quickly() -> None:
    """Make tinygrad's search for a shared library (`runtime.support.c.DLL.findlib`) cheaper, finding the same file.

    Opening the CPU device loads libc, libm and libgcc_s through `DLL`, which looks for `lib<name>.so[.N]` in the
    usual directories in turn, and in each asks of every entry whether it is a file (a `stat` per entry) before
    asking whether its name fits: the system's library directory holds over a thousand entries, read once per
    library. Here the same directories are read in the same order and the same first match is returned, but an
    entry's name is tested first and only a name that fits is looked at on disk. Linux only (elsewhere tinygrad's
    own search runs); pinned tinygrad only. Call it before the CPU device's module is imported."""
    if sys.platform != "linux" or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    tinygrad_c.DLL.findlib = staticmethod(_findlib)


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
