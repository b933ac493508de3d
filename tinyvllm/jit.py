"""The captured graph a runner replays every step: TinyJit, or Phase 5's CPU graph. Chapter: 01-foundation.md."""

from __future__ import annotations

from tinygrad import TinyJit

from tinyvllm.plugins import provided


def tiny_jit(fxn, persist=None):
    """tinygrad's TinyJit: runs `fxn` eagerly once, captures the second call, replays from the third."""
    jit = TinyJit(fxn)
    jit.ran_in_c = False  # the CPU graph's flag: its kernels are done when a call returns
    return jit


class Eager:
    """vLLM's --enforce-eager: the step run as written, scheduled and lowered anew at every call (no graph)."""

    ran_in_c = False

    def __init__(self, fxn, persist=None):
        self.fxn = fxn

    def __call__(self, *args, **kwargs):
        return self.fxn(*args, **kwargs)


Jit = provided("jit", tiny_jit)  # Jit(fxn, persist=None): what every runner captures its step with
