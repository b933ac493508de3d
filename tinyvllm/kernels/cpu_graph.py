"""Replaying a captured TinyJit on the CPU with one C call: the CPU's answer to CUDA graphs.

vLLM captures each decode batch size as a CUDA graph so that a step is one launch instead of hundreds
(vllm/worker/model_runner.py, `CUDAGraphRunner`). tinygrad does the same on GPUs (its GraphRunner batches a
TinyJit's kernels into a CUDA graph or a Metal command buffer), but on the CPU device of tinygrad 0.14 a
replay is a Python loop: for every kernel, resolve its buffers, build the argument list, call it through
ctypes. Measured on a 2-core x86 machine: ~25 us per kernel, ~490 kernels per decode step of SmolLM2-135M,
10-15 ms of a ~50 ms step.

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
addresses are written once. Anything the table cannot express (a copy between devices, a kernel with more
than 24 arguments) makes `GraphedJit` keep tinygrad's own replay, so it is correct everywhere and only faster
where it applies. Which devices it applies to is the device table's call (tinyvllm/platforms.py, `cpu_graph`):
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
from typing import Any

import numpy as np
from tinygrad import UOp

from tinyvllm.platforms import platform_for
from tinyvllm.tinygrad_adapter import (
    CapturedJit,
    JitBase,
    JitError,
    Ops,
    buffer_address,
    buffer_nbytes,
    capture_on_next_call,
    compiled_object,
    count_replay,
    get_call_arg_uops,
    get_runtime,
    inputs_written_by,
    is_replaying,
    jit_inputs,
    resolve_params,
)

ENABLED = os.getenv("TINYVLLM_CPU_GRAPH", "1") != "0"
MAX_ARGS = 24  # TV_GRAPH_MAX_ARGS in kernels/cpu/graph_runner.c


class NotGraphable(Exception):
    """The captured linear holds something the C table cannot run; tinygrad's own replay is used instead."""


def _input_slot(b: UOp) -> int | None:
    """Which JIT input an argument of a call reads (None: a buffer the graph owns)."""
    if b.op is Ops.PARAM:
        return b.arg.slot
    if b.op in (Ops.MSELECT, Ops.SHRINK) and b.src[0].op is Ops.PARAM:
        if b.op is Ops.SHRINK and any(s.op is not Ops.CONST for s in b.src[1:]):
            raise NotGraphable("a view of an input with a symbolic offset")
        return b.src[0].arg.slot
    if b.op is Ops.MSTACK:
        raise NotGraphable("a multi-device input")
    return None


_runner = None


def _graph_runner():
    global _runner
    if _runner is None:
        from tinyvllm.kernels.launcher import compile_host_program
        _runner = compile_host_program("graph_runner", {})
    return _runner


class CPUGraph:
    """One captured linear as a table that kernels/cpu/graph_runner.c calls through."""

    def __init__(self, captured: CapturedJit, input_uops: list[UOp], var_vals: dict[str, int], describe: bool = False):
        table: list[int] = []
        input_patches: list[tuple[int, int, int]] = []  # (table index, input slot, byte offset into that input)
        var_patches: list[tuple[int, str]] = []  # (table index, variable name)
        self._programs: list[Any] = []  # keep the compiled kernels (their code) alive as long as the table
        self.num_calls = 0  # entries in the table
        input_addrs = [buffer_address(u, u.device) for u in input_uops]
        # describe=True: what each table entry is, for kernels/graph_cache.py to write the graph to disk:
        #   self.objects  [(compiled object, entry name)], one per distinct program
        #   self.calls    [(table index of the function address, index into objects,
        #                   [(table index, address, bytes, read, written)] for each buffer that is not an input)]
        self.objects: list[tuple[bytes, str]] = []
        self.calls: list[tuple[int, int, list[tuple[int, int, int, bool, bool]]]] = []
        object_index: dict[int, int] = {}
        for call in captured.linear.src:
            ast = call.src[0]
            if ast.op is not Ops.PROGRAM:
                raise NotGraphable(f"a {ast.op} call (only compiled kernels go into the table)")
            device = call.src[1].device
            if not isinstance(device, str) or device.split(":")[0] != "CPU":
                raise NotGraphable(f"a kernel on {device}")
            program = get_runtime(device, ast)
            if getattr(program, "lvp", True) or not hasattr(program, "addr"):
                raise NotGraphable("a CPU program that is not a plain C function")
            info = ast.arg
            if not all(isinstance(s, int) for s in info.global_size):
                raise NotGraphable("a kernel whose number of core_ids depends on a variable")
            num_args = len(info.globals) + len(info.vars)
            if num_args > MAX_ARGS:
                raise NotGraphable(f"a kernel with {num_args} arguments (at most {MAX_ARGS})")
            self._programs.append(program)
            arg_uops, resolved = get_call_arg_uops(call), resolve_params(call, input_uops)
            if describe and id(program) not in object_index:
                object_index[id(program)] = len(self.objects)
                self.objects.append(compiled_object(ast))
            for core_id in range(info.global_size[0]):  # tinygrad calls a core_id kernel once per core_id
                self.num_calls += 1
                buffers: list[tuple[int, int, int, bool, bool]] = []
                if describe:
                    self.calls.append((len(table), object_index[id(program)], buffers))
                table += [program.addr, num_args]
                for i in info.globals:
                    addr = buffer_address(resolved[i], device)
                    if (slot := _input_slot(arg_uops[i])) is not None:
                        input_patches.append((len(table), slot, addr - input_addrs[slot]))
                    elif describe:
                        buffers.append((len(table), addr, buffer_nbytes(resolved[i]),
                                        i in info.ins or i not in info.outs, i in info.outs))
                    table.append(addr)
                for v in info.vars:
                    if v.expr == "core_id":
                        table.append(core_id)
                    else:
                        var_patches.append((len(table), v.expr))
                        table.append(var_vals[v.expr])
        self._set_table(table, input_patches, var_patches)

    def _set_table(self, table: list[int], input_patches: list[tuple[int, int, int]],
                   var_patches: list[tuple[int, str]]) -> None:
        self.table = np.array(table, dtype=np.int64)
        self.input_index = np.array([p[0] for p in input_patches], dtype=np.int64)
        self.input_slot = np.array([p[1] for p in input_patches], dtype=np.int64)
        self.input_offset = np.array([p[2] for p in input_patches], dtype=np.int64)
        self.var_names = sorted({name for _, name in var_patches})
        self.var_index = np.array([p[0] for p in var_patches], dtype=np.int64)
        self.var_which = np.array([self.var_names.index(name) for _, name in var_patches], dtype=np.int64)
        self._runner = _graph_runner()

    @classmethod
    def from_table(cls, table: list[int], num_calls: int, programs: list[Any],
                   input_patches: list[tuple[int, int, int]], var_patches: list[tuple[int, str]]) -> CPUGraph:
        """A graph from a table filled elsewhere (kernels/graph_cache.py: read back from disk)."""
        graph = cls.__new__(cls)
        graph._programs, graph.num_calls, graph.objects, graph.calls = programs, num_calls, [], []
        graph._set_table(table, input_patches, var_patches)
        return graph

    def __call__(self, input_uops: list[UOp], var_vals: dict[str, int]) -> None:
        addrs = np.array([buffer_address(u, u.device) for u in input_uops], dtype=np.int64)
        self.table[self.input_index] = addrs[self.input_slot] + self.input_offset
        if len(self.var_names):
            self.table[self.var_index] = np.array([var_vals[n] for n in self.var_names], dtype=np.int64)[self.var_which]
        self._runner.fxn(ctypes.c_uint64(self.table.ctypes.data), ctypes.c_uint64(self.num_calls))


def _uses_cpu_graph(input_uops: list[UOp]) -> bool:
    """Does the device table let the inputs' device replay through a CPUGraph? (No inputs: the default device.)"""
    devices = {u.device for u in input_uops}
    if any(not isinstance(d, str) for d in devices) or len(devices) > 1:
        return False  # several devices: tinygrad's replay
    return platform_for(devices.pop() if devices else None).cpu_graph


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
        if capture_first:
            capture_on_next_call(self)

    def reset(self) -> None:
        super().reset()
        self.graph, self.loaded = None, None
        if self.capture_first:
            capture_on_next_call(self)

    def __call__(self, *args, **kwargs):
        if self.graph is None and not is_replaying(self) and not _uses_cpu_graph(jit_inputs(args, kwargs)[0]):
            self.graph, self.persist = False, None  # decided once, at the first call: tinygrad's TinyJit from here on
        if self.persist is not None and not is_replaying(self):
            input_uops, var_vals, names, input_info = jit_inputs(args, kwargs)
            if self.loaded is None:
                self.loaded = self.persist.load(names, input_info) or False  # False: looked, nothing usable
            if self.loaded and self.loaded.accepts(names, input_info):
                self.loaded.graph(input_uops, var_vals)
                return self.loaded.ret
            ret = super().__call__(*args, **kwargs)  # captures
            if is_replaying(self) and not inputs_written_by(self.captured, input_uops):
                try:
                    self.graph = CPUGraph(self.captured, input_uops, var_vals, describe=True)
                except NotGraphable:
                    self.graph = False
                else:
                    self.persist.save(self.graph, self.captured.ret, names, input_info)
            return ret
        if not is_replaying(self) or self.graph is False or not ENABLED:
            return super().__call__(*args, **kwargs)
        captured = self.captured
        input_uops, var_vals, names, input_info = jit_inputs(args, kwargs)
        if captured.expected_names != names or captured.expected_input_info != input_info:
            raise JitError(f"args mismatch in JIT: expected {captured.expected_names}, {captured.expected_input_info}; "
                           f"got {names}, {input_info}")
        if inputs_written_by(captured, input_uops):  # tinygrad copies such inputs first: keep its path
            self.graph = False
            return super().__call__(*args, **kwargs)
        if self.graph is None:
            try:
                self.graph = CPUGraph(captured, input_uops, var_vals)
            except NotGraphable:
                self.graph = False
                return super().__call__(*args, **kwargs)
        self.graph(input_uops, var_vals)
        count_replay(self)
        return captured.ret
