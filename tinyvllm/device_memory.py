"""The host's view of tinygrad device memory, where it has one, and how much there is
(docs/phases/01-appendix-tinygrad-speed.md)."""

from __future__ import annotations

import numpy as np
from tinygrad import Device, Tensor
from tinygrad.dtype import DType

from tinyvllm.platforms import platform_for
from tinyvllm.tinygrad_ext.buffers import (
    allocate_zeroed_host_memory, empty, host_memory, memory_info, numpy_dtype, sharded_zeros)


def host_view(t: Tensor) -> np.ndarray | None:
    """A numpy array over plain buffer `t`'s device memory (allocated if need be); None where the host cannot see it."""
    if not platform_for(t.device).host_views or (memory := host_memory(t)) is None:
        return None
    return np.frombuffer(memory, dtype=numpy_dtype(t.dtype)).reshape(t.shape)


class ReadBack:
    """Reads a graph's output back to the host, step after step, through a host view made once."""

    def __init__(self):
        self._tensor: Tensor | None = None  # kept alive with its view
        self._view: np.ndarray | None = None

    def __call__(self, t: Tensor, wait: bool = True) -> np.ndarray:
        if t is not self._tensor:
            self._tensor, self._view = t, None if isinstance(t.device, tuple) else host_view(t)
        if self._view is None:
            return t.numpy()
        if wait:
            Device[t.device].synchronize()
        return self._view.copy()


def zeros(shape: tuple[int, ...], dtype: DType, device: str | tuple[str, ...] | None, axis: int = 2) -> Tensor:
    """Realized zeros (masked values times 0 must not be NaN); a device tuple splits on `axis`."""
    if isinstance(device, tuple):
        return sharded_zeros(shape, dtype, device, axis)
    out = empty(shape, dtype, device)
    if platform_for(out.device).host_views:
        allocate_zeroed_host_memory(out)
        return out
    return Tensor.zeros(*shape, dtype=dtype, device=device).contiguous().realize()


def free_device_memory(device: str | None) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU's memory now; None on the CPU or where the driver cannot say."""
    platform = platform_for(device)
    if not platform.is_gpu:
        return None
    return memory_info(device if device is not None else platform.kind)
