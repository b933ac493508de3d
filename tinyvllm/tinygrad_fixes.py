"""Fixes to tinygrad 0.14.0 that the engine applies to itself (the version is pinned in pyproject.toml).

Each fix changes how fast tinygrad does something, never what it computes, and is checked against the
installed version before it is applied: on any other tinygrad it is skipped.

1. `tinygrad.function.renumber_invalid_outputs` recomputes `invalid_outputs(uret)` (a walk of the whole
   function body) once per node of the body, so it is quadratic in the size of the body. Every decoder
   layer call pays it (the matmul kernels' outputs are `Tensor.invalids`), ~0.5 s of the ~3 s it takes to
   build and capture the first graph of SmolLM2-135M. The fix computes the set once.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from importlib.metadata import version

import tinygrad.function  # noqa: F401  (loads the module patched below)

_applied = False


def _renumber_invalid_outputs(uret):
    invalid = sys.modules["tinygrad.function"].invalid_outputs(uret)
    return uret.substitute({b: b.replace(arg=replace(b.arg, slot=i))
                            for i, b in enumerate(x for x in uret.toposort(enter_calls=False) if x in invalid)})


def apply() -> None:
    global _applied
    if _applied or version("tinygrad") != "0.14.0":
        return
    # `tinygrad.function` the attribute is the decorator; the module is only reachable through sys.modules
    module = sys.modules["tinygrad.function"]
    module.renumber_invalid_outputs = _renumber_invalid_outputs
    _applied = True
