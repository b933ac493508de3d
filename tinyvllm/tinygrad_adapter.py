"""Every use of tinygrad's internals, in this file and tinyvllm/tinygrad_startup.py (what a process's start uses,
split off along that seam): what to read when tinygrad is upgraded.

tinyvllm uses tinygrad's public API directly (what `import tinygrad` exports: Tensor, UOp, TinyJit, Device,
dtypes, Context, getenv, function; and `tinygrad.dtype.DType` for type hints). Everything else it needs is
here: private names (`_TinyJit`, `_prepare_jit_inputs`), modules tinygrad does not export from its top level
(`tinygrad.engine.jit`, `tinygrad.uop.ops`, `tinygrad.device`, ...), module globals it rebinds, and a patch.
Each function says which internal it wraps and why tinyvllm needs it. Grouped by the module that uses them:

    launcher.py                 renderer_name, CLANG_KERNEL_PREFIX, source_program, compile_cpu, load_cpu_program,
                                elf_symbol_at_start, Estimates
    cpu_graph.py                JitBase, capture_on_next_call, is_replaying, count_replay, jit_inputs,
                                replay_captured, inputs_written_by, get_runtime, get_call_arg_uops, compiled_object,
                                call_launches, buffer_address, input_shard_address
    graph_cache.py              tinygrad_settings, is_realized, buffer_address, load_cpu_program
    cpu_threads.py              default_cpu_threads
    program_cache.py            (tinyvllm/tinygrad_startup.py: opening the device, the lowered-program cache)
    device_memory.py, llama.py  host_memory, allocate_zeroed_host_memory, copy_in, numpy_dtype, memory_info, empty
    paged.py                    KernelInfo (a custom UOp kernel's name and options)
    async_llm_engine.py         share_kernel_cache_across_threads
    llama.py                    apply_fixes (speed fixes: how fast, never what), reusable_function, traces_reused

The version is pinned in pyproject.toml and checked once, on import: any other warns, and `apply_fixes`
leaves that tinygrad alone.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import ctypes
import os
import sqlite3
import sys
import types
import warnings
from dataclasses import replace

import tinygrad
import tinygrad.engine.realize
import tinygrad.function  # the module (`tinygrad.function` the attribute is the decorator)
from tinygrad import Device, Tensor, UOp
from tinygrad.device import Buffer, BufferSpec, MultiBuffer, TinyELF, canonicalize_device
from tinygrad.dtype import DType, _from_np_dtype, _to_np_dtype
from tinygrad.engine.jit import CapturedJit, JitError, _prepare_jit_inputs, _TinyJit  # noqa: F401
from tinygrad.nn.state import get_state_dict
from tinygrad.engine.realize import get_call_arg_uops, get_runtime, resolve_params, unwrap_multi  # noqa: F401
from tinygrad.helpers import DEV, dedup, NUM_CPU_THREADS, ContextVar, prod, to_tuple
from tinygrad.renderer import Estimates
from tinygrad.renderer.cstyle import ClangRenderer
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, shape_to_shape_arg

# Imported above and used elsewhere as they are (from modules tinygrad does not export at its top level):
#   Ops             the UOp operation enum (cpu_graph.py walks a captured graph by it)
#   KernelInfo      a kernel's name, cost estimates and optimizer options (paged.py's UOp kernel, source_program)
#   Estimates       ops / bytes of a kernel, what DEBUG=2 rates it by (linear.py)
#   CapturedJit     what a TinyJit captured: `.linear` (the calls), `.expected_names`, `.expected_input_info`, `.ret`
#   JitError        what TinyJit raises on a call that does not match its capture
#   get_runtime, get_call_arg_uops   a captured call's compiled program and its argument uops
#                   (tinygrad.engine.realize; `call_launches` below puts in the JIT inputs of one replay)


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


TINYGRAD_VERSION = "0.14.0"  # the one this file was written against (pyproject.toml pins it)
INSTALLED_VERSION = installed_version()  # read once: the caches' keys and directory names carry it
if INSTALLED_VERSION != TINYGRAD_VERSION:
    warnings.warn(f"tinyvllm was written for tinygrad {TINYGRAD_VERSION}, this is tinygrad {INSTALLED_VERSION}: "
                  "its internals may have moved (see tinyvllm/tinygrad_adapter.py); speed fixes are off",
                  RuntimeWarning, stacklevel=2)


# ---- hand-written kernels as programs (tinyvllm/kernels/launcher.py) ----

def renderer_name(kind: str) -> str:
    """The renderer DEV selects for device kind `kind` ("" = the device's default; DEV=CPU:LLVM gives "LLVM").

    Wraps `tinygrad.helpers.DEV.target`: it reads the setting without opening the device, which the launcher
    needs because it decides while a graph is traced, where tinygrad forbids device use."""
    return DEV.target(kind).renderer


# How the clang renderer declares a kernel entry point (the CPU's TV_KERNEL): `ClangRenderer.kernel_typedef`.
CLANG_KERNEL_PREFIX: str = ClangRenderer.kernel_typedef


def source_program(name: str, source: str, num_outs: int, num_ins: int, estimates: Estimates | None = None,
                   global_size: tuple[int, int, int] = (1, 1, 1), local_size: tuple[int, int, int] | None = None):
    """The `fxn` for `Tensor.custom_kernel`: given the params of (outs..., ins...), a PROGRAM UOp of raw source.

    Builds what tinygrad's codegen builds for its own kernels, minus the last step (`pm_to_program` in
    tinygrad/codegen/__init__.py): PROGRAM(SINK, LINEAR, SOURCE) with a `ProgramInfo` (tinygrad.uop.ops).
    ProgramInfo tells tinygrad which arguments are buffers (all), which the kernel writes (the first
    num_outs) and which it reads: the scheduler orders kernels by it, and TinyJit knows what to copy. Its
    fields changed between 0.13 and 0.14 (tinygrad's test/backend/test_custom_kernel.py shows the current ones).
    global_size / local_size are the launch grid of GPU kernels; a CPU program runs once (global_size 1)."""
    num = num_outs + num_ins
    info = ProgramInfo(name=name, global_size=global_size, local_size=local_size, globals=tuple(range(num)),
                       outs=tuple(range(num_outs)), ins=tuple(range(num_outs, num)))

    def fxn(*params: UOp) -> UOp:
        assert len(params) == num, f"{name}: expected {num} buffers, got {len(params)}"
        sink = UOp.sink(*params, arg=KernelInfo(name=name, estimates=estimates))
        linear = UOp(Ops.LINEAR, src=(*sink.src, sink))
        return UOp(Ops.PROGRAM, src=(sink, linear, UOp(Ops.SOURCE, arg=source)), arg=info)
    return fxn


def compile_cpu(source: str) -> bytes:
    """C source -> the CPU device's compiled object, through tinygrad's on-disk cache (`Compiler.compile_cached`)."""
    return Device["CPU"].compiler.compile_cached(source)


def load_cpu_program(lib: bytes, name: str):
    """A compiled object loaded as a host-callable program: `Compiled.runtime` takes a `TinyELF`
    (tinygrad.device) in 0.14. Returns tinygrad's CPUProgram; `.fxn(*args)` calls it with ctypes.c_uint64s."""
    dev = Device["CPU"]
    return dev.runtime(TinyELF(lib, name, dev.renderer.target, ()))


def elf_symbol_at_start(lib: bytes, symbol: str) -> bool | None:
    """Does function `symbol` start at offset 0 of the first code section of ELF object `lib`? (None: no such
    symbol.) tinygrad's CPU runtime loads the sections back to back and calls the first byte, so that is where
    an entry function must be. Reads the object with tinygrad's ELF reader (`runtime.support.elf.elf_loader`)
    and its libc struct definitions (`runtime.autogen.libc`), imported here: the CPU device's module imports them
    too, but only after tinyvllm/tinygrad_startup.py has made finding libc cheaper (`find_libraries_quickly`)."""
    from tinygrad.runtime.autogen import libc
    from tinygrad.runtime.support.elf import elf_loader

    _, sections, _ = elf_loader(lib)
    symtab = next(s for s in sections if s.name == ".symtab")
    strtab = next(s for s in sections if s.name == ".strtab")
    first = next(i for i, s in enumerate(sections) if s.header.sh_type == libc.SHT_PROGBITS)
    syms = (libc.Elf64_Sym * (len(symtab.content) // ctypes.sizeof(libc.Elf64_Sym))).from_buffer_copy(symtab.content)
    for sym in syms:
        if strtab.content[sym.st_name:].split(b"\0", 1)[0].decode() == symbol:
            return sym.st_shndx == first and sym.st_value == 0
    return None


# ---- TinyJit's replay, taken over on the CPU (tinyvllm/kernels/cpu_graph.py) ----

# The class to subclass: the public `TinyJit` is a function returning a `tinygrad.engine.jit._TinyJit`.
JitBase = _TinyJit

# _TinyJit counts its calls in `cnt`: 0 runs the function eagerly, 1 captures, 2 and up replay the capture.


def capture_on_next_call(jit: _TinyJit) -> None:
    """Skip the eager first call: the next call captures (sets `cnt` to 1)."""
    jit.cnt = 1


def is_replaying(jit: _TinyJit) -> bool:
    """Has `jit` captured, so that its next call replays? (`cnt` >= 2 and a `captured` graph; JIT=0 never captures)"""
    return jit.cnt >= 2 and jit.captured is not None


def count_replay(jit: _TinyJit) -> None:
    """Count a replay done outside `_TinyJit.__call__`, as that method would (`cnt += 1`)."""
    jit.cnt += 1


def jit_inputs(args: tuple, kwargs: dict) -> tuple[list[UOp], dict[str, int], list, list]:
    """(input buffer uops, variable values, names, input info) of a call, as `_TinyJit.__call__` computes them
    (`tinygrad.engine.jit._prepare_jit_inputs`): the same checks, and the same realization of the inputs."""
    return _prepare_jit_inputs(args, kwargs)


def replay_captured(jit: _TinyJit, input_uops: list[UOp], var_vals: dict[str, int]):
    """Replay what `jit` captured with tinygrad's own runner (`CapturedJit.__call__`, which first copies any
    input the graph writes), counted as `_TinyJit.__call__` counts a replay; returns the captured return value."""
    ret = jit.captured(input_uops, var_vals)
    count_replay(jit)
    return ret


def inputs_written_by(captured: CapturedJit, input_uops: list[UOp]) -> bool:
    """Does the captured graph write one of these inputs? tinygrad then copies the input first (its private
    `CapturedJit._written_uops`), which a replay outside tinygrad would not do."""
    return any(u in captured._written_uops for u in input_uops)


def empty(shape: tuple[int, ...], dtype: DType, device: str | None) -> Tensor:
    """`Tensor.empty(*shape, dtype=dtype, device=device)` for a shape of ints on one device: the same new buffer
    reshaped to `shape`, without the shrink to `shape` tinygrad's adds (`tinygrad.mixin.creation.empty`), which gives
    the tensor back unchanged after as much work again as the rest: a load makes a few hundred (weights, KV caches).

    The reshape is `UOp.reshape` (`tinygrad.mixin.movement`, `UOp._mop`) with its one costly step, the symbolic
    simplification of the shape's uop, done once per shape (`_reshape_sources`): a shape of ints always simplifies
    to the same uops (tinygrad keeps one uop per value), and the 30 layers' weights have a handful of shapes."""
    buffer = UOp.new_buffer(canonicalize_device(device), prod(shape), dtype)
    reshaped = UOp(Ops.RESHAPE, src=(buffer, *_reshape_sources(tuple(shape))))
    return Tensor(buffer if reshaped.shape == buffer.shape else reshaped)  # as `reshape`: the same shape is a no-op


@functools.lru_cache(maxsize=None)
def _reshape_sources(shape: tuple[int, ...]) -> tuple[UOp, ...]:
    """The sources after the tensor that `UOp._mop(Ops.RESHAPE, shape)` gives its RESHAPE: the shape as a uop,
    simplified."""
    return UOp.sink(shape_to_shape_arg(shape)).simplify().src


def tensor_over_memory(address: int, shape: tuple[int, ...], dtype: DType, device: str | None, owner: object) -> Tensor:
    """A tensor whose buffer is the host memory at `address` (as `Tensor.from_blob`: nothing copied, nothing owned);
    `owner`, what keeps that memory valid (a memory map, an array), is kept alive by the buffer itself, as long as
    anything uses it."""
    t = empty(shape, dtype, device)
    t.uop.buffer.allocate(external_ptr=address)
    t.uop.buffer.tinyvllm_memory_owner = owner
    return t


def call_launches(call: UOp, input_uops: list[UOp]) -> list[tuple[str, list[Buffer], dict[str, int]]]:
    """The launches tinygrad's replay makes for one captured call (`tinygrad.engine.realize.exec_kernel`,
    `exec_copy`): one per device the call runs on, in device order, each as (device, that device's buffers, the
    variables bound per device). A kernel's buffers are those of its `globals`, in order; a COPY's are [dest, src].
    A call on several devices (a split tensor: MultiBuffers) runs once per device, with `_device_num` bound to the
    device's index where the kernel reads it."""
    ast, resolved = call.src[0], resolve_params(call, input_uops)
    if ast.op is Ops.PROGRAM:
        lanes = list(unwrap_multi(call, [resolved[i] for i in ast.arg.globals]))
        return [(device, bufs, dv) for device, (bufs, dv) in zip(to_tuple(call.src[1].device), lanes)]
    return [(bufs[0].device, bufs, dv) for bufs, dv in unwrap_multi(call, resolved)]


def buffer_address(x: Tensor | Buffer) -> int:
    """The address of a buffer's memory, allocated here if it is not yet (`Buffer.get_buf(device).va_addr`): a
    tensor's (on one device), or one device's buffer (or view) of a launch."""
    buf = x.uop.buffer if isinstance(x, Tensor) else x
    return buf.ensure_allocated().get_buf(buf.device).va_addr


def input_shard_address(u: UOp, shard: int) -> int:
    """The address of a JIT input's buffer: the whole buffer (shard -1), or device `shard`'s part of an input split
    over several devices (a `MultiBuffer`: one buffer per device)."""
    buf = u.buffer
    if shard >= 0:
        assert isinstance(buf, MultiBuffer), f"input {u} is on one device, not split over several"
        buf = buf.bufs[shard]
    return buffer_address(buf)


def kernel_input(t: Tensor) -> Tensor:
    """t as a hand-written kernel's input, which reads a row-major buffer: `t.contiguous()`, except where t is
    already one, a reshape of another custom kernel's output (`launch`'s outs): tinygrad 0.14 does not see that and
    would copy it (an elementwise kernel over every element) between the two kernels."""
    u = t.uop
    while u.op is Ops.RESHAPE:
        u = u.src[0]
    if isinstance(t.device, str) and u.op is Ops.AFTER and any(s.op is Ops.CALL for s in u.src[1:]):
        return t
    return t.contiguous()


def is_realized(t: Tensor) -> bool:
    """Does `t` stand for a buffer already (`UOp.is_realized`), rather than a computation still to run?"""
    return t.uop.is_realized


def compiled_object(program: UOp) -> tuple[bytes, str]:
    """(compiled object, entry name) of a compiled PROGRAM uop (`UOp.to_elf`): what `load_cpu_program` loads."""
    elf = program.to_elf()
    return elf.lib, elf.name


def tinygrad_settings() -> dict[str, str]:
    """The settings tinygrad read from the environment (its `ContextVar`s: DEV, BEAM, NOOPT, ...) that the
    environment sets, by name, as text: what a kernel tinygrad built may depend on beyond its defaults. (Only
    those set: which ContextVars exist depends on which tinygrad modules this process happened to import.)"""
    return {key: repr(var.value) for key, var in sorted(ContextVar._cache.items()) if key in os.environ}


# ---- the CPU thread pool (tinyvllm/kernels/cpu_threads.py) ----

def default_cpu_threads() -> int:
    """How many threads tinygrad itself would use on the CPU (`tinygrad.helpers.NUM_CPU_THREADS`)."""
    return NUM_CPU_THREADS.value


# ---- device memory seen from the host (tinyvllm/device_memory.py, tinyvllm/model/llama.py) ----

def numpy_dtype(dtype: DType) -> type:
    """The numpy dtype of a tinygrad dtype (`tinygrad.dtype._to_np_dtype`)."""
    return _to_np_dtype(dtype)


def tinygrad_dtype(dtype) -> DType:
    """The tinygrad dtype of a numpy dtype (`tinygrad.dtype._from_np_dtype`)."""
    return _from_np_dtype(dtype)


def host_memory(t: Tensor) -> memoryview | None:
    """`t`'s device memory as a memoryview, allocated here if it is not yet; None where the host cannot see it.

    `Buffer.as_memoryview(force_zero_copy=True)` asserts where a copy would be needed (a discrete GPU)."""
    buf = t.uop.buffer.ensure_allocated()
    try:
        return buf.as_memoryview(force_zero_copy=True)
    except AssertionError:  # tinygrad: "force zero copy was passed, but copy is required"
        return None


def allocate_zeroed_host_memory(t: Tensor) -> None:
    """Allocate `t` (a fresh `Tensor.empty`) as memory that comes zeroed and never from tinygrad's reuse cache:
    `BufferSpec(zero=True, nolru=True)` (tinygrad.device) keeps it out of `LRUAllocator`, where a freed
    buffer's old contents could come back. The CPU allocator maps fresh anonymous memory for it."""
    buf = t.uop.buffer
    buf.options = BufferSpec(zero=True, nolru=True)
    buf.allocate()


def copy_in(t: Tensor, data: memoryview) -> None:
    """Copy the bytes `data` into `t`'s device buffer (allocated here if it is not yet), now, with no graph.

    tinygrad 0.14's `Buffer` has no public copy-in; its own copies (`exec_copy` in tinygrad/engine/realize.py)
    call the allocator's `_copyin(buf._buf, memoryview)`, which every backend has: a memmove on the CPU, a copy
    through pinned host memory queued on the device's stream on CUDA (so `data` may be reused at once)."""
    buf = t.uop.buffer.ensure_allocated()
    assert len(data) == buf.nbytes, f"copy_in: {len(data)} bytes into a buffer of {buf.nbytes}"
    buf.allocator._copyin(buf._buf, data)


def memory_info(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU's memory, as its driver reports them; None where tinygrad has no way to ask.

    CUDA: `cuMemGetInfo_v2` (tinygrad.runtime.autogen.cuda) in the device's context. METAL: the working set the
    system recommends (`recommendedMaxWorkingSetSize`) less what the device has allocated
    (`currentAllocatedSize`). Opens the device."""
    kind = device.split(":")[0].upper()
    dev = Device[device]
    if kind == "CUDA":
        from tinygrad.runtime.autogen import cuda
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        cuda.cuCtxSetCurrent(dev.context)
        if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value
    if kind == "METAL":
        total = int(dev.sysdevice.recommendedMaxWorkingSetSize())
        return max(total - int(dev.sysdevice.currentAllocatedSize()), 0), total
    return None


# ---- one kernel cache for every thread (tinyvllm/engine/async_llm_engine.py) ----

def share_kernel_cache_across_threads() -> None:
    """Let the engine thread use tinygrad's on-disk kernel cache even if another thread opened it first.

    tinygrad keeps one sqlite connection for the cache (`tinygrad.helpers._db_connection`, opened by
    `db_connection()`), and sqlite refuses a connection made on another thread: a process that compiled
    kernels on its main thread before starting the engine thread would fail on the first cache lookup there.
    Open it with check_same_thread=False instead (sqlite serializes the calls; tinygrad's writes are IMMEDIATE
    transactions), with tinygrad's own settings.
    """
    from tinygrad import helpers

    if getattr(helpers, "_db_connection_shared", False):
        return
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    connection = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    with contextlib.suppress(sqlite3.OperationalError):
        connection.execute("PRAGMA journal_mode=WAL").fetchone()
    connection.execute("PRAGMA synchronous=NORMAL")
    helpers._db_connection, helpers._db_connection_shared = connection, True


def sharded_zeros(shape: tuple[int, ...], dtype: DType, devices: tuple[str, ...], axis: int) -> Tensor:
    """A realized tensor of zeros of `shape` split along `axis` over `devices` (each holds shape[axis] / N of it),
    zeroed where it lives: no whole copy on one device first. tinygrad 0.14 represents a split tensor as one buffer
    per device of the shard's shape under an UNSHARD (what `Tensor.shard` returns once realized)."""
    assert shape[axis] % len(devices) == 0, f"{shape} does not split along axis {axis} over {len(devices)} devices"
    shard = tuple(s // len(devices) if i == axis else s for i, s in enumerate(shape))
    local = Tensor.zeros(*shard, dtype=dtype, device=devices).contiguous().realize()  # (shard) on every device
    return Tensor(local.uop.unshard(axis))


def empty_shards(shard: tuple[int, ...], dtype: DType, devices: tuple[str, ...], axis: int | None) -> Tensor:
    """An unrealized output buffer on every device, `shard` the shape of each device's part, seen as one tensor split
    along `axis` (None: each device's part is a whole replica). A kernel run on a split tensor writes one per device."""
    local = Tensor.invalids(*shard, dtype=dtype, device=devices)  # (shard) on every device, contents undefined
    return local if axis is None else Tensor(local.uop.unshard(axis))


def shard_shape(t: Tensor) -> tuple[int, ...]:
    """The shape of one device's part of `t` (its shape, if `t` is on one device or replicated)."""
    return tuple(t.uop.shard_shape)


def shard_axis(t: Tensor) -> int | None:
    """The axis `t` is split along over its devices (None: on one device, or a replica on each)."""
    return t.uop.axis if isinstance(t.device, tuple) else None


# ---- one trace for every decoder layer (tinyvllm/model/llama.py) ----

_reused_traces: dict | None = None  # inside `traces_reused()`: a call's structure -> its traced FUNCTION uop


@contextlib.contextmanager
def traces_reused():
    """One forward pass: tinygrad's `function` runs its Python body at every call (30 layers, 30 traces). Here a
    call whose arguments have an earlier call's structure (shapes, dtypes, devices, settings; other buffers) calls
    that traced graph with its own buffers. A bound variable's value is the same throughout one pass."""
    global _reused_traces
    outer, _reused_traces = _reused_traces, {}
    try:
        yield
    finally:
        _reused_traces = outer


def _structure(obj, out: list, seen: dict) -> bool:
    """Append every setting reachable from `obj` and the place of each buffer; False at what it cannot describe."""
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


class _ReusableFunction(sys.modules["tinygrad.function"]._function):
    def __call__(self, *args, **kwargs):
        described: list = []
        if _reused_traces is None or not _structure((args, kwargs), described, {}):
            return super().__call__(*args, **kwargs)
        # the parameters as tinygrad's `function` finds them: the same walk, order and dedup
        uops = [t._uop for t in get_state_dict((args, kwargs), tensor_type=(Tensor, UOp)).values()]
        call_uops = dedup([u for u in uops if u.device is not None])
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
    return _ReusableFunction(fxn, precompile=True, precompile_backward=False, allow_implicit=False, grad_fxn=None)


# ---- speed fixes (applied by tinyvllm/model/llama.py) ----

def _renumber_invalid_outputs(uret):
    invalid = sys.modules["tinygrad.function"].invalid_outputs(uret)
    return uret.substitute({b: b.replace(arg=replace(b.arg, slot=i))
                            for i, b in enumerate(x for x in uret.toposort(enter_calls=False) if x in invalid)})


_fixes_applied = False


def apply_fixes() -> None:
    """Fixes to tinygrad 0.14.0 that change how fast it does something, never what it computes (once, on that
    version only). 1. `tinygrad.function.renumber_invalid_outputs` recomputes `invalid_outputs(uret)` (a walk of
    the function body) once per node of the body: quadratic in its size, paid by every traced decoder layer (the
    matmul kernels' outputs are `Tensor.invalids`). The fix computes the set once."""
    global _fixes_applied
    if _fixes_applied or INSTALLED_VERSION != TINYGRAD_VERSION:
        return
    # `tinygrad.function` the attribute is the decorator; the module is only reachable through sys.modules
    sys.modules["tinygrad.function"].renumber_invalid_outputs = _renumber_invalid_outputs
    _fixes_applied = True

