"""Python's garbage collector paused while the engine is built, then the heap frozen (vLLM's `freeze_gc_heap`).

Taught in docs/phases/06-appendix-measurements.md.
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
    """No collection inside; the heap frozen on the way out unless freeze=False (a caller that outlives the engine)."""
    enabled = pause_collection()
    try:
        yield
    finally:
        freeze_heap(enable=enabled, freeze=freeze)
