"""Device memory through tinygrad's buffers: new tensors, addresses, host views, copies in, split tensors
(docs/phases/01-appendix-tinygrad-speed.md)."""

from __future__ import annotations

import ctypes
import functools
import math

from tinygrad import Device, Tensor, UOp
from tinygrad.device import BufferSpec, MultiBuffer, canonicalize_device
from tinygrad.dtype import DType, _from_np_dtype, _to_np_dtype
from tinygrad.uop.ops import Ops, shape_to_shape_arg


def empty(shape: tuple[int, ...], dtype: DType, device: str | None) -> Tensor:
    """`Tensor.empty` on one device, its reshape simplified once per shape."""
    buffer = UOp.new_buffer(canonicalize_device(device), math.prod(shape), dtype)
    reshaped = UOp(Ops.RESHAPE, src=(buffer, *_reshape_sources(tuple(shape))))
    return Tensor(buffer if reshaped.shape == buffer.shape else reshaped)


@functools.lru_cache(maxsize=None)
def _reshape_sources(shape: tuple[int, ...]) -> tuple[UOp, ...]:
    return UOp.sink(shape_to_shape_arg(shape)).simplify().src


def tensor_over_memory(address: int, shape: tuple[int, ...], dtype: DType, device: str | None, owner: object) -> Tensor:
    """A tensor over the host memory at `address`, nothing copied; the buffer keeps `owner` alive."""
    t = empty(shape, dtype, device)
    t.uop.buffer.allocate(external_ptr=address)
    t.uop.buffer.tinyvllm_memory_owner = owner
    return t


def is_realized(t: Tensor) -> bool:
    return t.uop.is_realized


def buffer_address(x) -> int:
    """The address of a tensor's or a `Buffer`'s memory, allocated if need be."""
    buf = x.uop.buffer if isinstance(x, Tensor) else x
    return buf.ensure_allocated().get_buf(buf.device).va_addr


def input_shard_address(u: UOp, shard: int) -> int:
    """The address of a JIT input's buffer (shard -1), or of device `shard`'s part of a `MultiBuffer`."""
    buf = u.buffer
    if shard >= 0:
        assert isinstance(buf, MultiBuffer), f"input {u} is on one device, not split over several"
        buf = buf.bufs[shard]
    return buffer_address(buf)


def numpy_dtype(dtype: DType) -> type:
    return _to_np_dtype(dtype)


def tinygrad_dtype(dtype) -> DType:
    return _from_np_dtype(dtype)


def host_memory(t: Tensor) -> memoryview | None:
    """`t`'s device memory as a memoryview; None where the host cannot see it."""
    buf = t.uop.buffer.ensure_allocated()
    try:
        return buf.as_memoryview(force_zero_copy=True)
    except AssertionError:  # tinygrad: "force zero copy was passed, but copy is required"
        return None


def allocate_zeroed_host_memory(t: Tensor) -> None:
    """Allocate a fresh `t` zeroed, outside tinygrad's `LRUAllocator` (which could hand back old contents)."""
    buf = t.uop.buffer
    buf.options = BufferSpec(zero=True, nolru=True)
    buf.allocate()


def copy_in(t: Tensor, data: memoryview) -> None:
    """Copy `data` into `t`'s device buffer now; `data` may be reused at once."""
    buf = t.uop.buffer.ensure_allocated()
    assert len(data) == buf.nbytes, f"copy_in: {len(data)} bytes into a buffer of {buf.nbytes}"
    buf.allocator._copyin(buf._buf, data)


def memory_info(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU's memory; None where tinygrad cannot ask."""
    kind = device.split(":")[0].upper()
    dev = Device[device]
    if kind == "CUDA":
        from tinygrad.runtime.autogen import cuda
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        cuda.cuCtxSetCurrent(dev.context)
        if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value
    if kind == "METAL":
        total = int(dev.sysdevice.recommendedMaxWorkingSetSize())
        return max(total - int(dev.sysdevice.currentAllocatedSize()), 0), total
    return None


# ---- tensors split over several devices (tensor parallel, Phase 8) ----

def sharded_zeros(shape: tuple[int, ...], dtype: DType, devices: tuple[str, ...], axis: int) -> Tensor:
    """Realized zeros of `shape` split along `axis` over `devices`, each part zeroed where it lives."""
    assert shape[axis] % len(devices) == 0, f"{shape} does not split along axis {axis} over {len(devices)} devices"
    shard = tuple(s // len(devices) if i == axis else s for i, s in enumerate(shape))
    local = Tensor.zeros(*shard, dtype=dtype, device=devices).contiguous().realize()
    return Tensor(local.uop.unshard(axis))


def empty_shards(shard: tuple[int, ...], dtype: DType, devices: tuple[str, ...], axis: int | None) -> Tensor:
    """An unrealized buffer of shape `shard` on every device, split along `axis` (None: replicas)."""
    local = Tensor.invalids(*shard, dtype=dtype, device=devices)  # contents undefined
    return local if axis is None else Tensor(local.uop.unshard(axis))


def shard_shape(t: Tensor) -> tuple[int, ...]:
    """The shape of one device's part of `t`."""
    return tuple(t.uop.shard_shape)


def shard_axis(t: Tensor) -> int | None:
    """The axis `t` is split along (None: one device, or replicated)."""
    return t.uop.axis if isinstance(t.device, tuple) else None
