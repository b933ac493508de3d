"""Python's garbage collector at a process's start: paused while the engine is built, then the heap frozen.

The collector runs whenever allocations outnumber deallocations by a threshold, and each run walks every tracked
object of the generations it collects. A start allocates without pause (the imports of numpy, tinygrad and
tinyvllm are tens of thousands of functions, classes and dicts; a model adds its tensors and graphs): the
collector runs over a hundred times before the first token and finds almost nothing, because what a start builds
lives until the process ends. At exit the interpreter collects once more, over all of it.

vLLM freezes the heap once its engine has started (`freeze_gc_heap`, after the server's and the engine core's
start-up): `gc.freeze()` moves every tracked object to a permanent generation that no collection walks again.
Here the collector is also paused until then, so the start runs no collection at all, and the freeze is not
preceded by a full collection either (that would cost what the pause saved). What the start left as cyclic
garbage stays allocated for the life of the process: a little, as long as the start's code frees what it
drops (the model's loader breaks its one cycle, `LlamaForCausalLM.__init__`). Objects made after the freeze
(requests, outputs, each step's) are collected as always.

This is for a process that builds one engine and keeps it (`python main.py`, `tinyvllm generate`, the benchmarks
of a start); a library call (`LLMEngine(...)`) leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def pause_collection() -> bool:
    """Stop automatic collection (the start of a process); returns whether it was on, for `freeze_heap`."""
    enabled = gc.isenabled()
    gc.disable()
    return enabled


def freeze_heap(enable: bool = True, freeze: bool = True) -> None:
    """Freeze every object made so far (the engine is built) and let collection run again if `enable`."""
    if freeze:
        gc.freeze()
    if enable:
        gc.enable()


@contextlib.contextmanager
def engine_start(freeze: bool = True) -> Iterator[None]:
    """Around a process's imports and engine build: no collection inside, the heap frozen on the way out (also
    when the build raised: the process ends soon, and its exit then skips walking the frozen heap too).
    freeze=False for a caller that lives on after this engine (a test process, a program calling the CLI's
    function): a freeze would keep whatever cyclic garbage it holds then, such as an earlier engine, for good."""
    enabled = pause_collection()
    try:
        yield
    finally:
        freeze_heap(enable=enabled, freeze=freeze)
