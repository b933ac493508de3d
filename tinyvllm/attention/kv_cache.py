"""The physical KV cache: per layer, a K and a V tensor of blocks, and their scales when quantized.

    k_cache[layer]: (num_blocks + 1, block_size, n_kv_heads, head_dim)      v_cache[layer]: the same
                     block 0 | block 1 | ... | block num_blocks-1 | null block
    k_scale[layer]: (num_blocks + 1, block_size, n_kv_heads) float32        v_scale[layer]: the same (int8, fp8)

Taught in docs/phases/02-paged-attention.md; the GPU budget in 05b-gpu.md; the 8-bit dtypes in
07c-kv-cache-quantization.md.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.device_memory import free_device_memory, zeros
from tinyvllm.model.config import ModelConfig
from tinyvllm.platforms import platform_for

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = "512MiB"  # where no gpu_memory_utilization applies (the CPU device)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str | int) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv cache memory must be a size like '512MiB', '2GiB' or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class KVCacheDtype:
    """How the cache stores one element of K or V; qmax: the code amax maps to (None: stored as is)."""

    name: str
    storage: DType
    qmax: float | None = None
    rotated: bool = False

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def bytes_per_token_head(self, head_dim: int) -> int:
        """K (or V) bytes of one token for one KV head: its elements, plus its scale when quantized."""
        return head_dim * self.storage.itemsize + (dtypes.float32.itemsize if self.quantized else 0)


KV_CACHE_DTYPES = {
    "float32": KVCacheDtype("float32", dtypes.float32),
    "float16": KVCacheDtype("float16", dtypes.float16),
    "int8": KVCacheDtype("int8", dtypes.int8, 127.0, rotated=True),
    "fp8": KVCacheDtype("fp8", dtypes.uint8, 448.0),  # e4m3 (OCP "fn": no infinities, 448 the largest finite)
}
_ALIASES = {"fp8_e4m3": "fp8", "half": "float16", "float": "float32"}
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "float16", "int8", "fp8")


def resolve_kv_cache_dtype(name: str | KVCacheDtype, compute_dtype: DType = dtypes.float32) -> KVCacheDtype:
    """'auto' (the compute dtype), 'float32', 'float16', 'int8', 'fp8' (alias 'fp8_e4m3') -> KVCacheDtype."""
    if isinstance(name, KVCacheDtype):
        return name
    if not isinstance(name, str):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {name!r}")
    key = name.strip().lower()
    if key == "auto":
        key = {dtypes.float32: "float32", dtypes.float16: "float16"}.get(compute_dtype, "")
        if not key:
            raise ValueError(f"kv_cache_dtype 'auto' follows the model's dtype, and {compute_dtype} has no KV cache "
                             f"of its own: give one of {', '.join(KV_CACHE_DTYPE_CHOICES[1:])}")
    key = _ALIASES.get(key, key)
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {name!r}")
    return KV_CACHE_DTYPES[key]


def kv_cache_dtype_of(cache: Tensor) -> KVCacheDtype:
    """The KVCacheDtype a k_cache / v_cache tensor was made for, from its element dtype."""
    for spec in KV_CACHE_DTYPES.values():
        if spec.storage == cache.dtype:
            return spec
    raise ValueError(f"a KV cache of {cache.dtype} is none of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_bytes_per_token(config: ModelConfig, dtype: DType | KVCacheDtype = dtypes.float32) -> int:
    """K and V bytes of one token of context over every layer, scales included."""
    spec = dtype if isinstance(dtype, KVCacheDtype) else resolve_kv_cache_dtype("auto", dtype)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * spec.bytes_per_token_head(config.head_dim)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: DType | KVCacheDtype = dtypes.float32) -> int:
    return block_size * kv_cache_bytes_per_token(config, dtype)


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory: str | int,
                          dtype: DType | KVCacheDtype = dtypes.float32) -> int:
    """Blocks to hand out within the budget (which also holds the null block); ValueError below two blocks."""
    budget, per_block = parse_memory(memory), kv_cache_bytes_per_block(config, block_size, dtype)
    if budget < 2 * per_block:
        raise ValueError(f"kv cache memory {budget} bytes is less than two blocks (one to hand out plus the null "
                         f"block, {per_block} bytes each for block_size {block_size}): give at least "
                         f"{2 * per_block} bytes")
    return budget // per_block - 1  # the null block is the last one of the budget


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_logits_rows: int) -> int:
    """A bound on the bytes of the captured graphs' intermediates (doubled for the smaller buckets' graphs)."""
    per_token = 4 * (4 * config.hidden_size + (config.num_attention_heads + 2 * config.num_key_value_heads)
                     * config.head_dim + 3 * config.intermediate_size)
    per_row = 4 * 4 * config.vocab_size
    return 2 * (max_num_batched_tokens * per_token + max_logits_rows * per_row)


def kv_cache_budget(kv_cache_memory: str | int | None, gpu_memory_utilization: float | None, device: str | None,
                    activations: int = 0) -> int:
    """Bytes for the KV cache: `kv_cache_memory`, else a GPU's free share less `activations`, else the default.
    ValueError when that leaves nothing."""
    if kv_cache_memory is not None:
        return parse_memory(kv_cache_memory)
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    utilization = gpu_memory_utilization or platform_for(device).gpu_memory_utilization
    if utilization is None:
        return parse_memory(DEFAULT_KV_CACHE_MEMORY)
    if (info := free_device_memory(device)) is None:  # a device without a way to ask: the fixed budget
        if gpu_memory_utilization is not None:  # vLLM's CPU backend ignores the flag too
            logger.warning("gpu_memory_utilization is for a GPU's free memory, which device %s cannot report: the KV "
                           "cache gets %s (give kv_cache_memory to choose)", device or platform_for(device).kind,
                           DEFAULT_KV_CACHE_MEMORY)
        return parse_memory(DEFAULT_KV_CACHE_MEMORY)
    free, total = info
    kept_free = (1 - utilization) * total
    budget = int(free - kept_free - activations)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: the device has "
                         f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB, {kept_free / 2**30:.2f} GiB must "
                         f"stay free and the step's activations need {activations / 2**30:.2f} GiB; "
                         f"raise gpu_memory_utilization or give kv_cache_memory")
    return budget


class PagedKVCache:
    """`kv_caches[layer] = (k_cache, v_cache[, k_scale, v_scale])`; device: a tuple splits by KV head, a list is
    one per layer."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: DType | KVCacheDtype = dtypes.float32, device: str | tuple[str, ...] | list | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.null_block = num_blocks  # the extra block padding tokens write into
        self.dtype = dtype if isinstance(dtype, KVCacheDtype) else resolve_kv_cache_dtype("auto", dtype)
        self.bytes_per_token = kv_cache_bytes_per_token(config, self.dtype)
        shape = (num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = []
        devices = device if isinstance(device, list) else [device] * config.num_hidden_layers
        for dev in devices:
            layer = (zeros(shape, self.dtype.storage, dev), zeros(shape, self.dtype.storage, dev))
            if self.dtype.quantized:
                layer += (zeros(shape[:3], dtypes.float32, dev), zeros(shape[:3], dtypes.float32, dev))
            self.kv_caches.append(layer)

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes() for layer in self.kv_caches for t in layer)
