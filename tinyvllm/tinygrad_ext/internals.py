"""The table of tinygrad's internals that tinyvllm uses, and the check that the installed tinygrad has them all.

    python -m tinyvllm.tinygrad_ext.internals       # after an upgrade: what the installed tinygrad lacks

Nothing of tinygrad is imported at the top, so a missing name is reported by name
(docs/phases/01-appendix-tinygrad-internals.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    name: str  # a module attribute, `Class.attribute`, or `Ops.MEMBER`
    module: str
    used_by: str | tuple[str, ...]  # module.function of tinyvllm.tinygrad_ext
    params: tuple[str, ...] = ()  # the parameters relied on, in order
    in_text: bool = False  # named in a string, not in code

    def where(self) -> str:
        used_by = self.used_by if isinstance(self.used_by, str) else " and ".join(self.used_by)
        return f"{self.module}.{self.name} (used by tinyvllm.tinygrad_ext.{used_by})"


J, R, U, D = "tinygrad.engine.jit", "tinygrad.engine.realize", "tinygrad.uop.ops", "tinygrad.device"
H, C, F = "tinygrad.helpers", "tinygrad.codegen", "tinygrad.function"
W, CC = "tinygrad.engine.worker", "tinygrad.runtime.support.compiler_cpu"

NAMES: tuple[Internal, ...] = (
    # ---- jit.py: TinyJit's class, and a call's inputs ----
    Internal("_TinyJit", J, "jit.JitBase"),
    Internal("JitError", J, "jit.JitBase.check_inputs"),
    Internal("CapturedJit._written_uops", J, "jit.JitBase.writes_inputs"),
    Internal("_prepare_jit_inputs", J, "jit.jit_inputs", ("args", "kwargs")),
    # ---- jit.py: a capture read as calls and launches ----
    Internal("resolve_params", R, "jit.captured_calls", ("call", "inputs")),
    Internal("get_call_arg_uops", R, "jit.captured_calls", ("call",)),
    Internal("unwrap_multi", R, "jit.captured_calls", ("call", "resolved")),
    Internal("Ops.COPY", U, "jit.captured_calls"),
    Internal("Ops.PROGRAM", U, ("jit.captured_calls", "programs.source_program")),  # read there, built here
    Internal("Ops.PARAM", U, "jit.input_of"),
    Internal("Ops.MSELECT", U, "jit.input_of"),
    Internal("Ops.SHRINK", U, "jit.input_of"),
    Internal("Ops.CONST", U, "jit.input_of"),
    Internal("Ops.MSTACK", U, "jit.input_of"),
    Internal("get_runtime", R, "jit.loaded_program", ("device", "ast")),
    Internal("memory_plan_rewrite", J, "jit.record_arenas", ("linear", "held_bufs")),
    Internal("Ops.BUFFER", U, ("jit.record_arenas", "jit.arena_buffers")),
    # ---- buffers.py: device memory ----
    Internal("canonicalize_device", D, "buffers.empty", ("device",)),
    Internal("Ops.RESHAPE", U, ("buffers.empty", "programs.kernel_input")),  # built there, looked through here
    Internal("shape_to_shape_arg", U, "buffers._reshape_sources"),
    Internal("MultiBuffer", D, ("buffers.input_shard_address", "jit.arena_buffers")),
    Internal("_to_np_dtype", "tinygrad.dtype", "buffers.numpy_dtype"),
    Internal("_from_np_dtype", "tinygrad.dtype", "buffers.tinygrad_dtype"),
    Internal("BufferSpec", D, "buffers.allocate_zeroed_host_memory"),
    Internal("Buffer._buf", D, "buffers.copy_in"),
    Internal("Allocator._copyin", D, "buffers.copy_in", ("dest", "src")),
    Internal("cuCtxSetCurrent", "tinygrad.runtime.autogen.cuda", "buffers.memory_info"),
    Internal("cuMemGetInfo_v2", "tinygrad.runtime.autogen.cuda", "buffers.memory_info"),
    # ---- programs.py: hand-written kernels as programs ----
    Internal("ClangRenderer.kernel_typedef", "tinygrad.renderer.cstyle", "programs.CLANG_KERNEL_PREFIX"),
    Internal("DEV.target", H, "programs.renderer_name"),
    Internal("Estimates", "tinygrad.renderer", "programs.kernel_cost"),
    Internal("KernelInfo", U, "programs.kernel_info"),
    Internal("ProgramInfo", U, "programs.source_program"),
    Internal("Ops.LINEAR", U, "programs.source_program"),
    Internal("Ops.SOURCE", U, "programs.source_program"),
    Internal("Ops.AFTER", U, "programs.kernel_input"),
    Internal("Ops.CALL", U, "programs.kernel_input"),
    Internal("TinyELF", D, "programs.load_cpu_program", ("lib", "name", "target", "signature")),
    Internal("elf_loader", "tinygrad.runtime.support.elf", "programs.elf_symbol_at_start", ("blob",)),
    Internal("SHT_PROGBITS", "tinygrad.runtime.autogen.libc", "programs.elf_symbol_at_start"),
    Internal("Elf64_Sym", "tinygrad.runtime.autogen.libc", "programs.elf_symbol_at_start"),
    # ---- startup.py: a process's start ----
    Internal("to_program_cache", C, "startup.lowered_program_cache"),
    Internal("to_program_cache", R, "startup.lowered_program_cache"),
    Internal("do_to_program", C, "startup.lower_cpu_device_programs_through", ("ast", "renderer")),
    Internal("to_program_key", C, "startup.lower_cpu_device_programs_through", ("ast", "renderer")),
    Internal("do_to_program", "tinygrad.runtime.ops_cpu", "startup.lower_cpu_device_programs_through"),
    Internal("DEV.device", H, "startup.chosen_default_device"),
    Internal("_Device._select_device", D, "startup._cached_default_device"),
    Internal("LVPRenderer", "tinygrad.renderer.nir", "startup.DEFERRED_CPU_RENDERERS", in_text=True),
    Internal("X86Renderer", "tinygrad.renderer.isa.x86", "startup.DEFERRED_CPU_RENDERERS", in_text=True),
    Internal("DLL.findlib", "tinygrad.runtime.support.c", "startup.find_libraries_quickly",
             ("nm", "paths", "extra_paths")),
    Internal("ContextVar._cache", H, "startup.tinygrad_settings"),
    Internal("NUM_CPU_THREADS", H, "startup.default_cpu_threads"),
    Internal("CACHEDB", H, "startup.share_kernel_cache_across_threads"),
    Internal("_db_connection", H, "startup.share_kernel_cache_across_threads"),
    # ---- compiling.py: a first request's kernels compiled sooner ----
    Internal("ClangCompiler", CC, "compiling.compile_ahead"),
    Internal("ClangCompiler.compile", CC, ("compiling._plain_compile", "compiling.use_precompiled_header"), ("src",)),
    Internal("diskcache_get", H, ("compiling.compile_ahead", "compiling._compiled_ahead"), ("table", "key")),
    Internal("getenv", H, ("compiling.clang_binary", "compiling.compile_pool"), ("key", "default")),
    Internal("PARALLEL.value", H, "compiling.compile_pool"),
    Internal("BEAM.value", H, "compiling.compile_pool"),
    Internal("worker_pool", W, "compiling.compile_pool"),
    Internal("get_worker_pool", W, "compiling.compile_pool"),
    Internal("_WorkerContext", W, "compiling.compile_pool"),
    Internal("_init_worker", W, "compiling._init_compile_worker"),
    Internal("get_worker_pool", R, "compiling.install"),
    Internal("capturing", R, "compiling.compile_ahead"),
    # ---- speed.py: fixes to the pinned tinygrad ----
    Internal("_function", F, "speed.ReusableFunction",
             ("fxn", "precompile", "precompile_backward", "allow_implicit", "grad_fxn")),
    Internal("get_state_dict", "tinygrad.nn.state", "speed.ReusableFunction.__call__", ("obj", "tensor_type")),
    Internal("Tensor._uop", "tinygrad.tensor", "speed.ReusableFunction.__call__"),
    Internal("Ops.GETTUPLE", U, "speed.ReusableFunction.__call__"),
    Internal("Ops.FUNCTION", U, "speed.ReusableFunction.__call__"),
    Internal("invalid_outputs", F, "speed._renumber_invalid_outputs", ("uret",)),
    Internal("renumber_invalid_outputs", F, "speed.apply_fixes", ("uret",)),
)

# Attributes of tinygrad's unexported objects the package reads or writes.
ATTRIBUTES: tuple[Internal, ...] = (
    *(Internal(f"_TinyJit.{a}", J, "jit.JitBase") for a in ("cnt", "captured")),
    *(Internal(f"CapturedJit.{a}", J, "jit.JitBase") for a in ("ret", "expected_names", "expected_input_info")),
    Internal("CapturedJit.__call__", J, "jit.JitBase.replay_with_tinygrad", ("input_uops", "var_vals")),
    Internal("CapturedJit.linear", J, "jit.captured_calls"),
    *(Internal(f"ProgramInfo.{a}", U, ("jit.captured_calls", "programs.source_program"))
      for a in ("name", "global_size", "local_size", "globals", "outs", "ins", "vars")),
    *(Internal(f"KernelInfo.{a}", U, "programs.kernel_info") for a in ("name", "estimates", "opts_to_apply")),
    *(Internal(f"Estimates.{a}", "tinygrad.renderer", "programs.kernel_cost") for a in ("ops", "lds", "mem")),
    Internal("ParamArg.slot", U, ("jit.input_of", "speed._renumber_invalid_outputs")),
    Internal("Buffer.ensure_allocated", D, ("buffers.buffer_address", "buffers.host_memory", "buffers.copy_in")),
    Internal("Buffer.get_buf", D, "buffers.buffer_address", ("device",)),
    Internal("Buffer.as_memoryview", D, "buffers.host_memory", ("force_zero_copy",)),
    Internal("Buffer.allocate", D, ("buffers.tensor_over_memory", "buffers.allocate_zeroed_host_memory"),
             ("external_ptr",)),
    *(Internal(f"Buffer.{a}", D, ("buffers", "jit.Argument")) for a in ("options", "allocator", "nbytes", "device")),
    Internal("MultiBuffer.bufs", D, ("buffers.input_shard_address", "jit.arena_buffers")),
    Internal("HCQBuffer.va_addr", "tinygrad.runtime.support.hcq", "buffers.buffer_address"),
    *(Internal(f"Compiled.{a}", D, "programs") for a in ("runtime", "renderer")),
    Internal("Compiled.compiler", D, ("programs", "compiling.compile_cpu_ahead")),
    Internal("Compiler.compile_cached", D, ("programs.compile_cpu", "compiling._compile_source"), ("src",)),
    *(Internal(f"ClangCompiler.{a}", CC, "compiling.clang_flags") for a in ("arch", "args")),
    Internal("Compiler.cachekey", D, ("compiling.compile_ahead", "compiling._compiled_ahead")),
    Internal("Renderer.target", "tinygrad.renderer", "programs.load_cpu_program"),
    Internal("Target.renderer", H, "programs.renderer_name"),
    *(Internal(f"CPUProgram.{a}", "tinygrad.runtime.ops_cpu", ("programs.load_cpu_program", "jit.loaded_program"))
      for a in ("addr", "fxn", "lvp")),
    *(Internal(f"TinyELF.{a}", D, "jit.compiled_object") for a in ("lib", "name")),
    *(Internal(f"ElfSection.{a}", "tinygrad.runtime.support.elf", "programs.elf_symbol_at_start")
      for a in ("name", "header", "content")),
    Internal("CUDADevice.context", "tinygrad.runtime.ops_cuda", "buffers.memory_info"),
    Internal("MetalDevice.sysdevice", "tinygrad.runtime.ops_metal", "buffers.memory_info"),
)


def problem(row: Internal) -> str | None:
    """What the installed tinygrad lacks of `row` (module, name or parameter); None: nothing."""
    try:
        if importlib.util.find_spec(row.module) is None:
            return f"no module {row.module}"
    except ValueError:  # a stand-in (startup.defer_unused_cpu_renderers): the module is there
        pass
    try:
        found = importlib.import_module(row.module)
    except Exception:  # does not import here (Metal's, off macOS): read its source
        return _problem_in_source(row)
    *path, last = row.name.split(".")
    for part in path:
        if not hasattr(found, part):
            return f"no {part} in {row.module}"
        found = getattr(found, part)
    if not hasattr(found, last):
        return None if inspect.isclass(found) and _declares(found, last) else f"no {row.name} in {row.module}"
    if row.params and callable(target := getattr(found, last)):
        names = _parameters(target, last)
        if not _in_order(row.params, names):
            return f"{row.name}{tuple(names)} lacks the parameters {row.params}"
    return None


def _parameters(function, name: str) -> list[str]:
    """The parameter names of `function`, or of the function `name` a decorator hiding them wraps."""
    parameters = inspect.signature(function).parameters.values()
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters) and (inner := _wrapped(function, name)):
        return _parameters(inner, name)
    return [p.name for p in parameters if p.name != "self"]


def _wrapped(function, name: str, depth: int = 4):
    """The function called `name` in the closures under `function`."""
    inner = [c.cell_contents for c in getattr(function, "__closure__", None) or ()
             if inspect.isfunction(c.cell_contents)]
    named = [f for f in inner if f.__name__ == name and f is not function]
    if named or depth == 0:
        return named[0] if named else None
    return next((found for f in inner if (found := _wrapped(f, name, depth - 1))), None)


def _declares(cls: type, attribute: str) -> bool:
    """Does a class set `attribute` on its instances (a field, or `self.attribute = ...`)?"""
    for klass in cls.__mro__:
        if (attribute in getattr(klass, "__dataclass_fields__", {})
                or attribute in vars(klass).get("__annotations__", {})):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attribute)}\b\s*(?::|=(?!=)|,)", source):
            return True
    return False


def _problem_in_source(row: Internal) -> str | None:
    with open(importlib.util.find_spec(row.module).origin, encoding="utf-8") as f:
        source = f.read()
    *path, last = row.name.split(".")
    if path and not re.search(rf"^\s*class {re.escape(path[-1])}\b", source, re.M):
        return f"no {path[-1]} in {row.module}"
    if not re.search(rf"\b(?:def |class |self\.)?{re.escape(last)}\b", source):
        return f"no {row.name} in {row.module}"
    return None


def _in_order(wanted: tuple[str, ...], names: list[str]) -> bool:
    it = iter(names)
    return all(w in it for w in wanted)


def missing(rows: tuple[Internal, ...] = NAMES + ATTRIBUTES) -> list[str]:
    """One line per row the installed tinygrad lacks, naming what needs it."""
    return [f"{row.where()}: {p}" for row in rows if (p := problem(row)) is not None]


if __name__ == "__main__":
    lines = missing()
    print("\n".join(lines) if lines else f"all {len(NAMES) + len(ATTRIBUTES)} internals found")
