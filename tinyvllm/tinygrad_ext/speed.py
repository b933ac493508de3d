"""Fixes to the pinned tinygrad that change how fast it does something, never what it computes.

    @reusable_function                 tinygrad's `function(precompile=True)` (a decoder layer: one body, N calls)
    with traces_reused():              inside: a call shaped like an earlier one reuses that call's traced body
        for layer in layers: ...       30 layers, 1 trace (per distinct structure: a sliding-window layer is another)
    apply_fixes()                      on tinygrad 0.14.0 only: `renumber_invalid_outputs` made linear

Applied when imported; taught in docs/phases/01-appendix-tinygrad-speed.md (`function` per layer).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import types
from dataclasses import replace

from tinygrad import Tensor, UOp
from tinygrad.dtype import DType
from tinygrad.nn.state import get_state_dict
from tinygrad.uop.ops import Ops

from tinyvllm.tinygrad_ext import INSTALLED_VERSION, TINYGRAD_VERSION

# `tinygrad.function` the module (the decorator of the same name shadows it)
tinygrad_function = importlib.import_module("tinygrad.function")

_reused_traces: dict | None = None  # inside `traces_reused()`: structure -> traced FUNCTION uop


@contextlib.contextmanager
def traces_reused():
    """Inside: a call with an earlier call's structure (shapes, dtypes, devices, settings) reuses its trace."""
    global _reused_traces
    outer, _reused_traces = _reused_traces, {}
    try:
        yield
    finally:
        _reused_traces = outer


def _structure(obj, out: list, seen: dict) -> bool:
    """Append the settings and buffer places reachable from `obj`; False at what it cannot describe."""
    if isinstance(obj, (Tensor, UOp)):
        u = obj.uop if isinstance(obj, Tensor) else obj
        out.append(("T",) if u.device is not None else ("V", u))  # buffers by place; variables as they are
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, DType, enum.Enum, functools.partial,
                                         types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        out.append(obj)  # values; functions by identity
    elif id(obj) in seen:
        out.append(("seen", seen[id(obj)]))
    else:
        seen[id(obj)] = len(seen)
        if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
            out.append(("dict", tuple(obj)))
            return all(_structure(v, out, seen) for v in obj.values())
        if isinstance(obj, (list, tuple)) or (hasattr(obj, "__dict__") and not isinstance(obj, (type, dict))):
            items = list(obj) if isinstance(obj, (list, tuple)) else list(vars(obj).values())
            out.append((type(obj).__qualname__, len(items), () if isinstance(obj, (list, tuple)) else tuple(vars(obj))))
            return all(_structure(v, out, seen) for v in items)
        return False
    return True


class ReusableFunction(tinygrad_function._function):
    """tinygrad's `function` (`tinygrad.function._function`), its traces shared inside `traces_reused()`."""

    def __call__(self, *args, **kwargs):
        described: list = []
        if _reused_traces is None or not _structure((args, kwargs), described, {}):
            return super().__call__(*args, **kwargs)
        # the parameters in tinygrad's `function` order
        uops = [t._uop for t in get_state_dict((args, kwargs), tensor_type=(Tensor, UOp)).values()]
        call_uops = list(dict.fromkeys(u for u in uops if u.device is not None))
        index = {u: i for i, u in enumerate(call_uops)}
        key = (id(self), tuple(described), tuple(index[u] for u in uops if u.device is not None),
               tuple((u.shape, u.dtype, u.device, u.axis if isinstance(u.device, tuple) else None) for u in call_uops))
        if (fn := _reused_traces.get(key)) is not None:
            return Tensor(fn.replace(src=(fn.src[0], *call_uops)).gettuple(0))
        ret = super().__call__(*args, **kwargs)
        fn = ret.uop.src[0] if isinstance(ret, Tensor) and ret.uop.op is Ops.GETTUPLE else None
        if fn is not None and fn.op is Ops.FUNCTION and fn.src[1:] == tuple(call_uops):  # no implicit inputs
            _reused_traces[key] = fn
        return ret


def reusable_function(fxn):
    """tinygrad's `function(precompile=True)`, its traces shared inside `traces_reused()`."""
    return ReusableFunction(fxn, precompile=True, precompile_backward=False, allow_implicit=False, grad_fxn=None)


def _renumber_invalid_outputs(uret):
    """tinygrad 0.14.0's `renumber_invalid_outputs`, with `invalid_outputs(uret)` computed once."""
    invalid = tinygrad_function.invalid_outputs(uret)
    return uret.substitute({b: b.replace(arg=replace(b.arg, slot=i))
                            for i, b in enumerate(x for x in uret.toposort(enter_calls=False) if x in invalid)})


_fixes_applied = False


def apply_fixes() -> None:
    """On tinygrad 0.14.0, once: make `renumber_invalid_outputs` linear (it walked the body per node)."""
    global _fixes_applied
    if _fixes_applied or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    tinygrad_function.renumber_invalid_outputs = _renumber_invalid_outputs
    _fixes_applied = True


apply_fixes()
