"""Phase 2, task slot_mapping: where each token's K/V go in the paged cache.

The engine calls it as `tinyvllm.core.block_manager.slot_mapping` (through `BlockManager.get_slot_mapping` and
the model runner, every step, for every scheduled token). Chapter: docs/phases/02-paged-attention.md
("slot_mapping: where each token's K/V go", "Build it"). Grade: make course P=2
"""

from __future__ import annotations


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slot of each position in [start, end) of a sequence whose logical block i is physical block
    block_table[i]: the cache is num_blocks * block_size slots, block b holding slots b * block_size ..
    b * block_size + block_size - 1.

        block_table = [7, 2], block_size = 4: positions 0..5 -> slots [28, 29, 30, 31, 8, 9]

    Plain Python (a list of ints): a decode step asks for one slot per sequence.
    """
    raise NotImplementedError("course/phase2/slot_mapping.py: slot_mapping is yours to write")
