"""Copy-on-write on the device: the step's block copies before its forward pass.

    block_mapping: (num_pairs, 2) int32   [[src, dst], ...]      for every cache tensor t of every layer:
                                                                 t[dst] = t[src]   (the whole block)

The kernel (kernels/<device>/copy_blocks.*) copies bits, else `copy_blocks_portable` in UOps. Pairs are padded to
a power of two with (null block, null block): one captured graph per size. Taught in docs/phases/07a-prefix-caching.md.
"""

from __future__ import annotations

from tinygrad import Tensor, UOp, dtypes

from tinyvllm.attention import kernel_backend
from tinyvllm.kernels import launcher
from tinyvllm.kernels.cpu_graph import GraphedJit
from tinyvllm.tinygrad_adapter import KernelInfo

KERNEL = "copy_blocks"  # kernels/<device>/copy_blocks.*
NUM_THREADS = 128  # threads per thread block on GPUs: TV_NUM_THREADS
BITS_TYPES = {"CPU": {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long"},
              "CUDA": {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"},
              "METAL": {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong"}}


def _copy_blocks_kernel(cache: UOp, block_mapping: UOp) -> UOp:
    """cache: (num_blocks, block_size, W), block_mapping: (P, 2) -> cache[dst, i, j] = cache[src, i, j],
    [src, dst] = block_mapping[p]."""
    num_pairs, rows, width = block_mapping.shape[0], cache.shape[1], cache.shape[2]
    p, i, j = UOp.range(num_pairs, 0), UOp.range(rows, 1), UOp.range(width, 2)
    src, dst = block_mapping[p, 0].cast(dtypes.weakint), block_mapping[p, 1].cast(dtypes.weakint)
    store = cache[dst, i, j].store(cache[src, i, j])
    return store.end(p, i, j).sink(arg=KernelInfo(name="copy_blocks", opts_to_apply=()))


def copy_blocks_portable(cache: Tensor, block_mapping: Tensor) -> Tensor:
    """cache: (num_blocks, block_size, ...) -> the cache after block dst := block src for each [src, dst] row of
    block_mapping (P, 2) int32, in place (split by KV head, each device copies its own heads)."""
    flat = cache.reshape(cache.shape[0], cache.shape[1], -1)
    written = flat.uop.custom_kernel(block_mapping.uop, fxn=_copy_blocks_kernel)[0]
    return Tensor(cache.uop.after(written))


def has_kernel(device: str) -> bool:
    return launcher.has_kernel(KERNEL, device) and launcher.device_kind(device) in BITS_TYPES


def uses_kernel(cache: Tensor, portable: bool = False) -> bool:
    device = cache.device
    return (not portable and not kernel_backend.PORTABLE and isinstance(device, str) and has_kernel(device)
            and cache.dtype.itemsize in BITS_TYPES[launcher.device_kind(device)])


def kernel_copy_blocks(cache: Tensor, block_mapping: Tensor) -> Tensor:
    """`copy_blocks_portable` on the device's kernel: one launch, a GPU thread block per pair."""
    num_blocks = cache.shape[0]
    flat = cache.reshape(num_blocks, -1)
    defines = {"TV_NUM_PAIRS": block_mapping.shape[0], "TV_NUM_BLOCKS": num_blocks, "TV_BLOCK_NUMEL": flat.shape[1],
               "TV_NUM_THREADS": NUM_THREADS,
               "TV_T": BITS_TYPES[launcher.device_kind(cache.device)][cache.dtype.itemsize]}
    (written,) = launcher.launch(KERNEL, outs=[flat], ins=[block_mapping.cast(dtypes.int32).contiguous()],
                                 defines=defines, grid=(block_mapping.shape[0], 1, 1), local_size=(NUM_THREADS, 1, 1))
    return Tensor(cache.uop.after(written.uop))


def copy_blocks(caches: list[Tensor], block_mapping: Tensor, portable: bool = False) -> list[Tensor]:
    """Copy the blocks of every tensor in `caches` (on any devices) by `block_mapping`."""
    copies = []
    for c in caches:
        mapping = block_mapping.to(c.device)
        copies.append(kernel_copy_blocks(c, mapping) if uses_kernel(c, portable) else copy_blocks_portable(c, mapping))
    return copies


class CopyBlocks:
    """The copies of one step: a captured graph per padded number of pairs."""

    def __init__(self, caches: list[Tensor], null_block: int, portable: bool = False):
        self.caches, self.null_block, self.portable = caches, null_block, portable
        self._jits: dict[int, GraphedJit] = {}

    def _run(self, block_mapping: Tensor) -> list[Tensor]:
        return Tensor.realize(*copy_blocks(self.caches, block_mapping, self.portable))

    def __call__(self, pairs: list[tuple[int, int]]) -> None:
        """Make the copies now, on the caches' device: [(src, dst), ...]."""
        if not pairs:
            return
        size = 1 << (len(pairs) - 1).bit_length()  # 1, 2, 4, ...: one graph per size
        rows = list(pairs) + [(self.null_block, self.null_block)] * (size - len(pairs))
        mapping = Tensor(rows, dtype=dtypes.int32, device=self.caches[0].device).realize()
        if size not in self._jits:
            self._jits[size] = GraphedJit(self._run)
        self._jits[size](mapping)
