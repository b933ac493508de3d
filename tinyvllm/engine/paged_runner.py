"""Running the model on a paged KV cache, one sequence per forward pass (Phase 2; chapter 02, section 8)."""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_cache import PagedKVCache
from tinyvllm.attention.paged import PagedAttentionMetadata
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.sequence import Sequence
from tinyvllm.model.llama import LlamaForCausalLM


class PagedModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int = 16):
        self.model = model
        self.kv_cache = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device)
        self.block_manager = BlockManager(num_blocks, block_size)

    def forward(self, seq: Sequence) -> np.ndarray:
        """`seq`'s tokens not yet in the cache -> the last one's logits (vocab,); MemoryError if too few blocks."""
        start, end = seq.num_computed_tokens, seq.num_tokens
        manager = self.block_manager
        taken = manager.append_slots(seq, end - start) if seq.block_table else manager.allocate(seq)
        if taken is None:
            raise MemoryError(f"{seq} needs more blocks than the {manager.num_free_blocks} free")

        def ints(values: list) -> Tensor:
            return Tensor(np.array(values, dtype=np.int32), dtype=dtypes.int32, device=self.model.device)

        positions = ints([list(range(start, end))])
        metadata = PagedAttentionMetadata(slot_mapping=ints(manager.get_slot_mapping(seq, start, end)),
                                          block_tables=ints([seq.block_table]), positions=positions,
                                          num_blocks=len(seq.block_table))
        hidden = self.model(ints([seq.token_ids_in(start, end)]), positions, self.kv_cache.kv_caches, metadata)
        seq.num_computed_tokens = end
        return self.model.compute_logits(hidden[:, -1]).numpy()[0]

    def free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
