"""Device memory through tinygrad's buffers: new tensors, addresses, host views, copies in, split tensors.

    Tensor --.uop--> UOp (a BUFFER, or a RESHAPE of one) --.buffer--> Buffer --get_buf(device).va_addr--> address
                                                                        |--as_memoryview()--> the bytes (CPU)
                                                                        +--allocator._copyin(_buf, bytes)

On the CPU device a buffer is host memory: tinyvllm reads and writes it in place (tinyvllm/device_memory.py).
Chapter: docs/phases/01-appendix-tinygrad-speed.md (persistent step inputs, starting fast).
"""

from __future__ import annotations

import ctypes
import functools
import math

from tinygrad import Device, Tensor, UOp
from tinygrad.device import BufferSpec, MultiBuffer, canonicalize_device
from tinygrad.dtype import DType, _from_np_dtype, _to_np_dtype
from tinygrad.uop.ops import Ops, shape_to_shape_arg


def empty(shape: tuple[int, ...], dtype: DType, device: str | None) -> Tensor:
    """`Tensor.empty(*shape, dtype=dtype, device=device)` for a shape of ints on one device: the same new buffer
    reshaped to `shape`, without the shrink to `shape` tinygrad's adds (`tinygrad.mixin.creation.empty`), which gives
    the tensor back unchanged after as much work again as the rest: a load makes a few hundred (weights, KV caches).

    The reshape is `UOp.reshape` (`tinygrad.mixin.movement`, `UOp._mop`) with its one costly step, the symbolic
    simplification of the shape's uop, done once per shape (`_reshape_sources`): a shape of ints always simplifies
    to the same uops (tinygrad keeps one uop per value), and the 30 layers' weights have a handful of shapes."""
    buffer = UOp.new_buffer(canonicalize_device(device), math.prod(shape), dtype)
    reshaped = UOp(Ops.RESHAPE, src=(buffer, *_reshape_sources(tuple(shape))))
    return Tensor(buffer if reshaped.shape == buffer.shape else reshaped)  # as `reshape`: the same shape is a no-op


@functools.lru_cache(maxsize=None)
def _reshape_sources(shape: tuple[int, ...]) -> tuple[UOp, ...]:
    """The sources after the tensor that `UOp._mop(Ops.RESHAPE, shape)` gives its RESHAPE: the shape as a uop,
    simplified."""
    return UOp.sink(shape_to_shape_arg(shape)).simplify().src


def tensor_over_memory(address: int, shape: tuple[int, ...], dtype: DType, device: str | None, owner: object) -> Tensor:
    """A tensor whose buffer is the host memory at `address` (as `Tensor.from_blob`: nothing copied, nothing owned);
    `owner`, what keeps that memory valid (a memory map, an array), is kept alive by the buffer itself, as long as
    anything uses it."""
    t = empty(shape, dtype, device)
    t.uop.buffer.allocate(external_ptr=address)
    t.uop.buffer.tinyvllm_memory_owner = owner
    return t


def is_realized(t: Tensor) -> bool:
    """Does `t` stand for a buffer already (`UOp.is_realized`), rather than a computation still to run?"""
    return t.uop.is_realized


def buffer_address(x) -> int:
    """The address of a buffer's memory, allocated here if it is not yet (`Buffer.get_buf(device).va_addr`): a
    tensor's (on one device), or one device's tinygrad `Buffer` (or view) of a launch."""
    buf = x.uop.buffer if isinstance(x, Tensor) else x
    return buf.ensure_allocated().get_buf(buf.device).va_addr


def input_shard_address(u: UOp, shard: int) -> int:
    """The address of a JIT input's buffer: the whole buffer (shard -1), or device `shard`'s part of an input split
    over several devices (a `MultiBuffer`: one buffer per device)."""
    buf = u.buffer
    if shard >= 0:
        assert isinstance(buf, MultiBuffer), f"input {u} is on one device, not split over several"
        buf = buf.bufs[shard]
    return buffer_address(buf)


def numpy_dtype(dtype: DType) -> type:
    """The numpy dtype of a tinygrad dtype (`tinygrad.dtype._to_np_dtype`)."""
    return _to_np_dtype(dtype)


def tinygrad_dtype(dtype) -> DType:
    """The tinygrad dtype of a numpy dtype (`tinygrad.dtype._from_np_dtype`)."""
    return _from_np_dtype(dtype)


def host_memory(t: Tensor) -> memoryview | None:
    """`t`'s device memory as a memoryview, allocated here if it is not yet; None where the host cannot see it.

    `Buffer.as_memoryview(force_zero_copy=True)` asserts where a copy would be needed (a discrete GPU)."""
    buf = t.uop.buffer.ensure_allocated()
    try:
        return buf.as_memoryview(force_zero_copy=True)
    except AssertionError:  # tinygrad: "force zero copy was passed, but copy is required"
        return None


def allocate_zeroed_host_memory(t: Tensor) -> None:
    """Allocate `t` (a fresh `Tensor.empty`) as memory that comes zeroed and never from tinygrad's reuse cache:
    `BufferSpec(zero=True, nolru=True)` (tinygrad.device) keeps it out of `LRUAllocator`, where a freed
    buffer's old contents could come back. The CPU allocator maps fresh anonymous memory for it."""
    buf = t.uop.buffer
    buf.options = BufferSpec(zero=True, nolru=True)
    buf.allocate()


def copy_in(t: Tensor, data: memoryview) -> None:
    """Copy the bytes `data` into `t`'s device buffer (allocated here if it is not yet), now, with no graph.

    tinygrad 0.14's `Buffer` has no public copy-in; its own copies (`exec_copy` in tinygrad/engine/realize.py)
    call the allocator's `_copyin(buf._buf, memoryview)`, which every backend has: a memmove on the CPU, a copy
    through pinned host memory queued on the device's stream on CUDA (so `data` may be reused at once)."""
    buf = t.uop.buffer.ensure_allocated()
    assert len(data) == buf.nbytes, f"copy_in: {len(data)} bytes into a buffer of {buf.nbytes}"
    buf.allocator._copyin(buf._buf, data)


def memory_info(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU's memory, as its driver reports them; None where tinygrad has no way to ask.

    CUDA: `cuMemGetInfo_v2` (tinygrad.runtime.autogen.cuda) in the device's context. METAL: the working set the
    system recommends (`recommendedMaxWorkingSetSize`) less what the device has allocated
    (`currentAllocatedSize`). Opens the device."""
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
    """A realized tensor of zeros of `shape` split along `axis` over `devices` (each holds shape[axis] / N of it),
    zeroed where it lives: no whole copy on one device first. tinygrad 0.14 represents a split tensor as one buffer
    per device of the shard's shape under an UNSHARD (what `Tensor.shard` returns once realized)."""
    assert shape[axis] % len(devices) == 0, f"{shape} does not split along axis {axis} over {len(devices)} devices"
    shard = tuple(s // len(devices) if i == axis else s for i, s in enumerate(shape))
    local = Tensor.zeros(*shard, dtype=dtype, device=devices).contiguous().realize()  # (shard) on every device
    return Tensor(local.uop.unshard(axis))


def empty_shards(shard: tuple[int, ...], dtype: DType, devices: tuple[str, ...], axis: int | None) -> Tensor:
    """An unrealized output buffer on every device, `shard` the shape of each device's part, seen as one tensor split
    along `axis` (None: each device's part is a whole replica). A kernel run on a split tensor writes one per device."""
    local = Tensor.invalids(*shard, dtype=dtype, device=devices)  # (shard) on every device, contents undefined
    return local if axis is None else Tensor(local.uop.unshard(axis))


def shard_shape(t: Tensor) -> tuple[int, ...]:
    """The shape of one device's part of `t` (its shape, if `t` is on one device or replicated)."""
    return tuple(t.uop.shard_shape)


def shard_axis(t: Tensor) -> int | None:
    """The axis `t` is split along over its devices (None: on one device, or a replica on each)."""
    return t.uop.axis if isinstance(t.device, tuple) else None
