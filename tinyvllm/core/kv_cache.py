"""The physical KV cache: per layer, one K and one V tensor of blocks (Phase 2).

    k_cache[layer]: (num_blocks + 1, block_size, n_kv_heads, head_dim)      v_cache[layer]: the same
                     block 0 | block 1 | ... | block num_blocks-1 | null block

The BlockManager (pure Python) decides which sequence owns which block; this module only holds
the tensors. A token's K and V go to its *slot*, `block_id * block_size + offset`, written through
the `slot_mapping` (see `tinyvllm.attention.paged.reshape_and_cache`). The extra last block is the
*null block*: padding tokens (in padded batches) write there, and no block table ever points at it.

The pool size is derived once, from a memory budget, and passed in (config flows one way):

    bytes per block = 2 (K and V) * num_layers * block_size * n_kv_heads * head_dim * dtype size
    num_blocks      = budget // bytes per block
"""

from __future__ import annotations

import re

from tinygrad import dtypes
from tinygrad.dtype import DType

from tinyvllm.device_memory import zeros
from tinyvllm.model.config import ModelConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str | int) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv cache memory must be a size like '512MiB', '2GiB' or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: DType = dtypes.float32) -> int:
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * dtype.itemsize


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory: str | int,
                          dtype: DType = dtypes.float32) -> int:
    """How many blocks the BlockManager can hand out within the budget. The budget also holds the null
    block (see PagedKVCache), so it must fit at least two; otherwise a ValueError says how much that is."""
    budget, per_block = parse_memory(memory), kv_cache_bytes_per_block(config, block_size, dtype)
    if budget < 2 * per_block:
        raise ValueError(f"kv cache memory {budget} bytes is less than two blocks (one to hand out plus the null "
                         f"block, {per_block} bytes each for block_size {block_size}): give at least "
                         f"{2 * per_block} bytes")
    return budget // per_block - 1  # the null block is the last one of the budget


class PagedKVCache:
    """The block tensors of every layer. `kv_caches[layer] = (k_cache, v_cache)`."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: DType = dtypes.float32,
                 device: str | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.null_block = num_blocks  # the extra block padding tokens write into
        shape = (num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(zeros(shape, dtype, device), zeros(shape, dtype, device))
                          for _ in range(config.num_hidden_layers)]

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes() + v.nbytes() for k, v in self.kv_caches)
