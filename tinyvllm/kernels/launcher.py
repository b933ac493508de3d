"""Running a hand-written kernel inside tinygrad's graph, so that TinyJit captures and replays it.

tinygrad turns a graph of tensor ops into a list of *programs*, each one compiled function launched on
buffers. A program is a UOp tree:

    PROGRAM(arg=ProgramInfo: name, which args are buffers, which are written (outs) / read (ins))
      ├── SINK       the kernel's inputs: one PARAM per buffer     (what tinygrad's own kernels start from)
      ├── LINEAR     the instruction list                          (here: just the params)
      ├── SOURCE     the source text                               (tinygrad renders its own; we bring ours)
      └── BINARY     the compiled object                           (added by tinygrad: codegen `do_compile`)

tinygrad's own kernels go SINK -> LINEAR -> SOURCE -> BINARY (tinygrad/codegen/__init__.py, pm_to_program).
A raw-source program enters that pipeline at the last step: we hand it SINK, LINEAR and SOURCE, and when the
graph is lowered tinygrad compiles SOURCE with the device's own compiler (clang on CPU, nvrtc on CUDA, ...),
caching the binary on disk by source text. `Tensor.custom_kernel(out, *ins, fxn=...)` puts the program into
the graph as a CALL on those tensors; from there on it is an ordinary kernel: scheduled after whatever
produces its inputs, captured by TinyJit with its buffers, replayed with new input buffers on every call.

    kernels/cpu/matmul.c --read, #define shapes--> source --custom_kernel--> CALL(PROGRAM, out, x, w) in graph
                                                                               | lowering: clang -O2 -march=native
                                                                               v
                                                     CPU runtime: jump to the image's first byte with the
                                                     buffer addresses as arguments (tinygrad/runtime/ops_cpu.py)

On CPU, "launch" is a plain function call: the runtime maps the compiled object into executable memory and
calls its first byte with every argument as a 64-bit integer, from the thread that runs the graph (the Python
thread; with HCQ2=1 a queue thread), one program at a time. So a CPU kernel's entry function must be the first
function in its file (`check_entry_is_first` verifies a compiled object), and using more than one core is the
kernel's own business (`cpu_threads.py`). GPU kernels get a grid instead: `global_size` x `local_size`.

Sizes are compile-time constants (`#define` per shape, one program per shape). A runtime size would have to be
a symbolic variable that TinyJit binds from its inputs at every replay (as `start_pos` is); constants need
nothing at replay but the buffer addresses, and let the compiler specialise the loops.

Kernel sources live in `kernels/<device>/` at the top of the repository. A kernel may include helpers from
its own folder with `#include "name.h"`: tinygrad compiles from a string, so the launcher pastes them in.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from tinygrad import Device, Tensor
from tinygrad.device import TinyELF
from tinygrad.helpers import DEV, Context
from tinygrad.renderer import Estimates
from tinygrad.renderer.cstyle import ClangRenderer
from tinygrad.runtime.autogen import libc
from tinygrad.runtime.support.elf import elf_loader
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


@dataclass(frozen=True)
class KernelBackend:
    """Where a device's kernel sources live and which tinygrad renderer compiles them."""

    folder: str  # kernels/<folder>/
    suffix: str  # file extension of its sources
    renderers: tuple[str, ...]  # tinygrad renderer names whose compiler takes this language ("" = device default)
    kernel_prefix: str  # what goes before an entry function's name (tinygrad's kernel_typedef), as TV_KERNEL


BACKENDS: dict[str, KernelBackend] = {
    # the CPU device's default renderer is clang (tinygrad/runtime/ops_cpu.py); DEV=CPU:LLVM would compile LLVM IR
    "CPU": KernelBackend("cpu", ".c", ("", "CLANG"), ClangRenderer.kernel_typedef),
}


def device_kind(device: str) -> str:
    """'CPU:1' -> 'CPU'."""
    return device.split(":")[0].upper()


def kernel_path(name: str, device: str) -> Path | None:
    backend = BACKENDS.get(device_kind(device))
    return None if backend is None else KERNELS_DIR / backend.folder / f"{name}{backend.suffix}"


def has_kernel(name: str, device: str) -> bool:
    """Is there a source for kernel `name` on `device`, in a language that device's compiler takes?

    Decided from the device name and the DEV setting alone (no device is opened): this runs while a graph is
    being traced, where tinygrad forbids touching devices."""
    kind = device_kind(device)
    if (backend := BACKENDS.get(kind)) is None or (path := kernel_path(name, device)) is None:
        return False
    return DEV.target(kind).renderer in backend.renderers and path.is_file()


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
    """The full source tinygrad compiles: `#define`s (shapes, ...), TV_KERNEL, then the file with its includes."""
    backend, path = BACKENDS[device_kind(device)], kernel_path(name, device)
    assert path is not None and path.is_file(), f"no kernel {name!r} for {device}"
    header = [f"#define {k} {v}" for k, v in defines.items()] + [f"#define TV_KERNEL {backend.kernel_prefix}"]
    return "\n".join(header) + "\n" + _read_source(path)


def program_name(name: str, defines: dict[str, int | str]) -> str:
    """A readable, unique name per compiled variant, e.g. matmul_1_960_576 (what DEBUG=2 prints per launch)."""
    return "_".join([name] + [str(v) for k, v in defines.items() if not k.startswith("TV_POOL")])


def make_program(name: str, source: str, num_outs: int, num_ins: int, estimates: Estimates | None = None,
                 global_size: tuple[int, int, int] = (1, 1, 1), local_size: tuple[int, int, int] | None = None):
    """The `fxn` for `Tensor.custom_kernel`: given the params of (outs..., ins...), build the PROGRAM UOp.

    ProgramInfo tells tinygrad which arguments are buffers (all), which the kernel writes (the first
    num_outs) and which it reads: the scheduler orders kernels by it, and TinyJit knows what to copy.
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


def launch(name: str, outs: list[Tensor], ins: list[Tensor], defines: dict[str, int | str],
           estimates: Estimates | None = None, global_size: tuple[int, int, int] = (1, 1, 1),
           local_size: tuple[int, int, int] | None = None) -> list[Tensor]:
    """Run kernel `name` from kernels/<device>/ on `outs` (written) and `ins` (read), all on one device.

    Every tensor must be contiguous (the kernel sees raw row-major buffers); `outs` are usually
    `Tensor.empty(...)`. Returns the outs, valid after the kernel ran. Works inside `function` and TinyJit."""
    device = outs[0].device
    assert isinstance(device, str) and all(t.device == device for t in outs + ins), "one device for all buffers"
    if device_kind(device) == "CPU":
        from tinyvllm.kernels import cpu_threads
        defines = {**defines, "TV_POOL_ADDR": hex(cpu_threads.pool_address())}
    source = kernel_source(name, device, defines)
    fxn = make_program(program_name(name, defines), source, len(outs), len(ins), estimates, global_size, local_size)
    return outs[0].custom_kernel(*outs[1:], *ins, fxn=fxn)[: len(outs)]


def check_entry_is_first(lib: bytes, entry: str) -> None:
    """Raise unless function `entry` starts at offset 0 of the first section of compiled object `lib`.

    tinygrad's CPU runtime loads the object's sections back to back and calls the first byte, so a helper
    function compiled before the entry would be called in its place."""
    _, sections, _ = elf_loader(lib)
    symtab = next(s for s in sections if s.name == ".symtab")
    strtab = next(s for s in sections if s.name == ".strtab")
    first = next(i for i, s in enumerate(sections) if s.header.sh_type == libc.SHT_PROGBITS)
    syms = (libc.Elf64_Sym * (len(symtab.content) // ctypes.sizeof(libc.Elf64_Sym))).from_buffer_copy(symtab.content)
    for sym in syms:
        if strtab.content[sym.st_name:].split(b"\0", 1)[0].decode() == entry:
            if sym.st_shndx != first or sym.st_value != 0:
                raise RuntimeError(f"{entry} is not the first function of its object: put helpers after it")
            return
    raise RuntimeError(f"no function {entry} in the compiled object")


def compile_host_program(name: str, defines: dict[str, int | str], entry: str | None = None):
    """Compile kernels/cpu/<name>.c and load it as a callable on the host (not as a graph node).

    Used to start the CPU thread pool's helper threads. Returns tinygrad's CPUProgram; `.fxn(*args)` calls it
    with ctypes.c_uint64 arguments."""
    # NOTE: this may run while a graph is being traced (the first `linear`), where tinygrad forbids device use
    # so that no tensor is realized by accident. Compiling and loading code realizes nothing.
    with Context(ALLOW_DEVICE_USAGE=1):
        dev = Device["CPU"]
        source = kernel_source(name, "CPU", defines)
        lib = dev.compiler.compile_cached(source)
        check_entry_is_first(lib, entry or name)
        return dev.runtime(TinyELF(lib, name, dev.renderer.target, ()))
