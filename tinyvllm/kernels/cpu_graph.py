"""Replaying a captured TinyJit on the CPU with one C call: the CPU's answer to CUDA graphs.

Chapter: docs/phases/01-appendix-tinygrad-speed.md (a CPU graph).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, UOp

from tinyvllm.kernels.scratch import Scratch, give_back, shared_scratch
from tinyvllm.platforms import platform_for
from tinyvllm.tinygrad_ext.buffers import buffer_address, input_shard_address
from tinyvllm.tinygrad_ext.jit import (
    Argument, JitBase, UnsupportedCall, arena_buffers, captured_calls, compiled_object, jit_inputs, loaded_program)

ENABLED = os.getenv("TINYVLLM_CPU_GRAPH", "1") != "0"
MAX_ARGS = 24  # TV_GRAPH_MAX_ARGS in kernels/cpu/graph_runner.c


class NotGraphable(Exception):
    """The captured linear holds something the C table cannot run; tinygrad's own replay is used instead."""


def _is_host_device(device: Any) -> bool:
    """A CPU device (CPU, CPU:1, ...)."""
    return isinstance(device, str) and device.split(":")[0] == "CPU"


# A copy between devices is a table entry calling C's memmove(dest, src, bytes).
MEMMOVE = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value

_runner = None


def _graph_runner():
    global _runner
    if _runner is None:
        from tinyvllm.kernels.launcher import compile_host_program
        _runner = compile_host_program("graph_runner", {})
    return _runner


class CPUGraph:
    """One captured linear as a table that kernels/cpu/graph_runner.c calls through."""

    def __init__(self, jit: JitBase, input_uops: list[UOp], var_vals: dict[str, int], describe: bool = False):
        table: list[int] = []
        input_patches: list[tuple[int, int, int, int]] = []  # (table index, input slot, shard, byte offset)
        var_patches: list[tuple[int, str]] = []  # (table index, variable name)
        self._programs: list[Any] = []  # keeps the compiled kernels alive as long as the table
        self.num_calls = 0
        self.num_copies = 0  # of which copies between devices
        input_addrs: dict[tuple[int, int], int] = {}  # (slot, shard) -> address at capture
        # describe=True (one device only), for graph_cache.py: self.objects [(compiled object, entry name)];
        # self.calls [(table index of the function, index into objects, [(table index, address, bytes, read, written)]
        # per non-input buffer)]
        self.objects: list[tuple[bytes, str]] = []
        self.calls: list[tuple[int, int, list[tuple[int, int, int, bool, bool]]]] = []
        object_index: dict[int, int] = {}
        # the capture's arenas move into the scratch every graph shares (kernels/scratch.py)
        arenas = [(buffer_address(b), b.nbytes) for b in arena_buffers(jit) if _is_host_device(b.device)]
        scratch = shared_scratch() if arenas else None
        moved_to = scratch.layout(arenas) if scratch is not None else None
        self.scratch = scratch if moved_to is not None else None

        def add_arg(arg: Argument, buffers: list | None) -> None:
            addr = arg.address
            if moved_to is not None:
                for (start, nbytes), new_start in zip(arenas, moved_to):
                    if start <= addr < start + nbytes:
                        addr += new_start - start
                        break
            if (key := arg.input) is not None:
                if key not in input_addrs:
                    input_addrs[key] = input_shard_address(input_uops[key[0]], key[1])
                input_patches.append((len(table), *key, addr - input_addrs[key]))
            elif buffers is not None:
                buffers.append((len(table), addr, arg.nbytes, arg.read, arg.written))
            table.append(addr)

        for call in captured_calls(jit, input_uops):
            if describe and (len(call.launches) > 1 or call.copy):
                raise NotGraphable("a graph over several devices (kernels/graph_cache.py keeps one device's graphs)")
            if not all(_is_host_device(arg.device) for launch in call.launches for arg in launch.arguments):
                raise NotGraphable(f"a call on {call.devices} (only CPU devices' memory is the host's)")
            if call.copy:  # dest, src: as tinygrad's exec_copy, the destination's bytes
                for launch in call.launches:
                    self.num_calls += 1
                    self.num_copies += 1
                    table += [MEMMOVE, 3]
                    dest, src = launch.arguments
                    add_arg(dest, None)
                    add_arg(src, None)
                    table.append(dest.nbytes)
                continue
            if not all(isinstance(s, int) for s in call.global_size):
                raise NotGraphable("a kernel whose number of core_ids depends on a variable")
            if call.num_args > MAX_ARGS:
                raise NotGraphable(f"a kernel with {call.num_args} arguments (at most {MAX_ARGS})")
            for launch in call.launches:
                program, address = loaded_program(launch.device, call.program)
                if address is None:
                    raise NotGraphable("a CPU program that is not a plain C function")
                self._programs.append(program)
                if describe and id(program) not in object_index:
                    object_index[id(program)] = len(self.objects)
                    self.objects.append(compiled_object(call.program))
                for core_id in range(call.global_size[0]):  # tinygrad calls a core_id kernel once per core_id
                    self.num_calls += 1
                    buffers: list[tuple[int, int, int, bool, bool]] = []
                    if describe:
                        self.calls.append((len(table), object_index[id(program)], buffers))
                    table += [address, call.num_args]
                    for arg in launch.arguments:
                        add_arg(arg, buffers if describe else None)
                    for name in call.variables:
                        if name == "core_id":
                            table.append(core_id)
                        elif name in launch.device_vars:  # `_device_num`, fixed per entry
                            table.append(launch.device_vars[name])
                        else:
                            var_patches.append((len(table), name))
                            table.append(var_vals[name])
        self._set_table(table, input_patches, var_patches)
        if moved_to is not None:  # the arenas' pages, touched while capturing: only tinygrad's own replay needs them
            for start, nbytes in arenas:
                give_back(start, nbytes)

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
        # the table is patched in place, so its address never changes
        self._args = (ctypes.c_uint64(self.table.ctypes.data), ctypes.c_uint64(self.num_calls))
        self._patched_for: list[UOp] | None = None  # the input uops whose addresses the table holds now
        self._var_values: tuple[int, ...] | None = None  # the variables' values the table holds now

    @classmethod
    def from_table(cls, table: list[int], num_calls: int, programs: list[Any],
                   input_patches: list[tuple[int, int, int]], var_patches: list[tuple[int, str]],
                   scratch: Scratch | None = None) -> CPUGraph:
        """A graph from a table read back from disk (one device: input patches are (table index, slot, offset));
        `scratch`: the shared scratch, where the table points into it."""
        graph = cls.__new__(cls)
        graph._programs, graph.num_calls, graph.num_copies, graph.objects, graph.calls = programs, num_calls, 0, [], []
        graph.scratch = scratch
        graph._set_table(table, [(index, slot, -1, offset) for index, slot, offset in input_patches], var_patches)
        return graph

    def __call__(self, input_uops: list[UOp], var_vals: dict[str, int]) -> None:
        """Patch what changed since the last call, then run the table."""
        if input_uops is not self._patched_for:
            addrs = np.array([input_shard_address(input_uops[slot], shard) for slot, shard in self.input_keys],
                             dtype=np.int64)
            self.table[self.input_index] = addrs[self.input_which] + self.input_offset
            self._patched_for = input_uops
        values = tuple(var_vals[name] for name in self.var_names)
        if values != self._var_values:
            self.table[self.var_index] = np.array(values, dtype=np.int64)[self.var_which]
            self._var_values = values
        if self.scratch is None:
            self._runner.fxn(*self._args)
            return
        with self.scratch.lock:  # one graph at a time in the shared scratch
            self._runner.fxn(*self._args)


@dataclass(eq=False)
class JitCallInputs:
    """A JIT call's input buffer uops, names and input info: one object for as long as the tensors are the same, so a
    check made once on it holds for every such call."""

    uops: list[UOp]
    names: list
    input_info: list


class JitInputs:
    """One JIT's call inputs, prepared as `_TinyJit.__call__` does, and remembered."""

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
                key = None  # another kind of argument: prepared in full every time
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
    """Does the device table let the inputs' devices replay through a CPUGraph?"""
    devices = {d for u in input_uops for d in (u.device if isinstance(u.device, tuple) else (u.device,))}
    if any(not isinstance(d, str) for d in devices):
        return False
    return all(platform_for(d).cpu_graph for d in devices) if devices else platform_for(None).cpu_graph


class GraphedJit(JitBase):
    """TinyJit that replays through a `CPUGraph` where the device uses one and the graph fits; elsewhere tinygrad's own
    replay. `persist` (a `PersistedGraph`): written to disk once built, replayed by a later process."""

    def __init__(self, fxn, capture_first: bool = True, persist=None):
        super().__init__(fxn)
        self.capture_first = capture_first
        self.graph: CPUGraph | None | bool = None  # None: not built yet; False: not graphable (or not this device)
        self.persist = persist if ENABLED else None
        self.loaded = None  # a graph_cache.LoadedGraph: replayed until this JIT captures one of its own
        self.inputs = JitInputs()
        self._checked: JitCallInputs | None = None  # the inputs last found to match the graph replayed
        self.ran_in_c = False  # did the last call run its kernels in the C table?
        if capture_first:
            self.capture_on_next_call()

    def reset(self) -> None:
        super().reset()
        self.graph, self.loaded, self._checked = None, None, None
        if self.capture_first:
            self.capture_on_next_call()

    def __call__(self, *args, **kwargs):
        self.ran_in_c = False
        inputs, var_vals = self.inputs(args, kwargs)
        if self.graph is None and not self.is_replaying() and self.loaded is None and not _uses_cpu_graph(inputs.uops):
            self.graph, self.persist = False, None  # tinygrad's TinyJit from here on
        if self.persist is not None and not self.is_replaying():
            if self.loaded is None:
                self.loaded = self.persist.load(inputs.names, inputs.input_info) or False  # False: nothing usable
            if self.loaded and (inputs is self._checked or self.loaded.accepts(inputs.names, inputs.input_info)):
                self._checked = inputs
                self.loaded.graph(inputs.uops, var_vals)
                self.ran_in_c = True
                return self.loaded.ret
            self._checked = None
            ret = super().__call__(*args, **kwargs)  # captures
            if self.is_replaying() and not self.writes_inputs(inputs.uops):
                try:
                    self.graph = CPUGraph(self, inputs.uops, var_vals, describe=True)
                except (NotGraphable, UnsupportedCall):
                    self.graph = False
                else:
                    self.persist.save(self.graph, self.captured_return(), inputs.names, inputs.input_info)
            return ret
        if not self.is_replaying():
            return super().__call__(*args, **kwargs)  # runs eagerly, or captures
        if inputs is not self._checked:  # as tinygrad checks every replay; once per distinct inputs here
            self._check(inputs)
            self._checked = inputs
        if self.graph is None and ENABLED:
            try:
                self.graph = CPUGraph(self, inputs.uops, var_vals)
            except (NotGraphable, UnsupportedCall):
                self.graph = False
        if not self.graph:  # tinygrad's own replay, with the inputs prepared here
            return self.replay_with_tinygrad(inputs.uops, var_vals)
        self.graph(inputs.uops, var_vals)
        self.count_replay()
        self.ran_in_c = True
        return self.captured_return()

    def _check(self, inputs: JitCallInputs) -> None:
        """JitError unless the inputs are those the graph was captured with. An input the graph writes makes
        tinygrad copy it first: then only tinygrad's own replay is right."""
        self.check_inputs(inputs.names, inputs.input_info)
        if self.writes_inputs(inputs.uops):
            self.graph = False
