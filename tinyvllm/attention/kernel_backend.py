"""Paged attention on the hand-written kernels (kernels/<device>/paged_attention.*): the blocks read in place.

Taught in docs/phases/05-custom-kernels.md and 05b-gpu.md.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_cache import kv_cache_dtype_of
from tinyvllm.attention.paged import PagedAttentionMetadata
from tinyvllm.kernels import launcher
from tinyvllm.tinygrad_ext.buffers import shard_axis

PORTABLE = os.getenv("TINYVLLM_PORTABLE", "0") == "1"  # True: never use the hand-written kernels
KERNEL = "paged_attention"  # kernels/<device>/paged_attention.*
NUM_THREADS = 128  # per GPU thread block: 4 warps of 32

logger = logging.getLogger("tinyvllm.attention")
_noticed: set[str] = set()  # device kinds already told about the fallback


KV_STORAGE = (dtypes.float32, dtypes.float16, dtypes.int8, dtypes.uint8)  # every KVCacheDtype's storage
CACHE_DTYPES = {"CPU": KV_STORAGE, "GPU": KV_STORAGE}
QUERY_DTYPES = {"CPU": (dtypes.float32,), "GPU": (dtypes.float32, dtypes.float16)}
# each language's name for an element type
C_TYPES = {"CPU": {dtypes.float32: "float", dtypes.float16: "__fp16", dtypes.int8: "signed char",
                   dtypes.uint8: "unsigned char"},
           "CUDA": {dtypes.float32: "float", dtypes.float16: "half", dtypes.int8: "signed char",
                    dtypes.uint8: "unsigned char"},
           "METAL": {dtypes.float32: "float", dtypes.float16: "half", dtypes.int8: "int8_t", dtypes.uint8: "uchar"}}
KV_QUANT = {"float32": 0, "float16": 0, "int8": 1, "fp8": 2}  # TV_KV_QUANT: what a cache element's bits mean


# flash-decoding's split route: a table of more than one partition, and at most SPLIT_MAX_BLOCKS (row, KV head) blocks
PARTITION_SIZE = 512  # keys per thread block of the split route (vLLM's); a multiple of 4 warps x 32 keys
SPLIT_MAX_BLOCKS = 512


@dataclass(frozen=True)
class GpuLaunch:
    """One kernel launch of the attention on a GPU: `entry` of paged_attention.* on `grid` thread blocks."""

    entry: str
    grid: tuple[int, int, int]


def gpu_attention_launches(rows: int, heads: int, kv_heads: int, max_keys: int,
                           partition_size: int = PARTITION_SIZE) -> list[GpuLaunch]:
    """The launches for `rows` query rows of up to `max_keys` keys: one, or the split route's two."""
    parts = -(-max_keys // partition_size)
    if parts <= 1 or rows * kv_heads > SPLIT_MAX_BLOCKS:
        return [GpuLaunch("paged_attention", (kv_heads, rows, 1))]
    return [GpuLaunch("paged_attention_split", (kv_heads * parts, rows, 1)),
            GpuLaunch("paged_attention_reduce", (heads, rows, 1))]


GPU_SHARED_BYTES = 48 * 1024  # shared (threadgroup) memory a thread block may use without asking for more


def gpu_shared_bytes(group: int, head_dim: int) -> int:
    """One GPU thread block's shared bytes: per warp, scores (group, 32), m, l, acc (group, head_dim)."""
    return 4 * (NUM_THREADS // 32) * group * (32 + 2 + head_dim)


def has_kernel(device: str) -> bool:
    """Is there a paged-attention source for `device` in a language its compiler takes?"""
    return launcher.has_kernel(KERNEL, device)


def uses_kernels(q: Tensor, k_cache: Tensor, portable: bool = False) -> bool:
    """Would attention with this query and cache run the hand-written kernels?"""
    device = q.device
    if portable or PORTABLE or device != k_cache.device:
        return False
    if not all(isinstance(s, int) for s in q.shape + k_cache.shape):
        return False
    if isinstance(device, tuple) and (shard_axis(q) != 2 or shard_axis(k_cache) != 2):
        return False  # tensor parallel: q and the cache must be split by head
    kind = launcher.device_kind(device)
    family = "CPU" if kind == "CPU" else "GPU"
    head_dim = k_cache.shape[-1]
    if k_cache.dtype not in CACHE_DTYPES[family] or q.dtype not in QUERY_DTYPES[family]:
        return False
    if kind == "CPU" and head_dim % 8 != 0:
        return False
    if kind != "CPU" and gpu_shared_bytes(q.shape[-2] // k_cache.shape[-2], head_dim) > GPU_SHARED_BYTES:
        return False
    if not has_kernel(device):
        if kind not in _noticed:
            _noticed.add(kind)
            logger.warning("tinyvllm: no paged-attention kernel for %s; using the portable paged attention", device)
        return False
    return True


def kernel_source(entry: str, device: str, defines: dict[str, int | str]) -> tuple[str, str]:
    """(program name, full source) of `entry` ("paged_attention" or "reshape_and_cache") for `device`."""
    return launcher.program_source(KERNEL, device, defines, entry)


def _launch(entry: str, outs: list[Tensor], ins: list[Tensor], defines: dict[str, int | str],
            grid: tuple[int, int, int]) -> list[Tensor]:
    """Put `entry` into the graph on outs (written) and ins (read)."""
    return launcher.launch(KERNEL, outs, ins, defines, entry=entry, grid=grid, local_size=(NUM_THREADS, 1, 1))


def _type_defines(device: str, t: Tensor, cache: Tensor) -> dict[str, int | str]:
    """TV_T for q/out/key/value (GPUs; the CPU's is float), TV_CACHE_T, TV_CACHE_BITS and TV_KV_QUANT for the cache."""
    kind = launcher.device_kind(device)
    types = C_TYPES[kind if kind in C_TYPES else "CUDA"]
    defines: dict[str, int | str] = {} if kind == "CPU" else {"TV_T": types[t.dtype]}
    spec = kv_cache_dtype_of(cache)
    return {**defines, "TV_CACHE_T": types[cache.dtype], "TV_CACHE_BITS": 8 * cache.dtype.itemsize,
            "TV_KV_QUANT": KV_QUANT[spec.name]}


def _check_scales(cache: Tensor, scales: tuple[Tensor | None, Tensor | None]) -> list[Tensor]:
    """The scale tensors an 8-bit cache needs (none for a float cache), checked."""
    spec = kv_cache_dtype_of(cache)
    if not spec.quantized:
        return []
    assert all(s is not None and s.shape == cache.shape[:3] and s.dtype == dtypes.float32 for s in scales), \
        f"an {spec.name} cache {cache.shape} needs float32 k_scale and v_scale of shape {cache.shape[:3]}"
    return list(scales)


def kernel_reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> tuple[Tensor, ...]:
    """key, value: (N, KvH, Hd) -> the caches (and scales) after the write; read through these, after it."""
    num_tokens, kv_heads, head_dim = launcher.local_shape(key)  # one device's heads (tensor parallel)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    caches = [k_cache, v_cache] + _check_scales(k_cache, (k_scale, v_scale))
    defines = {"TV_NUM_TOKENS": num_tokens, "TV_NUM_KV_HEADS": kv_heads, "TV_HEAD_DIM": head_dim,
               "TV_NUM_SLOTS": num_slots, "TV_NUM_THREADS": NUM_THREADS,
               **_type_defines(key.device, key, k_cache)}
    if launcher.device_kind(key.device) == "CPU":  # the CPU kernel reads float32 K/V
        key, value = key.float(), value.float()
    written = _launch("reshape_and_cache", outs=[c.reshape(num_slots, -1) for c in caches],
                      ins=[key.contiguous(), value.contiguous(), slot_mapping.contiguous()],
                      defines=defines, grid=(num_tokens, 1, 1))
    return tuple(Tensor(c.uop.after(w.uop)) for c, w in zip(caches, written))


def kernel_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, sliding_window: int | None = None) -> Tensor:
    """q: (R, H, Hd) -> (R, H, Hd): row r over its keys 0 .. context_lens[r]-1 through block_tables[r]."""
    rows, heads, head_dim = launcher.local_shape(q)  # one device's heads (tensor parallel)
    _, block_size, kv_heads, _ = launcher.local_shape(k_cache)
    assert heads % kv_heads == 0, f"{heads} query heads do not group over {kv_heads} KV heads"
    assert block_tables.shape[0] == rows and context_lens.shape == (rows,), "one table row and length per query row"
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    defines = {"TV_NUM_SEQS": rows, "TV_NUM_HEADS": heads, "TV_NUM_KV_HEADS": kv_heads, "TV_HEAD_DIM": head_dim,
               "TV_BLOCK_SIZE": block_size, "TV_MAX_BLOCKS": block_tables.shape[1], "TV_SCALE": f"{float(scale)!r}f",
               "TV_NUM_THREADS": NUM_THREADS, "TV_SLIDING_WINDOW": sliding_window or 0,
               **_type_defines(q.device, q, k_cache)}
    out = launcher.output((rows, heads, head_dim), q.dtype, q, axis=1)  # every element written (per device: its heads)
    context_lens = context_lens.cast(dtypes.int32).contiguous()
    ins = [q.contiguous(), k_cache, v_cache, *_check_scales(k_cache, (k_scale, v_scale)),
           block_tables.cast(dtypes.int32).contiguous(), context_lens]
    if launcher.device_kind(q.device) == "CPU":
        return _launch("paged_attention", outs=[out], ins=ins, defines=defines, grid=(1, 1, 1))[0]
    launches = gpu_attention_launches(rows, heads, kv_heads, block_tables.shape[1] * block_size)
    if len(launches) == 1:
        return _launch("paged_attention", outs=[out], ins=ins, defines=defines, grid=launches[0].grid)[0]
    split, reduce = launches
    defines["TV_PARTITION_SIZE"] = PARTITION_SIZE
    parts = split.grid[0] // kv_heads
    partials = launcher.output((rows, heads, parts, 2 + head_dim), dtypes.float32, q, axis=1)  # all written
    (partials,) = _launch(split.entry, outs=[partials], ins=ins, defines=defines, grid=split.grid)
    return _launch(reduce.entry, outs=[out], ins=[partials, context_lens], defines=defines, grid=reduce.grid)[0]


@dataclass
class KernelPagedAttentionMetadata(PagedAttentionMetadata):
    """`PagedAttentionMetadata` with context_lens (R,) int32 always set, R = B*T (default: position + 1)."""

    portable: bool = False
    row_block_tables: Tensor | None = field(default=None, repr=False)  # (R, max_blocks), derived

    def __post_init__(self) -> None:
        rows = math.prod(self.positions.shape)
        if self.context_lens is None:
            self.context_lens = (self.positions.reshape(rows) + 1).cast(dtypes.int32).contiguous()
        table = self.block_tables
        if table.shape[0] != rows:  # (B, max_blocks) for (B, T) tokens: each token gets its sequence's row
            B, T = self.positions.shape
            table = table.reshape(B, 1, -1).expand(B, T, table.shape[1]).reshape(rows, -1).contiguous()
        self.row_block_tables = table

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, ...],
                sliding_window: int | None = None) -> Tensor:
        if not uses_kernels(q, kv_cache[0], self.portable):
            return super()._attend(q, k, v, kv_cache, sliding_window)
        B, T, H, Hd = q.shape
        kv_heads = k.shape[2]
        written = kernel_reshape_and_cache(k.reshape(B * T, kv_heads, Hd), v.reshape(B * T, kv_heads, Hd),
                                           *kv_cache[:2], self.slot_mapping, *kv_cache[2:])
        k_cache, v_cache, *scales = written
        out = kernel_paged_attention(q.reshape(B * T, H, Hd), k_cache, v_cache, self.row_block_tables,
                                     self.context_lens, None, *scales, sliding_window=sliding_window)
        return out.reshape(B, T, H, Hd)



def kernel_attention_metadata(slot_mapping: Tensor, block_tables: Tensor, positions: Tensor, num_blocks,
                              portable: bool = False, context_lens: Tensor | None = None
                              ) -> KernelPagedAttentionMetadata:
    """What a model runner attends with once Phase 5 is here (tinyvllm/plugins.py: "attention_metadata"). Given
    context_lens (a prefix LM's image step), the portable path: the kernels' sliding window ends at the context's
    end, the image's, where HF's ends at the token's own position."""
    return KernelPagedAttentionMetadata(slot_mapping, block_tables, positions, num_blocks, context_lens,
                                        portable=portable or context_lens is not None)
