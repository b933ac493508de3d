"""The two faces of tinygrad that tinyvllm builds on beside its Tensor: a program compiled from C source and
called from the host (tinyvllm/tinygrad_ext/programs.py, what the CPU graph and the kernels load), and TinyJit with
the hooks a graph runner of its own needs (tinyvllm/tinygrad_ext/jit.py)."""

from __future__ import annotations

import ctypes

import numpy as np
from tinygrad import Tensor

from tinyvllm.tinygrad_ext.jit import JitBase
from tinyvllm.tinygrad_ext.programs import compile_cpu, elf_symbol_at_start, load_cpu_program

SOURCE = "void triple(int *out, unsigned long long a) { out[0] = (int)a * 3; }"


def test_a_compiled_c_function_is_called_from_the_host():
    lib = compile_cpu(SOURCE)
    assert elf_symbol_at_start(lib, "triple") is True  # where tinygrad's CPU runtime calls
    assert elf_symbol_at_start(lib, "absent") is None
    program = load_cpu_program(lib, "triple")
    assert program.name == "triple" and program.addr
    out = (ctypes.c_int32 * 1)()
    program.fxn(ctypes.c_uint64(ctypes.addressof(out)), ctypes.c_uint64(14))
    assert out[0] == 42


def test_the_jit_captures_on_the_call_it_is_told_to():
    jit = JitBase(lambda x: (x + 1).realize())
    jit.capture_on_next_call()  # no eager first call: this one captures
    first = jit(Tensor(np.zeros(3, dtype=np.float32)).realize())
    assert first.tolist() == [1.0, 1.0, 1.0] and jit.is_replaying()
    assert jit.captured_return() is not None
    again = jit(Tensor(np.full(3, 4, dtype=np.float32)).realize())
    assert again.tolist() == [5.0, 5.0, 5.0]
    replays = jit.cnt
    jit.count_replay()  # a replay done by a runner of its own counts as tinygrad's would
    assert jit.cnt == replays + 1
