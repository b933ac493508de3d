"""The CPU kernels' thread pool: helper threads started once, used by every kernel launch.

Chapter: docs/phases/05-custom-kernels.md, section 5.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.tinygrad_ext.startup import default_cpu_threads

MAX_WORKERS = 15  # TV_MAX_WORKERS in threadpool.h
NUM_THREADS = max(1, min(int(os.getenv("TINYVLLM_CPU_THREADS", str(default_cpu_threads()))), MAX_WORKERS + 1))
_ADDRESS_HINT = 0x3F0000000000  # far from the heap, the libraries and tinygrad's buffers (all near 0x55.., 0x7f..)


class TvPool(ctypes.Structure):
    """Mirror of `struct tv_pool` in kernels/cpu/threadpool.h (same fields, same order)."""

    _fields_ = [
        ("enabled", ctypes.c_uint32), ("num_workers", ctypes.c_uint32), ("stop", ctypes.c_uint32),
        ("pad0", ctypes.c_uint32), ("sem_wait", ctypes.c_void_p), ("sem_post", ctypes.c_void_p),
        ("sched_yield", ctypes.c_void_p),
        ("ticket", ctypes.c_uint64), ("finished", ctypes.c_uint32), ("owner", ctypes.c_uint32),
        ("fn", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
        ("sleeping", ctypes.c_uint32 * (MAX_WORKERS + 1)),
        ("sems", (ctypes.c_uint64 * 4) * MAX_WORKERS),  # sem_t is 32 bytes on Linux (x86-64 and arm64)
    ]


@dataclass
class _PoolState:
    pool: TvPool | None = None
    address: int = 0
    program: Any = None  # the compiled helper loop (a CPUProgram): its code must outlive the threads running it
    threads: list[threading.Thread] = field(default_factory=list)
    libc: ctypes.CDLL | None = None
    failed: bool = False  # starting failed once: stay single-threaded rather than map another block


_state = _PoolState()
_lock = threading.Lock()


def _supported() -> bool:
    # unnamed POSIX semaphores (sem_init) are Linux-only; elsewhere kernels run single-threaded
    return sys.platform == "linux" and NUM_THREADS > 1


def _map_control_block(libc: ctypes.CDLL) -> int:
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # a hint, not MAP_FIXED: if the address is taken the kernel picks another and kernels compile for that one
    addr = libc.mmap(_ADDRESS_HINT, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the CPU thread pool's control block failed")
    return addr


def _start() -> None:
    from tinyvllm.kernels.launcher import compile_host_program

    libc = ctypes.CDLL(None, use_errno=True)
    address = _map_control_block(libc)
    pool = TvPool.from_address(address)  # the page comes zeroed: enabled=0, ticket=0, owner=0
    pool.sem_wait = ctypes.cast(libc.sem_wait, ctypes.c_void_p).value
    pool.sem_post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
    pool.sched_yield = ctypes.cast(libc.sched_yield, ctypes.c_void_p).value
    num_workers = NUM_THREADS - 1
    for i in range(num_workers):
        if libc.sem_init(ctypes.c_void_p(ctypes.addressof(pool.sems[i])), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
    pool.num_workers = num_workers
    program = compile_host_program("threadpool_worker", {})
    threads = [threading.Thread(target=program.fxn, args=(ctypes.c_uint64(address), ctypes.c_uint64(i)),
                                name=f"tinyvllm-cpu-{i}", daemon=True) for i in range(num_workers)]
    for t in threads:
        t.start()
    pool.enabled = 1
    _state.pool, _state.address, _state.program, _state.threads, _state.libc = pool, address, program, threads, libc
    atexit.register(_stop)


def _stop() -> None:
    """Let the helpers return before exit unmaps the program their loop runs in (a spinning one would crash)."""
    pool, libc = _state.pool, _state.libc
    if pool is None or libc is None or not _state.threads:
        return
    pool.enabled = 0  # launches from now on run on the calling thread
    pool.stop = 1
    for i in range(len(_state.threads)):  # wake parked helpers; a spinning one sees `stop` by itself
        libc.sem_post(ctypes.c_void_p(ctypes.addressof(pool.sems[i])))
    for t in _state.threads:
        t.join(timeout=2.0)
    _state.threads = []


def pool_address() -> int:
    """Address of the control block, starting the helpers on first call; 0 when kernels run single-threaded."""
    with _lock:
        if _state.pool is None and not _state.failed and _supported():
            try:
                _start()
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:  # no clang, mmap refused, ...
                _state.failed = True
                print(f"tinyvllm: CPU kernels run single-threaded ({e})", file=sys.stderr)
        return _state.address


@contextlib.contextmanager
def threads_enabled(enabled: bool) -> Iterator[None]:
    """Temporarily run CPU kernels with (True) or without (False) the helper threads."""
    pool = _state.pool
    old = None if pool is None else pool.enabled
    if pool is not None:
        pool.enabled = int(enabled)
    try:
        yield
    finally:
        if pool is not None:
            pool.enabled = old


def pool_size() -> int:
    """Threads of the started pool (the launching thread + its helpers), whether or not it is enabled now; 1 without
    one. The CPU kernels are compiled for it (TV_THREADS: a matrix-vector product's share per thread)."""
    pool = _state.pool
    return 1 if pool is None else 1 + pool.num_workers


def num_threads() -> int:
    """Threads a CPU kernel launch uses now (the launching thread + running helpers)."""
    pool = _state.pool
    return 1 if pool is None or not pool.enabled else 1 + pool.num_workers


def _after_fork_in_child() -> None:
    # the helpers were not copied into the child; the control block was (copy-on-write): switch it off
    if _state.pool is not None:
        _state.pool.enabled, _state.pool.num_workers, _state.threads = 0, 0, []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
