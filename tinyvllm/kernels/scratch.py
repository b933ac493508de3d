"""One scratch memory for every CPU graph of a process.

A captured graph's intermediate buffers (tinygrad's memory planner puts them in one arena per graph) live only while
the graph runs, and graphs run one at a time, so they can all use the same bytes: vLLM captures its CUDA graphs into
one shared memory pool for this reason. Without it every shape bucket keeps an arena of its own, and a server that has
run all its buckets holds their sum (at 1B parameters, 0.4 GiB more than the largest one).

On the host the scratch is one range of addresses reserved at start and backed only where it is touched
(`MAP_NORESERVE`), so each graph's arena starts at its base and the process holds the largest arena, whatever
the order the graphs were built in. A graph's own arena, touched once while it was captured, is given back
(`MADV_REMOVE`). A lock lets one graph at a time run in the scratch. Chapter:
docs/phases/01-appendix-tinygrad-speed.md (a CPU graph).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading

import numpy as np

ENABLED = os.getenv("TINYVLLM_SHARED_SCRATCH", "1") != "0"
PAGE = mmap.PAGESIZE
MADV_REMOVE = 9  # Linux: free a shared mapping's pages (MADV_DONTNEED only unmaps them)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value on x86-64 and arm64 (Python 3.12 names it)


class Scratch:
    """`size` bytes of addresses from `base`, backed where touched; `lock` is held while a graph runs in them."""

    def __init__(self, size: int):
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.base = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        self.size = size
        self.lock = threading.Lock()

    def layout(self, spans: list[tuple[int, int]]) -> list[int] | None:
        """Where each (address, bytes) span goes in the scratch, one after another, each keeping its address modulo a
        page (so its buffers keep their alignment); None if they do not fit."""
        placed, end = [], 0
        for address, nbytes in spans:
            start = -(-end // PAGE) * PAGE + address % PAGE
            placed.append(self.base + start)
            end = start + nbytes
        return placed if end <= self.size else None


@functools.cache
def shared_scratch() -> Scratch | None:
    """The process's scratch: as many addresses as the machine has memory. None where turned off
    (`TINYVLLM_SHARED_SCRATCH=0`), off Linux, or where the system will not reserve addresses without memory behind
    them (strict overcommit)."""
    if not ENABLED or sys.platform != "linux":
        return None
    try:
        return Scratch(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return None


def give_back(address: int, nbytes: int) -> None:
    """Free the whole pages of host memory in [address, address + nbytes) that no one reads again: their contents
    are gone (a later write gets fresh zeroed pages). The allocator's own mapping is shared, so MADV_REMOVE; a
    private one only needs MADV_DONTNEED."""
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if end <= start or sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_REMOVE) != 0:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)
