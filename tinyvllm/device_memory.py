"""The host's view of tinygrad device memory, where it has one.

On the CPU device tinygrad's buffers are ordinary host memory (anonymous mappings), so a numpy array can
be a view of a buffer: writing the array writes the device buffer, with no copy and no graph to
schedule. Three places use that: loading the weights (`tinyvllm/model/llama.py`), refilling each step's
inputs (`tinyvllm/engine/input_buffer.py`) and allocating the KV caches (`zeros` below). Where the host
cannot see the memory (a discrete GPU), each falls back to copying in or to a kernel.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor
from tinygrad.dtype import DType

from tinyvllm.tinygrad_adapter import allocate_zeroed_host_memory, host_memory, numpy_dtype


def host_view(t: Tensor) -> np.ndarray | None:
    """A numpy array that is `t`'s device memory (allocated here if it is not yet), shaped like `t`;
    None where the host cannot see that memory. `t` must be a plain buffer (e.g. from `Tensor.empty`)."""
    if (memory := host_memory(t)) is None:
        return None
    return np.frombuffer(memory, dtype=numpy_dtype(t.dtype)).reshape(t.shape)


def zeros(shape: tuple[int, ...], dtype: DType, device: str | None) -> Tensor:
    """A realized tensor of zeros, for a cache.

    Zeros, not garbage: attention multiplies the values of masked slots by a probability of 0, and
    0 * NaN would be NaN. On the CPU device no kernel writes them: tinygrad's CPU allocator maps fresh
    anonymous memory, which the OS hands out zeroed and only backs with real pages when first written
    (so a 512 MiB cache costs nothing until used), and `BufferSpec(zero=True)` keeps the buffer out of
    tinygrad's reuse cache (`LRUAllocator`), where a freed buffer's old contents could come back.
    Elsewhere a kernel writes the zeros."""
    out = Tensor.empty(*shape, dtype=dtype, device=device)
    if isinstance(out.device, str) and out.device.split(":")[0] == "CPU":
        allocate_zeroed_host_memory(out)
        return out
    return Tensor.zeros(*shape, dtype=dtype, device=device).contiguous().realize()
