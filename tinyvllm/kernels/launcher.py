"""Running a hand-written kernel inside tinygrad's graph, so that TinyJit captures and replays it.

Chapter: docs/phases/05-custom-kernels.md, section 5.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from tinygrad import Context, Tensor

from tinyvllm.tinygrad_ext.buffers import empty_shards, shard_shape
from tinyvllm.tinygrad_ext.compiling import compile_cpu_ahead
from tinyvllm.tinygrad_ext.programs import (
    CLANG_KERNEL_PREFIX,
    HostProgram,
    compile_cpu,
    elf_symbol_at_start,
    load_cpu_program,
    renderer_name,
    source_program,
)

PACKAGE_KERNELS = Path(__file__).resolve().parents[1] / "kernel_sources"  # an installed wheel
REPO_KERNELS = Path(__file__).resolve().parents[2] / "kernels"  # a checkout or an editable install


def find_kernels_dir(candidates: list[Path]) -> Path | None:
    """The first of `candidates` that holds kernel sources; None, with a warning, if none does."""
    for folder in candidates:
        if (folder / "cpu").is_dir():
            return folder
    warnings.warn(f"tinyvllm: no kernel sources in {' or '.join(map(str, candidates))}; every hand-written "
                  "kernel falls back to tinygrad's portable (slower) path. Reinstall tinyvllm (the wheel ships "
                  "them as tinyvllm/kernel_sources) or run from the repository.", RuntimeWarning, stacklevel=2)
    return None


KERNELS_DIR = find_kernels_dir([PACKAGE_KERNELS, REPO_KERNELS])


@dataclass(frozen=True)
class KernelBackend:
    """Where a device's kernel sources live and which tinygrad renderer compiles them."""

    folder: str  # kernels/<folder>/
    suffix: str
    renderers: tuple[str, ...]  # ("" = device default)
    kernel_prefix: str  # TV_KERNEL: tinygrad's kernel_typedef


CUDA = KernelBackend("cuda", ".cu", ("", "CUDA", "NVCC"), 'extern "C" __global__ void')
BACKENDS: dict[str, KernelBackend] = {
    "CPU": KernelBackend("cpu", ".c", ("", "CLANG"), CLANG_KERNEL_PREFIX),
    "CUDA": CUDA,
    "NV": CUDA,
    "METAL": KernelBackend("metal", ".metal", ("",), "kernel void"),
}


def device_kind(device: str | tuple[str, ...]) -> str:
    """'CPU:1' -> 'CPU'; devices of one kind (a split tensor's) -> that kind."""
    return (device if isinstance(device, str) else device[0]).split(":")[0].upper()


def kernel_path(name: str, device: str) -> Path | None:
    backend = BACKENDS.get(device_kind(device))
    return None if backend is None or KERNELS_DIR is None else KERNELS_DIR / backend.folder / f"{name}{backend.suffix}"


def has_kernel(name: str, device: str) -> bool:
    """Is there a source for kernel `name` on `device`? Opens no device (it runs while a graph is traced)."""
    kind = device_kind(device)
    if (backend := BACKENDS.get(kind)) is None or (path := kernel_path(name, device)) is None:
        return False
    return renderer_name(kind) in backend.renderers and path.is_file()


def _inline_includes(text: str, folder: Path, seen: set[str]) -> str:
    def include(m: re.Match) -> str:
        if m.group(1) in seen:
            return ""
        seen.add(m.group(1))
        return _inline_includes((folder / m.group(1)).read_text(), folder, seen)
    return re.sub(r'^#include "([^"]+)"[^\n]*$', include, text, flags=re.MULTILINE)


@functools.cache
def _read_source(path: Path) -> str:
    return _inline_includes(path.read_text(), path.parent, set())


def kernel_source(name: str, device: str, defines: dict[str, int | str]) -> str:
    """The full source tinygrad compiles: `#define`s, TV_KERNEL, then the file with its includes."""
    backend, path = BACKENDS[device_kind(device)], kernel_path(name, device)
    assert path is not None and path.is_file(), f"no kernel {name!r} for {device}"
    header = [f"#define {k} {v}" for k, v in defines.items()] + [f"#define TV_KERNEL {backend.kernel_prefix}"]
    return "\n".join(header) + "\n" + _read_source(path)


def program_name(entry: str, device: str, defines: dict[str, int | str]) -> str:
    """The name a program is launched under."""
    if device_kind(device) != "CPU":
        return entry
    return "_".join([entry] + [str(v) for v in defines.values() if isinstance(v, int)])


def program_source(name: str, device: str, defines: dict[str, int | str], entry: str | None = None) -> tuple[str, str]:
    """(program name, full source) of function `entry` (default: `name`) of kernels/<device>/<name>.*, as `launch`
    compiles it."""
    entry = entry or name
    pname = program_name(entry, device, defines)
    if entry != name:  # one entry per compilation: on the CPU it must be the object's first function
        defines = {**defines, f"TV_{entry.upper()}": 1}
    if device_kind(device) == "CPU":
        from tinyvllm.kernels import cpu_threads
        defines = {**defines, "TV_POOL_ADDR": hex(cpu_threads.pool_address()), "TV_THREADS": cpu_threads.pool_size()}
    return pname, kernel_source(name, device, defines)


def launch(name: str, outs: list[Tensor], ins: list[Tensor], defines: dict[str, int | str],
           estimates=None, entry: str | None = None, grid: tuple[int, int, int] = (1, 1, 1),
           local_size: tuple[int, int, int] | None = None) -> list[Tensor]:
    """Run function `entry` of kernels/<device>/<name>.* on `outs` (written) and `ins` (read), contiguous, on one
    device (split tensors: once per device, `defines` giving one part's shapes); returns the outs."""
    device = outs[0].device
    assert all(t.device == device for t in outs + ins), "one device (or one tuple of devices) for all buffers"
    device = device if isinstance(device, str) else device[0]  # the kind is all a program's source depends on
    pname, source = program_source(name, device, defines, entry)
    if device_kind(device) == "CPU":  # clang starts now, on a core that tracing the rest of the graph leaves idle
        compile_cpu_ahead(source)
    global_size, local_size = ((1, 1, 1), None) if device_kind(device) == "CPU" else (grid, local_size)
    fxn = source_program(pname, source, len(outs), len(ins), estimates, global_size, local_size)
    return outs[0].custom_kernel(*outs[1:], *ins, fxn=fxn)[: len(outs)]


def local_shape(t: Tensor) -> tuple[int, ...]:
    """The shape a kernel sees of `t`: its own, or, split over devices, one device's part."""
    return shard_shape(t) if isinstance(t.device, tuple) else tuple(t.shape)


def output(shape: tuple[int, ...], dtype, like: Tensor, axis: int | None = None) -> Tensor:
    """An output of local shape `shape` on `like`'s device(s), split along `axis` (None: whole on each). The kernel
    must write every element."""
    if isinstance(like.device, str):
        return Tensor.invalids(*shape, dtype=dtype, device=like.device)
    return empty_shards(shape, dtype, like.device, axis)


def check_entry_is_first(lib: bytes, entry: str) -> None:
    """Raise unless function `entry` starts at offset 0 of the first section of compiled object `lib` (tinygrad's
    CPU runtime calls the first byte)."""
    at_start = elf_symbol_at_start(lib, entry)
    if at_start is None:
        raise RuntimeError(f"no function {entry} in the compiled object")
    if not at_start:
        raise RuntimeError(f"{entry} is not the first function of its object: put helpers after it")


def compile_host_program(name: str, defines: dict[str, int | str], entry: str | None = None) -> HostProgram:
    """Compile kernels/cpu/<name>.c and load it as a host callable; `.fxn(*args)` takes ctypes.c_uint64 arguments."""
    # this may run while a graph is traced, where tinygrad forbids device use; compiling realizes nothing.
    with Context(ALLOW_DEVICE_USAGE=1):
        lib = compile_cpu(kernel_source(name, "CPU", defines))
        check_entry_is_first(lib, entry or name)
        return load_cpu_program(lib, name)
