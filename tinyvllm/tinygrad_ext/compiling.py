"""Compiling a process's first kernels sooner: the intrinsics header parsed once, and compile workers that stay.

A new process with empty caches compiles every kernel its first request needs (`Generator.warm_up` says how many),
on tinygrad's pool of worker processes. Three costs in that were not compiling at all:

- Every hand-written kernel that uses SIMD intrinsics includes `<immintrin.h>`: 1.3 MB of declarations that clang
  parsed again for each kernel, most of a small kernel's compile. Here it is parsed once per machine into a clang
  precompiled header (PCH) beside tinyvllm's other caches, and each compile that includes it reads that instead.
  The object clang writes is the same, byte for byte; a PCH clang refuses (another clang, headers changed) is built
  again, and failing that the kernel compiles as before.
- tinygrad's pool replaces each worker after 16 tasks (for BEAM search's memory), so a first request's 50 kernels
  start six worker processes, each importing tinygrad again. Here the pool's workers live as long as the process
  (unless BEAM is on), and each one compiles with the precompiled header.
- The pool started only when the traced graph was lowered, and then waited for the slowest kernels, the hand-written
  ones, at the end. `compile_ahead` hands a hand-written kernel to the pool the moment it is traced, so clang runs
  on the core that tracing leaves idle; when the graph is lowered, its compile is found in tinygrad's disk cache.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tinygrad import Context, Device
from tinygrad.engine import realize, worker
from tinygrad.helpers import BEAM, PARALLEL, diskcache_get, getenv
from tinygrad.runtime.support.compiler_cpu import ClangCompiler

PCH_INCLUDE = "#include <immintrin.h>"  # the one system header the hand-written CPU kernels include

_plain_compile = ClangCompiler.compile  # tinygrad's own, for every source without the header
_pch_dir: Path | None = None  # where this process keeps its PCH (None: it compiles without one)
_pch_paths: dict[tuple, Path | None] = {}  # (directory, clang, flags) -> its PCH (None: none can be built there)
_rebuilt: set[tuple] = set()  # keys whose PCH clang refused and this process built again
_lock = threading.Lock()


def clang_flags(compiler: ClangCompiler) -> list[str]:
    """The flags tinygrad's `ClangCompiler.compile` passes (compiler_cpu.py), without input and output."""
    return ["-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-nostdlib", "-fno-ident",
            f"--target={compiler.arch}-none-unknown-elf", *compiler.args]


def clang_binary() -> str:
    return getenv("CC", "clang")


def precompiled_header(compiler: ClangCompiler, directory: Path, rebuild: bool = False) -> Path | None:
    """The PCH of `<immintrin.h>` for `compiler`'s flags in `directory`, built if missing (or `rebuild`, once per
    process); None where clang cannot build one. Its name carries the flags and which clang binary built it."""
    key = (str(directory), clang_binary(), *clang_flags(compiler))
    with _lock:
        if rebuild and key in _rebuilt:  # refused again after a rebuild: this process compiles without one
            _pch_paths[key] = None
        elif rebuild or key not in _pch_paths:
            _pch_paths[key] = _build(Path(directory), key[1], key[2:], rebuild)
            _rebuilt.update([key] if rebuild else [])
        return _pch_paths[key]


def _build(directory: Path, cc: str, flags: tuple, rebuild: bool) -> Path | None:
    if (exe := shutil.which(cc)) is None:
        return None
    st = os.stat(exe)  # a new clang: a new name (clang would refuse the old file)
    digest = hashlib.sha256(repr((os.path.realpath(exe), st.st_size, st.st_mtime_ns, flags, PCH_INCLUDE))
                            .encode()).hexdigest()[:16]
    path = directory / f"immintrin-{digest}.pch"
    if path.exists() and not rebuild:
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".pch.tmp")
        os.close(fd)
    except OSError:
        return None
    try:
        subprocess.run([cc, "-x", "c-header", *flags, "-", "-o", tmp], input=(PCH_INCLUDE + "\n").encode(),
                       check=True, capture_output=True)
        os.replace(tmp, path)  # a process building the same file at the same time writes the same bytes
        return path
    except (OSError, subprocess.CalledProcessError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None


def compile_against(compiler: ClangCompiler, src: str, pch: Path) -> bytes | None:
    """`src` compiled as tinygrad compiles it, `<immintrin.h>` read from `pch`; None if clang failed (a PCH it
    refuses, as after a clang upgrade, or a wrong source)."""
    cmd = [clang_binary(), "-c", "-x", "c", *clang_flags(compiler), "-include-pch", str(pch), "-", "-o", "-"]
    done = subprocess.run(cmd, input=src.encode("utf-8"), capture_output=True)
    return done.stdout if done.returncode == 0 else None


def compile_with_pch(self: ClangCompiler, src: str) -> bytes:
    """`ClangCompiler.compile`, reading `<immintrin.h>` from the precompiled header where the source includes it."""
    if (lib := _compiled_ahead(self, src)) is not None:
        return lib
    if _pch_dir is None or PCH_INCLUDE not in src or (pch := precompiled_header(self, _pch_dir)) is None:
        return _plain_compile(self, src)
    if (lib := compile_against(self, src, pch)) is not None:
        return lib
    lib = _plain_compile(self, src)  # a wrong source fails here, with clang's own message
    precompiled_header(self, _pch_dir, rebuild=True)  # the source is right, so clang refused the PCH: build anew
    return lib


def use_precompiled_header(directory: Path | None) -> None:
    """Compile CPU kernels that include `<immintrin.h>` against a PCH kept in `directory` (None: never)."""
    global _pch_dir
    _pch_dir = Path(directory) if directory is not None else None
    ClangCompiler.compile = compile_with_pch if directory is not None else _plain_compile


# ---- the compile pool: tinygrad's, with workers that stay and compile with the PCH ----

def _init_compile_worker(pch_dir: str | None) -> None:
    worker._init_worker()  # tinygrad's: no device, no Ctrl-C, no VIZ
    use_precompiled_header(Path(pch_dir) if pch_dir else None)


def compile_pool():
    """tinygrad's worker pool (None: compile in this process), created here on first use: its workers are not
    replaced after 16 tasks unless BEAM search is on, and they read the precompiled header."""
    if worker.worker_pool is None and not multiprocessing.current_process().daemon and PARALLEL.value > 0:
        per_child = getenv("BEAM_MAX_TASKS_PER_CHILD", 16) if BEAM.value else None
        pool = worker._WorkerContext().Pool(PARALLEL.value, _init_compile_worker,
                                            (str(_pch_dir) if _pch_dir else None,), per_child)
        worker.worker_pool = pool
        atexit.register(pool.close)
    return worker.get_worker_pool()


_ahead: dict[str, object] = {}  # sources compile_ahead handed to the pool in this process -> its AsyncResult
AHEAD_TIMEOUT_S = 300


def _compile_source(compiler: ClangCompiler, src: str) -> None:  # in a worker: into tinygrad's disk cache
    compiler.compile_cached(src)


def compile_ahead(compiler, src: str) -> None:
    """Compile C source `src` on the pool now, unless tinygrad's disk cache has it: the graph being captured finds it
    compiled when it is lowered. Nothing happens outside a capture (an eager kernel is lowered at once), without a
    pool (PARALLEL=0) or for another compiler."""
    if not realize.capturing or type(compiler) is not ClangCompiler or src in _ahead or compiler.cachekey is None:
        return
    _ahead[src] = None
    if diskcache_get(compiler.cachekey, src) is None and (pool := compile_pool()) is not None:
        _ahead[src] = pool.apply_async(_compile_source, (compiler, src))


def _compiled_ahead(compiler: ClangCompiler, src: str) -> bytes | None:
    """This process's own compile of `src` (a graph with one kernel lowers in this process): the pool's, if
    compile_ahead started one, rather than clang again."""
    if (pending := _ahead.get(src)) is None:
        return None
    try:
        pending.get(timeout=AHEAD_TIMEOUT_S)  # a worker killed mid-task (out of memory) leaves it pending for ever
    except Exception:  # noqa: BLE001  (clang here reports the error, or compiles what the pool never did)
        return None
    return diskcache_get(compiler.cachekey, src)


def compile_cpu_ahead(source: str) -> None:
    """`compile_ahead` on the CPU device's compiler: called by `launch` as it traces a hand-written kernel."""
    with Context(ALLOW_DEVICE_USAGE=1):  # a graph is being traced, where tinygrad forbids device use; it is open
        compiler = Device["CPU"].compiler
    compile_ahead(compiler, source)


def install(pch_dir: Path | None) -> None:
    """The precompiled header and the pool, for this process and the compile workers it starts; idempotent."""
    use_precompiled_header(pch_dir)
    realize.get_worker_pool = compile_pool
