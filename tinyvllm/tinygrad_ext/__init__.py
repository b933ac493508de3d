"""Every use of tinygrad's internals, in one package: what to read when tinygrad is upgraded.

tinyvllm uses what `import tinygrad` exports (Tensor, UOp, TinyJit, Device, dtypes, Context, getenv, function;
`tinygrad.dtype.DType` for type hints) directly. Everything else it needs from tinygrad is behind a function of
one of these modules, and `internals.py` lists each name with the one function that uses it:

    jit.py        capture and replay: `JitBase` (tinygrad's TinyJit class, to subclass), a call's inputs, and what
                  a TinyJit captured, read as calls and launches (kernels/cpu_graph.py builds its table from them)
    programs.py   hand-written kernels as tinygrad programs: built, compiled, loaded (kernels/launcher.py)
    buffers.py    device memory: buffers' addresses, host views, copies, zeroed memory, split tensors
    startup.py    a process's start: the default device, the lowered-program cache, the CPU device's imports
    speed.py      fixes to the pinned tinygrad that change how fast, never what (one trace for every layer)
    internals.py  the table, and the check that every name in it exists (tests/test_tinygrad_ext.py)

The version is pinned in pyproject.toml and checked once, on import: any other warns, and the fixes and start-up
shortcuts leave that tinygrad alone. Chapter: docs/phases/01-appendix-tinygrad-internals.md.
"""

from __future__ import annotations

import os
import warnings

import tinygrad


def installed_version() -> str:
    """tinygrad's version (it has no `__version__`) from the name of its `tinygrad-<version>.dist-info` directory, as
    `importlib.metadata.version` finds it, without importing that (an email parser, for METADATA) in every process;
    importlib.metadata where that directory is not one alone (a source checkout, leftovers of an upgrade)."""
    site = os.path.dirname(os.path.dirname(os.path.abspath(tinygrad.__file__)))
    found = [n for n in os.listdir(site) if n.startswith("tinygrad-") and n.endswith(".dist-info")]
    if len(found) == 1:
        return found[0].removeprefix("tinygrad-").removesuffix(".dist-info")
    from importlib.metadata import version

    return version("tinygrad")


TINYGRAD_VERSION = "0.14.0"  # the one this package was written against (pyproject.toml pins it)
INSTALLED_VERSION = installed_version()  # read once: the caches' keys and directory names carry it
if INSTALLED_VERSION != TINYGRAD_VERSION:
    warnings.warn(f"tinyvllm was written for tinygrad {TINYGRAD_VERSION}, this is tinygrad {INSTALLED_VERSION}: "
                  "its internals may have moved (`python -m tinyvllm.tinygrad_ext.internals` lists what is missing); "
                  "speed fixes are off", RuntimeWarning, stacklevel=2)
