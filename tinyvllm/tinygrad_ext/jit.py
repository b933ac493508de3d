"""TinyJit's capture and replay: `JitBase`, tinygrad's TinyJit as a class to subclass, and what it captured, read as
calls and launches (kernels/cpu_graph.py replays a capture through a table built from them).

The public `TinyJit` is a function that returns a `tinygrad.engine.jit._TinyJit`, which counts its calls in `cnt`:

    cnt 0   runs the function eagerly            (JitBase.capture_on_next_call skips this call)
    cnt 1   captures: `captured`, a CapturedJit  (the calls it made, the inputs it expects, what it returned)
    cnt 2+  replays the capture with the call's input buffers

A capture (`CapturedJit.linear`) is a list of CALL uops, each a compiled kernel (a PROGRAM) or a copy between
devices (a COPY) over buffers: the graph's own, or PARAMs that stand for the JIT's inputs. tinygrad's replay
(`exec_kernel`, `exec_copy` in tinygrad/engine/realize.py) launches each once per device it runs on:

    CALL(PROGRAM matmul, out, PARAM 0, w) on (CPU, CPU:1)  ->  Call(copy=False, program=matmul, launches=[
                                                                 Launch("CPU",   [out0, input (0, shard 0), w0]),
                                                                 Launch("CPU:1", [out1, input (0, shard 1), w1])])

Chapter: docs/phases/01-appendix-tinygrad-speed.md (TinyJit, and a CPU graph).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tinygrad import UOp
from tinygrad.engine.jit import JitError, _prepare_jit_inputs, _TinyJit
from tinygrad.engine.realize import get_call_arg_uops, get_runtime, resolve_params, unwrap_multi
from tinygrad.uop.ops import Ops

from tinyvllm.tinygrad_ext.buffers import buffer_address

class JitBase(_TinyJit):
    """tinygrad's TinyJit, with what a subclass that replays the capture itself needs, by name."""

    def capture_on_next_call(self) -> None:
        """Skip the eager first call: the next call captures (sets `cnt` to 1)."""
        self.cnt = 1

    def is_replaying(self) -> bool:
        """Has this JIT captured, so that its next call replays? (`cnt` >= 2 and a capture; JIT=0 never captures)"""
        return self.cnt >= 2 and self.captured is not None

    def count_replay(self) -> None:
        """Count a replay done outside `_TinyJit.__call__`, as that method would (`cnt += 1`)."""
        self.cnt += 1

    def replay_with_tinygrad(self, input_uops: list[UOp], var_vals: dict[str, int]) -> Any:
        """Replay the capture with tinygrad's own runner (`CapturedJit.__call__`, which first copies any input the
        graph writes), counted as `_TinyJit.__call__` counts a replay; returns the captured return value."""
        ret = self.captured(input_uops, var_vals)
        self.count_replay()
        return ret

    def captured_return(self) -> Any:
        """What the captured function returned: the tensors every replay returns again (`CapturedJit.ret`)."""
        return self.captured.ret

    def check_inputs(self, names: list, input_info: list) -> None:
        """Raise tinygrad's JitError unless these are the inputs the graph was captured with, as a replay checks."""
        captured = self.captured
        if captured.expected_names != names or captured.expected_input_info != input_info:
            raise JitError(f"args mismatch in JIT: expected {captured.expected_names}, {captured.expected_input_info}; "
                           f"got {names}, {input_info}")

    def writes_inputs(self, input_uops: list[UOp]) -> bool:
        """Does the captured graph write one of these inputs? tinygrad then copies the input first (its private
        `CapturedJit._written_uops`), which a replay outside tinygrad would not do."""
        return any(u in self.captured._written_uops for u in input_uops)


def jit_inputs(args: tuple, kwargs: dict) -> tuple[list[UOp], dict[str, int], list, list]:
    """(input buffer uops, variable values, names, input info) of a call, as `_TinyJit.__call__` computes them
    (`tinygrad.engine.jit._prepare_jit_inputs`): the same checks, and the same realization of the inputs."""
    return _prepare_jit_inputs(args, kwargs)


# ---- what a capture holds ----

class UnsupportedCall(Exception):
    """A captured call this module cannot describe: neither a compiled kernel nor a copy, or one that reads an input
    through a view whose offset is symbolic."""


@dataclass(frozen=True)
class Argument:
    """One buffer a launch passes to its kernel (or copy), in order."""

    buffer: Any = field(repr=False)  # tinygrad's Buffer (or a view of one) on one device
    device: str
    input: tuple[int, int] | None  # (JIT input slot, shard: -1 a whole input, else a device's part); None: the graph's
    read: bool
    written: bool

    @property
    def address(self) -> int:
        """Where the buffer is now (allocated here if it is not yet)."""
        return buffer_address(self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes


@dataclass(frozen=True)
class Launch:
    """One launch of a call on one device: its buffers, and the variables bound per device (`_device_num`)."""

    device: str
    arguments: list[Argument]
    device_vars: dict[str, int]


@dataclass(frozen=True)
class Call:
    """One call of a capture, launched once per device it runs on (a copy: arguments [dest, src])."""

    copy: bool
    devices: str | tuple[str, ...]
    launches: list[Launch]
    program: UOp | None = None  # a kernel's compiled PROGRAM: `loaded_program`, `compiled_object`
    global_size: tuple = (1, 1, 1)  # a kernel's: the CPU runtime calls it once per core_id, global_size[0] times
    variables: tuple[str, ...] = ()  # a kernel's variable arguments, after its buffers, by name
    num_args: int = 0  # a kernel's: buffers and variables


def captured_calls(jit: JitBase, input_uops: list[UOp]) -> Iterator[Call]:
    """The calls `jit` captured, in order, each with the buffers tinygrad's replay would launch it on for these
    inputs (`resolve_params`, `unwrap_multi` in tinygrad.engine.realize: one launch per device, in device order;
    a kernel's buffers those of its `globals`). Raises UnsupportedCall at a call it cannot describe."""
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
        info = ast.arg  # ProgramInfo: which arguments are buffers (globals), which it writes (outs) and reads (ins)
        lanes = unwrap_multi(call, [resolved[i] for i in info.globals])
        devices = call.src[1].device if isinstance(call.src[1].device, tuple) else (call.src[1].device,)
        launches = [Launch(device, [Argument(buf, buf.device, input_of(arg_uops[i], lane), read=i in info.ins or
                                             i not in info.outs, written=i in info.outs)
                                    for i, buf in zip(info.globals, bufs)], device_vars)
                    for lane, (device, (bufs, device_vars)) in enumerate(zip(devices, lanes))]
        yield Call(False, call.src[1].device, launches, ast, tuple(info.global_size), tuple(v.expr for v in info.vars),
                   len(info.globals) + len(info.vars))


def input_of(b: UOp, lane: int) -> tuple[int, int] | None:
    """Which JIT input device `lane`'s launch of a call reads through argument `b`, as (input slot, shard): shard -1
    for an input on one device, else the index of the device whose part of a split input it reads. None: a buffer
    the graph owns."""
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
    """(tinygrad's loaded program for `program` on `device`, the address of its function): the program tinygrad's
    own replay calls (`get_runtime`, cached per program and device), and its entry's address where it is a plain C
    function (a `CPUProgram` not built for Mesa's llvmpipe, LVP); None otherwise."""
    runtime = get_runtime(device, program)
    if getattr(runtime, "lvp", True) or not hasattr(runtime, "addr"):
        return runtime, None
    return runtime, runtime.addr


def compiled_object(program: UOp) -> tuple[bytes, str]:
    """(compiled object, entry name) of a compiled PROGRAM uop (`UOp.to_elf`): what `programs.load_cpu_program`
    loads again in another process."""
    elf = program.to_elf()
    return elf.lib, elf.name
