"""Async output processing (seed roadmap 6.10; vLLM v0's, on by default there, `disable_async_output_proc`).

A step ends with host work that the next step's forward pass does not need: turning the new tokens into text,
checking stop strings, building `RequestOutput`s. vLLM v0 runs it for step N while the GPU computes step N+1;
here the "device" is the CPU's own cores, so it runs on a worker thread while the main thread is inside the
captured graph (one ctypes call into C, kernels/cpu/graph_runner.c, which releases the GIL):

    main thread    schedule N+1 | inputs N+1 | graph N+1 (C, no GIL) ------| sample N+1 | update N+1 | return outputs N
    worker                                   | outputs of N (text, stops) |

The worker touches requests only while the main thread is in C, so nothing races. What changes for a user:
step N's outputs come back from step N+1 (the last step returns its own), and a request that a stop string
ends is computed one step more, whose token is dropped (vLLM v0 did the same).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class OutputWorker:
    """One worker thread that runs a piece of host work beside a call of the main thread."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-output")

    def run_beside(self, main: Callable[[], T], beside: Callable[[], None]) -> T:
        """main() on this thread while beside() runs on the worker; returns main's result once both are done.
        An error in either is raised here, after both have finished (beside's first)."""
        future = self._pool.submit(beside)
        try:
            result = main()
        finally:
            future.result()  # beside's work is done (or its error is raised) before the caller goes on
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
