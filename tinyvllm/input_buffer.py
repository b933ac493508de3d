"""Step inputs that live on the device for good and are refilled in place (vLLM's persistent input buffers).

Chapter: docs/phases/01-appendix-tinygrad-speed.md (persistent step inputs).
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
