"""Phase 2, tasks append_slots and free: a running sequence's block table grows one block at a time, and its blocks
go back to the pool when it finishes or is preempted.

The engine calls them as `BlockManager.append_slots` and `BlockManager.free` (tinyvllm/core/block_manager.py;
the scheduler, every step). Each is written here as a function of `self`, the BlockManager; it may use:

    self.block_size, self.blocks (Block by id: .ref_cnt), self.num_free_blocks, self.free_block_queue (.append)
    self._take_free_blocks(n) -> n block ids taken from the free queue, each ref_cnt = 1 (asserts n are free)
    seq.block_table (list of block ids), seq.num_computed_tokens

Chapter: docs/phases/02-paged-attention.md ("Ref counts, and running out", "Build it"). Grade: make course P=2
"""

from __future__ import annotations


def append_slots(self, seq, num_new_tokens: int = 1) -> list[int] | None:
    """Make room for positions seq.num_computed_tokens .. seq.num_computed_tokens + num_new_tokens - 1.

    The sequence needs ceil((num_computed_tokens + num_new_tokens) / block_size) blocks in all; it holds
    len(seq.block_table). Take the missing ones (often none: the last block has room) and append them to
    seq.block_table. Returns the ids taken ([] when none were needed), or None when fewer blocks are free than
    are missing, changing nothing (the scheduler then preempts someone and asks again).
    """
    raise NotImplementedError("course/phase2/block_manager.py: append_slots is yours to write")


def free(self, seq) -> None:
    """Give back `seq`'s blocks: each block's ref_cnt drops by one, and a block whose ref_cnt reaches 0 goes to the
    free block queue (`self.free_block_queue.append(block)`). Go through the table last block first (the queue's
    left end is reused first, and a sequence's last blocks are the least likely to be shared). Then
    seq.block_table = []. Freeing a sequence that holds no blocks is a bug: assert with a message.
    """
    raise NotImplementedError("course/phase2/block_manager.py: free is yours to write")
