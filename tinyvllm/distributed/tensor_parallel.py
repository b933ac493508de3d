"""Tensor parallel: every layer split over N devices, Megatron-LM's way (two all-reduces a block).

Taught in docs/phases/08-multi-device.md.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Device, Tensor

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.quant import QuantizedArray


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """ValueError unless `size` divides the query heads, and divides the KV heads or is a multiple of them (vLLM's)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    kv_ok = kv_heads % size == 0 if size <= kv_heads else size % kv_heads == 0
    if heads % size != 0 or not kv_ok:
        valid = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 if n <= kv_heads
                                                                        else n % kv_heads == 0)]
        raise ValueError(f"tensor_parallel_size {size} cannot split this model's {heads} attention heads and "
                         f"{kv_heads} KV heads: it must divide the attention heads, and divide the KV heads or be "
                         f"a multiple of them; valid sizes: {valid}")


def shard_devices(device: str | None, size: int) -> tuple[str, ...]:
    """N devices of one kind: 'CPU' and 3 -> ('CPU', 'CPU:1', 'CPU:2')."""
    kind = (device or Device.DEFAULT).split(":")[0].upper()
    return tuple(Device.canonicalize(f"{kind}:{i}") for i in range(size))


class TensorParallel:
    """Which rows of each weight go to which of `size` devices; a KV head is replicated when devices outnumber them."""

    def __init__(self, config: ModelConfig, size: int = 1, device: str | None = None):
        check_tensor_parallel_size(config, size)
        self.config, self.size = config, size
        self.devices = shard_devices(device, size) if size > 1 else (device,)
        self.heads = config.num_attention_heads // size  # query heads per device
        self.kv_heads = max(1, config.num_key_value_heads // size)  # KV heads per device
        self.vocab_size = -(-config.vocab_size // size) * size  # padded to equal shards

    @property
    def num_kv_heads(self) -> int:
        """KV heads over all devices (replicas counted)."""
        return self.kv_heads * self.size

    def _kv_rows(self) -> np.ndarray:
        """Rows of a (KvH*Hd, D) k_proj / v_proj, device by device."""
        hd, replicas = self.config.head_dim, max(1, self.size // self.config.num_key_value_heads)
        heads = [i // replicas * self.kv_heads + j for i in range(self.size) for j in range(self.kv_heads)]
        return np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in heads])

    def part_rows(self, part: str) -> np.ndarray | None:
        """Row order of one HF weight, device by device (None: as it is; 'k' and 'v' may repeat heads)."""
        if self.size == 1 or part not in ("k", "v"):
            return None
        return self._kv_rows()

    def fused_rows(self, sizes: list[int], parts: list[str]) -> np.ndarray | None:
        """Row order of weights fused along dim 0: device i's slice is [q_i k_i v_i]."""
        if self.size == 1 or not parts:
            return None
        offsets = np.cumsum([0] + sizes)
        per_part = [self.part_rows(p) if self.part_rows(p) is not None else np.arange(n) for p, n in zip(parts, sizes)]
        chunks = [rows.reshape(self.size, -1) + off for rows, off in zip(per_part, offsets)]  # (N, rows each)
        return np.concatenate(chunks, axis=1).reshape(-1)

    def pad_vocab(self, rows: np.ndarray | QuantizedArray) -> np.ndarray | QuantizedArray:
        """An embedding / lm_head with zero rows added up to a multiple of the device count."""
        pad = self.vocab_size - rows.shape[0]
        if pad == 0:
            return rows
        if isinstance(rows, QuantizedArray):
            data = np.concatenate([rows.data, np.zeros((pad, rows.data.shape[1]), np.uint8)])
            return QuantizedArray(data, rows.ggml_type, (self.vocab_size, rows.shape[1]))
        return np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])

    def place(self, t: Tensor, axis: int | None) -> Tensor:
        """A weight split along `axis`, or replicated (None); not yet realized."""
        if self.size == 1:
            return t
        return t.to(self.devices) if axis is None else t.shard(self.devices, axis)

    def replicate(self, t: Tensor) -> Tensor:
        """A step's input (on the first device) copied to every device, inside the graph."""
        return t if self.size == 1 else t.to(self.devices)

    def gather(self, t: Tensor) -> Tensor:
        """A tensor split over the devices, whole on the first one (the logits, for the sampler)."""
        return t if self.size == 1 else t.to(self.devices[0])
