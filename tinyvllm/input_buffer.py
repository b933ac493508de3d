"""Step inputs that live on the device for good and are refilled in place (vLLM's persistent input buffers).

Every step hands the captured graph a few small arrays: token ids, positions, the slot mapping, block
tables. Making a new tensor for each, `Tensor(array).realize()`, schedules and runs a copy through
tinygrad: Python work per input per step, a large share of a small decode step once there are four
inputs. vLLM's GPU model runner allocates its input tensors once, at the largest size, and copies each
step's values into them (`CpuGpuBuffer` in vllm/v1/worker/gpu_model_runner.py); CUDA graphs need that
anyway, since a graph replays with the addresses it was captured with.

`InputBuffer` does the same. On the CPU device its numpy array *is* the device memory (a zero-copy view
of the buffer tinygrad allocated), so filling the array is the whole copy; elsewhere the array is a host
staging copy that `copy_to_device` sends over.

    buf = InputBuffer((1, 32), np.int32, device)
    buf.np[0, :n] = token_ids          # host writes, in place
    jit(buf.copy_to_device(), ...)     # the same device buffer every step: nothing to schedule

A buffer must not be refilled while a step that reads it may still be running. On the CPU, tinygrad and
the CPU graph run kernels synchronously, so a step has finished when its call returns.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from tinyvllm.device_memory import host_view
from tinyvllm.tinygrad_ext.buffers import copy_in, tinygrad_dtype


class InputBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: np.dtype | type, device: str | None):
        dtype = np.dtype(dtype)
        self.tensor = Tensor.empty(*shape, dtype=tinygrad_dtype(dtype), device=device)
        view = host_view(self.tensor)
        if view is not None:  # the CPU device: the numpy array is the device memory itself
            self.np, self._staged = view, False
        else:  # device memory the host cannot see: stage on the host, copy per step
            self.np, self._staged = np.zeros(shape, dtype), True
        self.np[...] = 0

    def copy_to_device(self) -> Tensor:
        if self._staged:
            copy_in(self.tensor, memoryview(np.ascontiguousarray(self.np)).cast("B"))
        return self.tensor

    def write(self, values) -> Tensor:
        """Fill the whole buffer with `values` (broadcast as numpy does) and return the device tensor."""
        self.np[...] = values
        return self.copy_to_device()
