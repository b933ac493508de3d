"""Replaying a captured TinyJit on the CPU with one C call: the CPU's answer to CUDA graphs.

vLLM captures each decode batch size as a CUDA graph so that a step is one launch instead of hundreds
(vllm/worker/model_runner.py, `CUDAGraphRunner`). tinygrad does the same on GPUs (its GraphRunner batches a
TinyJit's kernels into a CUDA graph or a Metal command buffer), but on the CPU device of tinygrad 0.14 a
replay is a Python loop: for every kernel, resolve its buffers, build the argument list, call it through
ctypes. A decode step of SmolLM2-135M is ~490 kernels, so that Python per kernel adds up to a sizeable share
of the step (benchmarks/README.md measures it).

`GraphedJit` is a TinyJit that, once it has captured, builds a `CPUGraph`: a flat table of
[function address, argument count, arguments...] for every kernel in the captured order, run by the C loop
in kernels/cpu/graph_runner.c. Per step, Python only patches what changes and makes one call:

    captured linear (tinygrad)             CPUGraph.table (int64)                       per step
    CALL matmul(out, x=PARAM 0, w)   ->    [&matmul, 3, &out, &x, &w]                   &x <- new input 0
    CALL rope(q, positions=PARAM 1)  ->    [&rope, 2, &q, &positions]                   &positions <- new input 1
    CALL attn(..., num_blocks)       ->    [&attn, 6, ..., num_blocks]                  num_blocks <- its value
                                                    |
                                           graph_runner(table, num_calls): one ctypes call for the step

The buffers the graph owns (weights, KV cache, intermediates planned by the JIT) never move, so their
addresses are written once. A model split over several CPU devices (Phase 8: CPU, CPU:1, ...) replays the same
way: a kernel on N devices is N entries, one per device's buffers, and a copy between devices is an entry that
calls memmove (every CPU device's memory is the host's):

    CALL matmul on (CPU, CPU:1)      ->    [&matmul, 3, &out0, &x0, &w0] [&matmul, 3, &out1, &x1, &w1]
    COPY CPU:1 <- CPU                ->    [&memmove, 3, &dest, &src, bytes]

Anything the table cannot express (a kernel with more than 24 arguments, a call on a device whose memory is not
the host's) makes `GraphedJit` keep tinygrad's own replay, so it is correct everywhere and only faster where
it applies. Which devices it applies to is the device table's call (tinyvllm/platforms.py, `cpu_graph`):
the CPU, unless forced onto the discrete path. Everywhere else `GraphedJit` is tinygrad's TinyJit, which
replays a step as one CUDA graph (Metal: an indirect command buffer). `TINYVLLM_CPU_GRAPH=0` turns it off.

`GraphedJit` also captures on its first call (`capture_first=True`). A plain TinyJit runs the function
eagerly once, captures on the second call and replays from the third: for a graph whose weights and caches
are realized before the first call, the eager run only builds and schedules the graph a second time, seconds
of Python on a large model before the first token.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, UOp

from tinyvllm.platforms import platform_for
from tinyvllm.tinygrad_adapter import (
    CapturedJit,
    JitBase,
    JitError,
    Ops,
    buffer_address,
    call_launches,
    capture_on_next_call,
    compiled_object,
    count_replay,
    get_call_arg_uops,
    get_runtime,
    input_shard_address,
    inputs_written_by,
    is_replaying,
    jit_inputs,
    replay_captured,
)

ENABLED = os.getenv("TINYVLLM_CPU_GRAPH", "1") != "0"
MAX_ARGS = 24  # TV_GRAPH_MAX_ARGS in kernels/cpu/graph_runner.c


class NotGraphable(Exception):
    """The captured linear holds something the C table cannot run; tinygrad's own replay is used instead."""


def _input_of(b: UOp, lane: int) -> tuple[int, int] | None:
    """Which JIT input device `lane`'s launch of a call reads through argument `b`, as (input slot, shard): shard -1
    for an input on one device, else the index of the device whose part of a split input it reads. None: a buffer
    the graph owns."""
    if b.op is Ops.PARAM:
        return b.arg.slot, (lane if isinstance(b.device, tuple) else -1)
    if b.op is Ops.MSELECT and b.src[0].op is Ops.PARAM:  # one device's part of a split input
        return b.src[0].arg.slot, b.arg
    if b.op is Ops.SHRINK and b.src[0].op is Ops.PARAM:  # a view of an input: its offset stays in the patch
        if any(s.op is not Ops.CONST for s in b.src[1:]):
            raise NotGraphable("a view of an input with a symbolic offset")
        return _input_of(b.src[0], lane)
    if b.op is Ops.MSTACK:  # one buffer per device, stacked: this lane's is a buffer on one device
        return _input_of(b.src[lane], 0)
    return None


def _is_host_device(device: Any) -> bool:
    """A CPU device (CPU, CPU:1, ...): its buffers are host memory, its programs plain C functions."""
    return isinstance(device, str) and device.split(":")[0] == "CPU"


# The copies between devices are entries of the table like the kernels': C's memmove(dest, src, bytes) from the C
# library Python itself uses (ctypes.memmove is a ctypes function object pointing at it), entered with 3 arguments.
MEMMOVE = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value

_runner = None


def _graph_runner():
    global _runner
    if _runner is None:
        from tinyvllm.kernels.launcher import compile_host_program
        _runner = compile_host_program("graph_runner", {})
    return _runner


class CPUGraph:
    """One captured linear as a table that kernels/cpu/graph_runner.c calls through.

    A captured step of a model split over several CPU devices (tensor or pipeline parallel: CPU, CPU:1, ...) fits
    the same table: a call on N devices is N entries, one per device with that device's buffers (tinygrad launches
    them one after another too), and a COPY between devices (an input copied to each device, the all-reduce's
    partial sums, the logits gathered onto the first) is a memmove entry; every CPU device's memory is the host's."""

    def __init__(self, captured: CapturedJit, input_uops: list[UOp], var_vals: dict[str, int], describe: bool = False):
        table: list[int] = []
        input_patches: list[tuple[int, int, int, int]] = []  # (table index, input slot, shard, byte offset into it)
        var_patches: list[tuple[int, str]] = []  # (table index, variable name)
        self._programs: list[Any] = []  # keep the compiled kernels (their code) alive as long as the table
        self.num_calls = 0  # entries in the table
        self.num_copies = 0  # of which copies between devices
        input_addrs: dict[tuple[int, int], int] = {}  # (slot, shard) -> address at capture
        # describe=True: what each table entry is, for kernels/graph_cache.py to write the graph to disk (graphs on
        # one device only: the cache does not keep multi-device graphs):
        #   self.objects  [(compiled object, entry name)], one per distinct program
        #   self.calls    [(table index of the function address, index into objects,
        #                   [(table index, address, bytes, read, written)] for each buffer that is not an input)]
        self.objects: list[tuple[bytes, str]] = []
        self.calls: list[tuple[int, int, list[tuple[int, int, int, bool, bool]]]] = []
        object_index: dict[int, int] = {}

        def add_arg(u: UOp, buf: Any, lane: int, buffers: list | None, read: bool, written: bool) -> None:
            addr = buffer_address(buf)
            if (key := _input_of(u, lane)) is not None:
                if key not in input_addrs:
                    input_addrs[key] = input_shard_address(input_uops[key[0]], key[1])
                input_patches.append((len(table), *key, addr - input_addrs[key]))
            elif buffers is not None:
                buffers.append((len(table), addr, buf.nbytes, read, written))
            table.append(addr)

        for call in captured.linear.src:
            ast = call.src[0]
            if ast.op not in (Ops.PROGRAM, Ops.COPY):
                raise NotGraphable(f"a {ast.op} call (only compiled kernels and copies go into the table)")
            launches = call_launches(call, input_uops)
            if describe and (len(launches) > 1 or ast.op is Ops.COPY):
                raise NotGraphable("a graph over several devices (kernels/graph_cache.py keeps one device's graphs)")
            if not all(_is_host_device(b.device) for _, bufs, _ in launches for b in bufs):
                raise NotGraphable(f"a call on {call.src[1].device} (only CPU devices' memory is the host's)")
            arg_uops = get_call_arg_uops(call)
            if ast.op is Ops.COPY:  # dest, src: as tinygrad's exec_copy, the destination's bytes
                for lane, (_, (dest, src), _) in enumerate(launches):
                    self.num_calls += 1
                    self.num_copies += 1
                    table += [MEMMOVE, 3]
                    add_arg(arg_uops[0], dest, lane, None, False, True)
                    add_arg(arg_uops[1], src, lane, None, True, False)
                    table.append(dest.nbytes)
                continue
            info = ast.arg
            if not all(isinstance(s, int) for s in info.global_size):
                raise NotGraphable("a kernel whose number of core_ids depends on a variable")
            num_args = len(info.globals) + len(info.vars)
            if num_args > MAX_ARGS:
                raise NotGraphable(f"a kernel with {num_args} arguments (at most {MAX_ARGS})")
            globals_uops = [arg_uops[i] for i in info.globals]
            for lane, (device, bufs, device_vars) in enumerate(launches):
                program = get_runtime(device, ast)
                if getattr(program, "lvp", True) or not hasattr(program, "addr"):
                    raise NotGraphable("a CPU program that is not a plain C function")
                self._programs.append(program)
                if describe and id(program) not in object_index:
                    object_index[id(program)] = len(self.objects)
                    self.objects.append(compiled_object(ast))
                for core_id in range(info.global_size[0]):  # tinygrad calls a core_id kernel once per core_id
                    self.num_calls += 1
                    buffers: list[tuple[int, int, int, bool, bool]] = []
                    if describe:
                        self.calls.append((len(table), object_index[id(program)], buffers))
                    table += [program.addr, num_args]
                    for i, u, buf in zip(info.globals, globals_uops, bufs):
                        add_arg(u, buf, lane, buffers if describe else None, i in info.ins or i not in info.outs,
                                i in info.outs)
                    for v in info.vars:
                        if v.expr == "core_id":
                            table.append(core_id)
                        elif v.expr in device_vars:  # `_device_num`: which device this launch is, fixed per entry
                            table.append(device_vars[v.expr])
                        else:
                            var_patches.append((len(table), v.expr))
                            table.append(var_vals[v.expr])
        self._set_table(table, input_patches, var_patches)

    def _set_table(self, table: list[int], input_patches: list[tuple[int, int, int, int]],
                   var_patches: list[tuple[int, str]]) -> None:
        self.table = np.array(table, dtype=np.int64)
        self.input_index = np.array([p[0] for p in input_patches], dtype=np.int64)
        self.input_slot = np.array([p[1] for p in input_patches], dtype=np.int64)
        self.input_offset = np.array([p[3] for p in input_patches], dtype=np.int64)
        # the inputs' buffers whose addresses a call looks up: (slot, shard), shard -1 for a whole input
        self.input_keys = sorted({(p[1], p[2]) for p in input_patches})
        self.input_which = np.array([self.input_keys.index((p[1], p[2])) for p in input_patches], dtype=np.int64)
        self.var_names = sorted({name for _, name in var_patches})
        self.var_index = np.array([p[0] for p in var_patches], dtype=np.int64)
        self.var_which = np.array([self.var_names.index(name) for _, name in var_patches], dtype=np.int64)
        self._runner = _graph_runner()
        # the C call's arguments: the table is patched in place, so its address never changes
        self._args = (ctypes.c_uint64(self.table.ctypes.data), ctypes.c_uint64(self.num_calls))
        self._patched_for: list[UOp] | None = None  # the input uops whose addresses the table holds now
        self._var_values: tuple[int, ...] | None = None  # the variables' values the table holds now

    @classmethod
    def from_table(cls, table: list[int], num_calls: int, programs: list[Any],
                   input_patches: list[tuple[int, int, int]], var_patches: list[tuple[int, str]]) -> CPUGraph:
        """A graph from a table filled elsewhere (kernels/graph_cache.py: read back from disk; one device, so every
        input patch is (table index, input slot, byte offset) into a whole input)."""
        graph = cls.__new__(cls)
        graph._programs, graph.num_calls, graph.num_copies, graph.objects, graph.calls = programs, num_calls, 0, [], []
        graph._set_table(table, [(index, slot, -1, offset) for index, slot, offset in input_patches], var_patches)
        return graph

    def __call__(self, input_uops: list[UOp], var_vals: dict[str, int]) -> None:
        """Patch what changed since the last call, then run the table. A step passes the same input list as the
        step before (`JitInputs` hands out the same one for the same tensors, whose buffers never move): the
        addresses are then already in the table; a variable (`num_blocks`) changes once per block of tokens."""
        if input_uops is not self._patched_for:
            addrs = np.array([input_shard_address(input_uops[slot], shard) for slot, shard in self.input_keys],
                             dtype=np.int64)
            self.table[self.input_index] = addrs[self.input_which] + self.input_offset
            self._patched_for = input_uops
        values = tuple(var_vals[name] for name in self.var_names)
        if values != self._var_values:
            self.table[self.var_index] = np.array(values, dtype=np.int64)[self.var_which]
            self._var_values = values
        self._runner.fxn(*self._args)


@dataclass(eq=False)
class JitCallInputs:
    """A JIT call's input buffer uops, names and input info, as `_TinyJit.__call__` finds them: one object for as long
    as the tensors are the same (`JitInputs`), so a check made once on it holds for every such call."""

    uops: list[UOp]
    names: list
    input_info: list


class JitInputs:
    """One JIT's call inputs, prepared as `_TinyJit.__call__` does (`jit_inputs`: its checks, unrealized inputs
    realized) and remembered. A step passes the same tensors every time (persistent input buffers, the forward graph's
    returned logits); only a bound variable changes (`num_blocks`). tinygrad prepares each call anew, two graph
    rewrites per tensor: most of a replay's Python. A call whose tensors have the very uops of the last (uops are
    hash-consed) reuses its `JitCallInputs`; only the variables passed beside the tensors are read again."""

    def __init__(self):
        self._key: tuple | None = None  # per argument: its tensor's uop, or its bound variable's variable
        self._prepared: JitCallInputs | None = None
        self._input_var_vals: dict[str, int] = {}  # the variables the input tensors' own views bind

    def __call__(self, args: tuple, kwargs: dict) -> tuple[JitCallInputs, dict[str, int]]:
        """(the call's inputs, the values of its variables by name)."""
        key, arg_var_vals = [], {}
        for a in args:
            if isinstance(a, Tensor):
                key.append(a.uop)
            elif isinstance(a, UOp):
                var, value = a.unbind()
                key.append(var)
                arg_var_vals[var.expr] = value
            else:
                key = None  # another kind of argument (a container of tensors): prepared in full every time
                break
        if key is None or kwargs or tuple(key) != self._key:
            uops, var_vals, names, input_info = jit_inputs(args, kwargs)
            prepared = JitCallInputs(uops, names, input_info)
            if key is not None and not kwargs:  # the tensors' uops now, once realized
                self._key = tuple(a.uop if isinstance(a, Tensor) else k for a, k in zip(args, key))
                self._prepared = prepared
                self._input_var_vals = {k: v for k, v in var_vals.items() if k not in arg_var_vals}
            return prepared, var_vals
        return self._prepared, {**self._input_var_vals, **arg_var_vals}


def _uses_cpu_graph(input_uops: list[UOp]) -> bool:
    """Does the device table let the inputs' devices replay through a CPUGraph? (No inputs: the default device.)
    Inputs on several devices (a split tensor, or inputs on different devices) qualify when every one of them does."""
    devices = {d for u in input_uops for d in (u.device if isinstance(u.device, tuple) else (u.device,))}
    if any(not isinstance(d, str) for d in devices):
        return False
    return all(platform_for(d).cpu_graph for d in devices) if devices else platform_for(None).cpu_graph


class GraphedJit(JitBase):
    """TinyJit that captures on the first call and replays through a `CPUGraph` where the device table says the
    device uses one and the graph fits (see module doc); elsewhere tinygrad's own replay (CUDA graphs on CUDA).

    `persist` (a `kernels.graph_cache.PersistedGraph`): the graph is also written to disk once built, and a later
    process whose first call finds it there replays it at once, without tracing, scheduling or capturing."""

    def __init__(self, fxn, capture_first: bool = True, persist=None):
        super().__init__(fxn)
        self.capture_first = capture_first
        self.graph: CPUGraph | None | bool = None  # None: not built yet; False: not graphable (or not this device)
        self.persist = persist if ENABLED else None
        self.loaded = None  # a graph_cache.LoadedGraph: replayed until this JIT captures one of its own
        self.inputs = JitInputs()  # each call's inputs, prepared once for as long as they are the same tensors
        self._checked: JitCallInputs | None = None  # the inputs last found to match the graph replayed
        self.ran_in_c = False  # did the last call run its kernels in the C table? (then they are done when it returns)
        if capture_first:
            capture_on_next_call(self)

    def reset(self) -> None:
        super().reset()
        self.graph, self.loaded, self._checked = None, None, None
        if self.capture_first:
            capture_on_next_call(self)

    def __call__(self, *args, **kwargs):
        self.ran_in_c = False
        inputs, var_vals = self.inputs(args, kwargs)
        if self.graph is None and not is_replaying(self) and self.loaded is None and not _uses_cpu_graph(inputs.uops):
            self.graph, self.persist = False, None  # decided once, at the first call: tinygrad's TinyJit from here on
        if self.persist is not None and not is_replaying(self):
            if self.loaded is None:
                self.loaded = self.persist.load(inputs.names, inputs.input_info) or False  # False: nothing usable
            if self.loaded and (inputs is self._checked or self.loaded.accepts(inputs.names, inputs.input_info)):
                self._checked = inputs
                self.loaded.graph(inputs.uops, var_vals)
                self.ran_in_c = True
                return self.loaded.ret
            self._checked = None
            ret = super().__call__(*args, **kwargs)  # captures
            if is_replaying(self) and not inputs_written_by(self.captured, inputs.uops):
                try:
                    self.graph = CPUGraph(self.captured, inputs.uops, var_vals, describe=True)
                except NotGraphable:
                    self.graph = False
                else:
                    self.persist.save(self.graph, self.captured.ret, inputs.names, inputs.input_info)
            return ret
        if not is_replaying(self):
            return super().__call__(*args, **kwargs)  # runs eagerly, or captures
        if inputs is not self._checked:  # as tinygrad checks every replay; once per distinct inputs here
            self._check(inputs)
            self._checked = inputs
        if self.graph is None and ENABLED:
            try:
                self.graph = CPUGraph(self.captured, inputs.uops, var_vals)
            except NotGraphable:
                self.graph = False
        if not self.graph:  # tinygrad's own replay, with the inputs prepared here
            return replay_captured(self, inputs.uops, var_vals)
        self.graph(inputs.uops, var_vals)
        count_replay(self)
        self.ran_in_c = True
        return self.captured.ret

    def _check(self, inputs: JitCallInputs) -> None:
        """The inputs must be those the graph was captured with (tinygrad's JitError otherwise). An input the graph
        writes makes tinygrad copy it first: then only tinygrad's own replay is right."""
        captured = self.captured
        if captured.expected_names != inputs.names or captured.expected_input_info != inputs.input_info:
            raise JitError(f"args mismatch in JIT: expected {captured.expected_names}, {captured.expected_input_info}; "
                           f"got {inputs.names}, {inputs.input_info}")
        if inputs_written_by(captured, inputs.uops):
            self.graph = False
