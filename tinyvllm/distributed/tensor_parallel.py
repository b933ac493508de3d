"""Tensor parallel (Phase 8): one model's every layer split over N devices, Megatron-LM's way.

Megatron-LM (Shoeybi et al. 2019, arxiv.org/abs/1909.08053) splits a transformer block so that each device
computes a slice of it with no communication until the block's last matmul, where one all-reduce sums the slices:

    x (replicated) --> qkv_proj  COLUMN-parallel: device i holds the rows of its heads  --> q,k,v of heads i
                       attention, per device, over its own heads and its own KV cache slice (no communication)
                   --> o_proj    ROW-parallel: device i holds the columns of its heads --> a partial sum
                   --> ALL-REDUCE (sum over devices)                                   --> x' (replicated)
    x' ------------> gate_up     COLUMN-parallel: device i holds F/N rows of gate and of up
                       silu(gate) * up, per device (elementwise: no communication)
                   --> down_proj ROW-parallel                                           --> a partial sum
                   --> ALL-REDUCE                                                       --> x'' (replicated)

A column-parallel matmul splits the output features (each device the full input, a slice of the output); a
row-parallel one splits the input features (each device a slice of the input, a partial output). Column then row
composes without a gather in between, so a block costs exactly two all-reduces of (tokens, hidden_size) floats.

The embedding and lm_head are split by vocabulary (vLLM's VocabParallelEmbedding / ParallelLMHead): device i holds
rows [i V/N, (i+1) V/N). A token's row lives on one device; the others contribute zeros and one all-reduce sums
them. lm_head is column-parallel: each device computes the logits of its vocabulary slice, gathered onto the
first device for sampling.

KV heads: each device holds the KV heads its query heads read. With more devices than KV heads each KV head is
replicated (as vLLM does): device i holds KV head i // (N / n_kv_heads). The paged KV cache is sharded by head
the same way, so every device has every block (one block table for all: the BlockManager does not change).

On tinygrad a split is a multi-device tensor, `Tensor.shard(devices, axis)`: ops on it run per device, and a
reduction over the sharded axis becomes an all-reduce in the same graph (tinygrad/schedule/multi.py), so one
captured TinyJit holds every device's kernels and the all-reduces between them.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Device, Tensor

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.quant import QuantizedArray


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless `size` devices can split the model's heads (vLLM's rule): the query heads
    evenly, and the KV heads evenly or, with more devices than KV heads, each KV head onto a whole group."""
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
    """N devices of one kind: 'CPU' and 3 -> ('CPU', 'CPU:1', 'CPU:2') (tinygrad names device 0 by its kind)."""
    kind = (device or Device.DEFAULT).split(":")[0].upper()
    return tuple(Device.canonicalize(f"{kind}:{i}") for i in range(size))


class TensorParallel:
    """How one model is placed on `size` devices: which rows of each weight go to which device.

    size 1 places everything on one device as it is (no permutation, no copies): the model's code is the
    same for every size. Shapes below are the logical (whole) ones; device i holds 1/size of the sharded axis.
    """

    def __init__(self, config: ModelConfig, size: int = 1, device: str | None = None):
        check_tensor_parallel_size(config, size)
        self.config, self.size = config, size
        self.devices = shard_devices(device, size) if size > 1 else (device,)
        self.heads = config.num_attention_heads // size  # query heads per device
        self.kv_heads = max(1, config.num_key_value_heads // size)  # KV heads per device
        self.vocab_size = -(-config.vocab_size // size) * size  # padded so that every device gets as many rows

    @property
    def num_kv_heads(self) -> int:
        """KV heads over all devices: the model's own, or `size` when each device holds a replica of one."""
        return self.kv_heads * self.size

    def _kv_rows(self) -> np.ndarray:
        """Rows of a (KvH*Hd, D) k_proj / v_proj, device by device: device i's KV heads (replicated if need be)."""
        hd, replicas = self.config.head_dim, max(1, self.size // self.config.num_key_value_heads)
        heads = [i // replicas * self.kv_heads + j for i in range(self.size) for j in range(self.kv_heads)]
        return np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in heads])

    def part_rows(self, part: str) -> np.ndarray | None:
        """Row order of one HF weight, device by device (None: as it is). 'q' rows are head-major, so device i's
        heads are already rows i*H/N*Hd ... ; 'k' and 'v' may repeat heads."""
        if self.size == 1 or part not in ("k", "v"):
            return None
        return self._kv_rows()

    def fused_rows(self, sizes: list[int], parts: list[str]) -> np.ndarray | None:
        """Row order of weights fused along dim 0 (qkv_proj: q, k, v; gate_up_proj: gate, up) such that each device's
        slice of the fused matrix is its slices of the parts, in order: [q_i k_i v_i] on device i."""
        if self.size == 1 or not parts:
            return None
        offsets = np.cumsum([0] + sizes)
        per_part = [self.part_rows(p) if self.part_rows(p) is not None else np.arange(n) for p, n in zip(parts, sizes)]
        chunks = [rows.reshape(self.size, -1) + off for rows, off in zip(per_part, offsets)]  # (N, rows per device)
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
        """Put a weight (loaded on the first device) where it belongs: split along `axis`, or a replica on every
        device (axis None). Not yet realized: realize every placed weight at once (one schedule for all copies)."""
        if self.size == 1:
            return t
        return t.to(self.devices) if axis is None else t.shard(self.devices, axis)

    def replicate(self, t: Tensor) -> Tensor:
        """A step's input (on the first device) copied to every device, inside the graph."""
        return t if self.size == 1 else t.to(self.devices)

    def gather(self, t: Tensor) -> Tensor:
        """A tensor split over the devices, whole on the first one (the logits, for the sampler)."""
        return t if self.size == 1 else t.to(self.devices[0])
