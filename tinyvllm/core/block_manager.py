"""The KV cache's bookkeeping: which block of the pool holds which sequence's tokens.

    block 0 [ a0 a1 a2 a3 ] seq A, logical 0   ref_cnt 1
    block 1 [ b0 b1 b2 .. ] seq B, logical 0   ref_cnt 1
    block 2 [ .. .. .. .. ] free               ref_cnt 0

Taught in docs/phases/02-paged-attention.md; sharing in 07a-prefix-caching.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.core.sequence import Sequence


@dataclass(eq=False)
class Block:
    """One block of the pool. `ref_cnt`: the block tables holding it (> 1: a shared cached prefix, never written);
    `block_hash`: set once full and cached, kept while free until reused."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class FreeBlockQueue:
    """The free blocks, least recently freed first; a cached block a prompt hits leaves from the middle in O(1)."""

    def __init__(self, blocks: list[Block]):
        self._blocks = {block.block_id: block for block in blocks}

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self):
        return iter(self._blocks.values())

    def popleft(self) -> Block:
        return self._blocks.pop(next(iter(self._blocks)))

    def append(self, block: Block) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: Block) -> None:
        del self._blocks[block.block_id]


class BlockManager:
    """Hands out the blocks of a fixed pool and takes them back. Invariant: `num_free_blocks + blocks in use ==
    num_blocks`; running out answers False or None and changes nothing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.cached_blocks: dict[bytes, Block] = {}  # block hash -> the block holding that prefix's K/V
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def _take_free_blocks(self, n: int) -> list[int]:
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        block_ids = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} is in the free block queue but in use"
            if block.block_hash is not None:  # evict: the least recently used cached prefix goes first
                if self.cached_blocks.get(block.block_hash) is block:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        return block_ids

    # ---- a sequence's first blocks ----

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of cached blocks at the start of `seq`'s tokens, short of its last token (always computed,
        for its logits)."""
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache:
            return []
        hits = []
        for block_hash in seq.block_hashes(self.block_size)[:(seq.num_tokens - 1) // self.block_size]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, hits: list[Block] | None = None) -> bool:
        """Enough free blocks for `seq`, given its cached prefix `hits` (looked up here when not given)?"""
        hits = self.cached_prefix(seq) if hits is None else hits
        num_free_hits = sum(block.ref_cnt == 0 for block in hits)  # taking those also shrinks the free queue
        return seq.num_blocks(self.block_size) - len(hits) + num_free_hits <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> list[int] | None:
        """Give a new sequence blocks for all its tokens, its cached prefix shared first. Returns its block table, or
        None if too few blocks are free."""
        assert not seq.block_table, f"allocate: {seq} already holds blocks"
        hits = self.cached_prefix(seq)
        if not self.can_allocate(seq, hits):
            return None
        for block in hits:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
        new_blocks = self._take_free_blocks(seq.num_blocks(self.block_size) - len(hits))
        seq.block_table = [block.block_id for block in hits] + new_blocks
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens
        return seq.block_table

    def cache_full_blocks(self, seq: Sequence, num_new_computed: int) -> None:
        """Offer the blocks `seq`'s last `num_new_computed` tokens filled to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        first, end = ((seq.num_computed_tokens - num_new_computed) // self.block_size,
                      seq.num_computed_tokens // self.block_size)
        hashes = seq.block_hashes(self.block_size) if end > first else []
        for index in range(first, end):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and hashes[index] not in self.cached_blocks:
                block.block_hash = hashes[index]
                self.cached_blocks[hashes[index]] = block

    # ---- growing a running sequence ----

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        num_slots = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_slots // self.block_size) - len(seq.block_table))

    def can_append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[int] | None:
        """Make room for `num_new_tokens` more positions. Returns the ids of the blocks taken, or None if too few are
        free."""
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if num_missing > self.num_free_blocks:
            return None
        new_block_ids = self._take_free_blocks(num_missing)
        seq.block_table.extend(new_block_ids)
        return new_block_ids

    # ---- giving blocks back ----

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s reference to each of its blocks, last block first: a sequence's last blocks are the least
        likely to be shared, so they are evicted first."""
        assert seq.block_table, f"free: {seq} holds no blocks (freed twice?)"
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"free: block {block_id} of {seq} is already free"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:  # a cached block keeps its hash: a later prompt may still hit it
                self.free_block_queue.append(block)
        seq.block_table = []

    def free_slots_after(self, seq: Sequence, num_slots: int) -> None:
        """Keep the blocks holding `seq`'s first `num_slots` slots, free the rest (rejected draft tokens)."""
        num_kept = -(-num_slots // self.block_size)
        for block_id in reversed(seq.block_table[num_kept:]):
            block = self.blocks[block_id]
            assert block.ref_cnt == 1 and block.block_hash is None, f"block {block_id} of {seq} is shared or cached"
            block.ref_cnt = 0
            self.free_block_queue.append(block)
        del seq.block_table[num_kept:]

    # ---- where each token's K/V goes ----

    def get_slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        assert 0 <= start <= end <= len(seq.block_table) * self.block_size, (
            f"positions [{start}, {end}) are outside the {len(seq.block_table)} blocks of {seq}")
        return slot_mapping(seq.block_table, self.block_size, start, end)


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slot of each position in [start, end): block_table[pos // block_size] * block_size
    + pos % block_size."""
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]
