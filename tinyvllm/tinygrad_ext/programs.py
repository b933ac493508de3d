"""Hand-written kernels as tinygrad programs: built into the graph, compiled, loaded on the host
(docs/phases/05-custom-kernels.md, section 5)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from tinygrad import Device, Tensor, UOp
from tinygrad.device import TinyELF
from tinygrad.helpers import DEV
from tinygrad.renderer import Estimates
from tinygrad.renderer.cstyle import ClangRenderer
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo

# the clang renderer's kernel entry declaration (the CPU's TV_KERNEL)
CLANG_KERNEL_PREFIX: str = ClangRenderer.kernel_typedef


def renderer_name(kind: str) -> str:
    """The renderer DEV selects for device kind `kind` ("": the default), without opening the device."""
    return DEV.target(kind).renderer


def kernel_cost(ops: int = 0, lds: int = 0, mem: int = 0) -> Estimates:
    """A kernel's cost as DEBUG=2 rates it: operations, bytes loaded and stored, bytes touched once."""
    return Estimates(ops=ops, lds=lds, mem=mem)


def kernel_info(name: str, estimates: Estimates | None = None, opts_to_apply: tuple | None = None) -> KernelInfo:
    """A kernel SINK's info; opts_to_apply None: tinygrad's optimizer chooses; (): the kernel as written."""
    return KernelInfo(name=name, estimates=estimates, opts_to_apply=opts_to_apply)


def source_program(name: str, source: str, num_outs: int, num_ins: int, estimates: Estimates | None = None,
                   global_size: tuple[int, int, int] = (1, 1, 1), local_size: tuple[int, int, int] | None = None):
    """The `fxn` for `Tensor.custom_kernel`: the params of (outs..., ins...) -> PROGRAM(SINK, LINEAR, SOURCE)."""
    num = num_outs + num_ins
    info = ProgramInfo(name=name, global_size=global_size, local_size=local_size, globals=tuple(range(num)),
                       outs=tuple(range(num_outs)), ins=tuple(range(num_outs, num)))

    def fxn(*params: UOp) -> UOp:
        assert len(params) == num, f"{name}: expected {num} buffers, got {len(params)}"
        sink = UOp.sink(*params, arg=kernel_info(name, estimates))
        linear = UOp(Ops.LINEAR, src=(*sink.src, sink))
        return UOp(Ops.PROGRAM, src=(sink, linear, UOp(Ops.SOURCE, arg=source)), arg=info)
    return fxn


def kernel_input(t: Tensor) -> Tensor:
    """`t.contiguous()`, except a reshape of another custom kernel's output (tinygrad would copy it)."""
    u = t.uop
    while u.op is Ops.RESHAPE:
        u = u.src[0]
    if isinstance(t.device, str) and u.op is Ops.AFTER and any(s.op is Ops.CALL for s in u.src[1:]):
        return t
    return t.contiguous()


def compile_cpu(source: str) -> bytes:
    """C source -> the CPU device's compiled object, through tinygrad's on-disk cache."""
    return Device["CPU"].compiler.compile_cached(source)


@dataclass(frozen=True)
class HostProgram:
    """A compiled object loaded on the host: `fxn(*args)` takes ctypes.c_uint64s; `program` holds its memory."""

    name: str
    addr: int
    fxn: Any
    program: Any = field(repr=False)


def load_cpu_program(lib: bytes, name: str) -> HostProgram:
    """A compiled object as a host-callable program."""
    dev = Device["CPU"]
    program = dev.runtime(TinyELF(lib, name, dev.renderer.target, ()))
    return HostProgram(name, program.addr, program.fxn, program)


def elf_symbol_at_start(lib: bytes, symbol: str) -> bool | None:
    """Does `symbol` start at offset 0 of the first code section of ELF object `lib`?"""
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
