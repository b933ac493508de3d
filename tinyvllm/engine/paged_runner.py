"""Running the model for one sequence on the paged KV cache (Phase 2).

The same two steps as `ContiguousModelRunner` (prefill, then decode), but the K/V live in blocks
handed out by the BlockManager as the sequence grows:

    prefill n tokens:  allocate ceil(n / block_size) blocks         -> block_table, slot_mapping for 0..n-1
    decode at pos p:   append_slots (a new block every block_size)  -> slot_mapping = [slot of p]

Each step passes the attention its metadata as tensors (fixed shapes, so TinyJit replays):
`slot_mapping` (T,), `block_tables` (1, max_blocks) padded with the null block, `positions` (1, T),
and the number of blocks to gather as a bound variable. Phase 3 replaces this with a scheduler
and many sequences; the attention code stays the same. Attention runs on the hand-written paged-attention
kernels where the device has them (Phase 5, `tinyvllm.attention.kernel_backend`); `portable_attention=True`
keeps the portable gather.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp

from tinyvllm.attention.kernel_backend import KernelPagedAttentionMetadata
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.kv_cache import PagedKVCache
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.input_buffer import InputBuffer
from tinyvllm.kernels.cpu_graph import GraphedJit
from tinyvllm.model.llama import LlamaForCausalLM


class PagedModelRunner:
    def __init__(self, model: LlamaForCausalLM, max_model_len: int, num_blocks: int, block_size: int = 16,
                 prefill_chunk_size: int = 32, portable_attention: bool = False):
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model, self.max_model_len, self.block_size = model, max_model_len, block_size
        self.prefill_chunk_size = min(prefill_chunk_size, max_model_len)
        self.portable_attention = portable_attention
        self.kv_cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.v_num_blocks = UOp.variable("num_blocks", 1, self.max_blocks_per_seq)
        self.seq: Sequence | None = None
        self._prefill_jit = GraphedJit(self._forward)
        self._decode_jit = GraphedJit(self._forward)
        self._input_buffers: dict[int, tuple[InputBuffer, ...]] = {}  # per step length: prefill chunk, decode

    def _forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                 num_blocks: int | UOp) -> Tensor:
        metadata = KernelPagedAttentionMetadata(slot_mapping, block_tables, positions, num_blocks,
                                                portable=self.portable_attention)
        hidden = self.model(input_ids, positions, self.kv_cache.kv_caches, metadata)
        return self.model.compute_logits(hidden[:, -1]).realize()

    def _inputs(self, n: int) -> tuple[InputBuffer, ...]:
        """The step inputs of an n-token step, allocated once (input_ids, positions, slot_mapping, block_tables)."""
        if n not in self._input_buffers:
            dev = self.model.device
            self._input_buffers[n] = (InputBuffer((1, n), np.int32, dev), InputBuffer((1, n), np.int32, dev),
                                      InputBuffer((n,), np.int32, dev),
                                      InputBuffer((1, self.max_blocks_per_seq), np.int32, dev))
        return self._input_buffers[n]

    def _step(self, jit: GraphedJit, token_ids: list[int], start: int) -> Tensor:
        """Run tokens at positions start.. of the current sequence, whose slots are already allocated."""
        seq, n = self.seq, len(token_ids)
        input_ids, positions, slot_mapping, block_tables = self._inputs(n)
        block_tables.np[0, :len(seq.block_table)] = seq.block_table
        block_tables.np[0, len(seq.block_table):] = self.kv_cache.null_block
        num_blocks = -(-(start + n) // self.block_size)
        return jit(input_ids.write(token_ids), positions.write(np.arange(start, start + n)),
                   slot_mapping.write(self.block_manager.get_slot_mapping(seq, start, start + n)),
                   block_tables.copy_to_device(), self.v_num_blocks.bind(num_blocks))

    def free(self) -> None:
        """Give the current sequence's blocks back."""
        if self.seq is not None and self.seq.block_table:
            self.block_manager.free(self.seq)
        self.seq = None

    def prefill(self, token_ids: list[int]) -> np.ndarray:
        """Start a new sequence: allocate its blocks and fill them with the prompt; returns the last logits."""
        n = len(token_ids)
        if not 0 < n < self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; it must have 1 to {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len}, one position is kept for the first output token)")
        self.free()
        self.seq = Sequence(0, token_ids)
        if self.block_manager.allocate(self.seq) is None:
            self.seq = None
            raise ValueError(f"the prompt needs {-(-n // self.block_size)} KV cache blocks but the cache has only "
                             f"{self.block_manager.num_free_blocks} free: give the KV cache more memory")
        chunk = self.prefill_chunk_size
        num_chunked = n // chunk * chunk if n > 1 else 0
        logits = None
        for start in range(0, num_chunked, chunk):
            logits = self._step(self._prefill_jit, token_ids[start:start + chunk], start)
        for pos in range(num_chunked, n):
            logits = self._step(self._decode_jit, [token_ids[pos]], pos)
        self.seq.num_computed_tokens = n
        return logits.numpy()[0]

    def decode(self, token_id: int, position: int) -> np.ndarray:
        """Append one token at `position` (== tokens so far) and return its logits."""
        seq = self.seq
        assert seq is not None and position == seq.num_computed_tokens, "decode continues the prefilled sequence"
        if position >= self.max_model_len:
            raise ValueError(f"position {position} is outside the context (max_model_len {self.max_model_len})")
        seq.append_token_id(token_id)
        if self.block_manager.append_slots(seq, 1) is None:
            raise ValueError(f"the KV cache is out of blocks ({self.block_manager.num_blocks} in all) at position "
                             f"{position}: give it more memory or generate fewer tokens")
        logits = self._step(self._decode_jit, [token_id], position)
        seq.num_computed_tokens += 1
        return logits.numpy()[0]
