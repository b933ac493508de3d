"""TinyJit's capture and replay: `JitBase` to subclass (cnt 0: eager, 1: captures, 2+: replays), and a capture read
as calls and launches for kernels/cpu_graph.py (docs/phases/01-appendix-tinygrad-speed.md)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tinygrad import UOp
from tinygrad.device import MultiBuffer
from tinygrad.engine import jit as tinygrad_jit
from tinygrad.engine.jit import JitError, _prepare_jit_inputs, _TinyJit
from tinygrad.engine.realize import get_call_arg_uops, get_runtime, resolve_params, unwrap_multi
from tinygrad.uop.ops import Ops

from tinyvllm.tinygrad_ext.buffers import buffer_address

# ---- the arenas tinygrad's memory planner gives a capture ----

_planned_arenas: weakref.WeakSet[UOp] = weakref.WeakSet()  # BUFFER uops made by the memory planner


def record_arenas() -> None:
    """Wrap tinygrad's memory planner, which puts a capture's intermediate buffers into one arena per device (and
    lane), so that it remembers the arenas it made: a graph run by kernels/cpu_graph.py moves them into the scratch
    every graph shares (kernels/scratch.py)."""
    plan = tinygrad_jit.memory_plan_rewrite
    if hasattr(plan, "__wrapped__"):
        return

    @functools.wraps(plan)
    def planned(linear: UOp, held_bufs=None) -> UOp:
        before = {u for u in linear.toposort() if u.op is Ops.BUFFER}
        out = plan(linear, held_bufs)
        _planned_arenas.update(u for u in out.toposort() if u.op is Ops.BUFFER and u not in before)
        return out
    tinygrad_jit.memory_plan_rewrite = planned


record_arenas()


def arena_buffers(jit: JitBase) -> list[Any]:
    """The arenas (tinygrad `Buffer`s, allocated; one per device of an arena over several) of `jit`'s capture: every
    intermediate buffer of its graph is a view of one of them, and nothing outside the graph reads them."""
    found = []
    for u in jit.captured.linear.toposort():
        if u.op is Ops.BUFFER and u in _planned_arenas:
            found += u.buffer.bufs if isinstance(u.buffer, MultiBuffer) else [u.buffer]
    return [b.ensure_allocated() for b in found]


class JitBase(_TinyJit):
    """tinygrad's TinyJit, with what a subclass that replays the capture itself needs."""

    def capture_on_next_call(self) -> None:
        """Skip the eager first call."""
        self.cnt = 1

    def is_replaying(self) -> bool:
        return self.cnt >= 2 and self.captured is not None

    def count_replay(self) -> None:
        """Count a replay done outside `_TinyJit.__call__`."""
        self.cnt += 1

    def replay_with_tinygrad(self, input_uops: list[UOp], var_vals: dict[str, int]) -> Any:
        """Replay with tinygrad's runner; returns the captured return value."""
        ret = self.captured(input_uops, var_vals)
        self.count_replay()
        return ret

    def captured_return(self) -> Any:
        """What the captured function returned (every replay returns it again)."""
        return self.captured.ret

    def check_inputs(self, names: list, input_info: list) -> None:
        """Raise JitError unless these are the inputs the graph was captured with."""
        captured = self.captured
        if captured.expected_names != names or captured.expected_input_info != input_info:
            raise JitError(f"args mismatch in JIT: expected {captured.expected_names}, {captured.expected_input_info}; "
                           f"got {names}, {input_info}")

    def writes_inputs(self, input_uops: list[UOp]) -> bool:
        """Does the graph write one of these inputs (tinygrad's replay then copies it)?"""
        return any(u in self.captured._written_uops for u in input_uops)


def jit_inputs(args: tuple, kwargs: dict) -> tuple[list[UOp], dict[str, int], list, list]:
    """(input buffer uops, variable values, names, input info) of a call, as `_TinyJit.__call__` computes them."""
    return _prepare_jit_inputs(args, kwargs)


# ---- what a capture holds ----

class UnsupportedCall(Exception):
    """A captured call that is neither a compiled kernel nor a copy, or reads an input through a symbolic offset."""


@dataclass(frozen=True)
class Argument:

    buffer: Any = field(repr=False)  # tinygrad's Buffer (or a view of one) on one device
    device: str
    input: tuple[int, int] | None  # (JIT input slot, shard: -1 whole, else a device's part); None: the graph's
    read: bool
    written: bool

    @property
    def address(self) -> int:
        """Where the buffer is now (allocated if it is not yet)."""
        return buffer_address(self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


@dataclass(frozen=True)
class Launch:
    """One launch of a call on one device."""

    device: str
    arguments: list[Argument]
    device_vars: dict[str, int]


@dataclass(frozen=True)
class Call:
    """One call of a capture, launched once per device it runs on (a copy: arguments [dest, src])."""

    copy: bool
    devices: str | tuple[str, ...]
    launches: list[Launch]
    program: UOp | None = None  # a kernel's compiled PROGRAM
    global_size: tuple = (1, 1, 1)  # the CPU runtime calls a kernel once per core_id
    variables: tuple[str, ...] = ()  # variable arguments, after the buffers
    num_args: int = 0  # buffers and variables


def captured_calls(jit: JitBase, input_uops: list[UOp]) -> Iterator[Call]:
    """The calls `jit` captured, in order, on the buffers tinygrad's replay would use for these inputs."""
    for call in jit.captured.linear.src:
        ast = call.src[0]
        if ast.op is not Ops.PROGRAM and ast.op is not Ops.COPY:
            raise UnsupportedCall(f"a {ast.op} call (only compiled kernels and copies go into the table)")
        resolved, arg_uops = resolve_params(call, input_uops), get_call_arg_uops(call)
        if ast.op is Ops.COPY:  # dest, src: as tinygrad's exec_copy
            launches = []
            for lane, (bufs, device_vars) in enumerate(unwrap_multi(call, resolved)):
                dest, src = bufs
                launches.append(Launch(dest.device, [
                    Argument(dest, dest.device, input_of(arg_uops[0], lane), read=False, written=True),
                    Argument(src, src.device, input_of(arg_uops[1], lane), read=True, written=False)], device_vars))
            yield Call(True, call.src[1].device, launches)
            continue
        info = ast.arg  # ProgramInfo
        lanes = unwrap_multi(call, [resolved[i] for i in info.globals])
        devices = call.src[1].device if isinstance(call.src[1].device, tuple) else (call.src[1].device,)
        launches = [Launch(device, [Argument(buf, buf.device, input_of(arg_uops[i], lane), read=i in info.ins or
                                             i not in info.outs, written=i in info.outs)
                                    for i, buf in zip(info.globals, bufs)], device_vars)
                    for lane, (device, (bufs, device_vars)) in enumerate(zip(devices, lanes))]
        yield Call(False, call.src[1].device, launches, ast, tuple(info.global_size), tuple(v.expr for v in info.vars),
                   len(info.globals) + len(info.vars))


def input_of(b: UOp, lane: int) -> tuple[int, int] | None:
    """(input slot, shard) `lane` reads through `b` (shard -1: whole); None: the graph's own buffer."""
    if b.op is Ops.PARAM:
        return b.arg.slot, (lane if isinstance(b.device, tuple) else -1)
    if b.op is Ops.MSELECT and b.src[0].op is Ops.PARAM:  # one device's part of a split input
        return b.src[0].arg.slot, b.arg
    if b.op is Ops.SHRINK and b.src[0].op is Ops.PARAM:  # a view of an input: its offset stays in the patch
        if any(s.op is not Ops.CONST for s in b.src[1:]):
            raise UnsupportedCall("a view of an input with a symbolic offset")
        return input_of(b.src[0], lane)
    if b.op is Ops.MSTACK:  # one buffer per device, stacked: this lane's is a buffer on one device
        return input_of(b.src[lane], 0)
    return None


def loaded_program(device: str, program: UOp) -> tuple[Any, int | None]:
    """(tinygrad's loaded program, its entry address where it is a plain C function, else None)."""
    runtime = get_runtime(device, program)
    if getattr(runtime, "lvp", True) or not hasattr(runtime, "addr"):
        return runtime, None
    return runtime, runtime.addr


def compiled_object(program: UOp) -> tuple[bytes, str]:
    """(compiled object, entry name) of a compiled PROGRAM uop."""
    elf = program.to_elf()
    return elf.lib, elf.name
