"""BlockManager with prefix caching: a hypothesis state machine that also plays the device.

Pure Python, no model. The machine keeps what a real KV cache would hold: for every slot of every block, the
token ids that the K/V written there depend on (the token at that position and every token before it). Rules
run the engine's protocol in any order: admit a prompt (with hits on a few shared system prompts, and several
requests with one prompt, as n > 1 completions now are), schedule a sequence's next chunk (append_slots), run the
scheduled step (every scheduled write, then the full blocks offered to the cache), finish or preempt, and take a
scheduled sequence back (a preemption in the middle of scheduling). A step writes only into a block that one
sequence holds and the cache does not name: a full block shared through the prefix cache is never written. After
every rule it checks:

  - no block leaks: free + in use == the pool, no block twice in the free queue;
  - ref_cnt is the number of sequences holding the block; a block taken from the free queue had ref_cnt 0;
  - only prefix-cache hits share: a block that several sequences hold is a cached full block, computed in each;
  - every cached hash maps to a block whose slots hold exactly the tokens that hash names;
  - every token a sequence has computed is in its blocks: a block handed out while still in use, a hit on
    a block evicted or overwritten since, a wrong num_computed_tokens after a hit all fail here.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_block_manager import assert_pool_whole

from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.prefix_cache import block_hashes
from tinyvllm.core.sequence import Sequence

SYSTEM_PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 3, 2, 1, 1], [2, 2, 2, 2, 2, 2]]


class CachingBlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.bs = block_size
        # slots[block][offset]: the tokens whose K/V that slot holds (a prefix of some sequence), None if unwritten
        self.slots: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.live: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # hold none: new or preempted
        self.scheduled: dict[int, int] = {}  # seq_id -> tokens this step computes (scheduled, not yet run)
        self.next_id = 0

    # ---- the protocol ----

    @rule(system=st.integers(0, len(SYSTEM_PROMPTS) - 1), keep=st.integers(1, 9),
          tail=st.lists(st.integers(1, 3), max_size=6), n=st.integers(1, 3))
    def add(self, system, keep, tail, n):
        """`n` requests with one prompt (n > 1 completions): the later ones read it from the prefix cache."""
        for _ in range(n):
            self.waiting.append(Sequence(self.next_id, SYSTEM_PROMPTS[system][:keep] + tail))
            self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def allocate(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        hits = self.bm.cached_prefix(seq)
        was_free = {b.block_id for b in self.bm.free_block_queue}
        if self.bm.allocate(seq) is None:
            assert seq.block_table == [] and {b.block_id for b in self.bm.free_block_queue} == was_free
            return
        assert seq.block_table[:len(hits)] == [b.block_id for b in hits]
        assert set(seq.block_table[len(hits):]) <= was_free, "a block in use was handed out"
        assert seq.num_computed_tokens == len(hits) * self.bs < seq.num_tokens  # the last token is always computed
        self.waiting.remove(seq)
        self.live.append(seq)

    @precondition(lambda self: any(s.seq_id not in self.scheduled for s in self.live))
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def schedule(self, data, chunk):
        """The scheduler gives a live sequence its next chunk: slots for it."""
        seq = data.draw(st.sampled_from([s for s in self.live if s.seq_id not in self.scheduled]))
        n = min(chunk, seq.num_uncomputed_tokens)
        refs = {b.block_id: b.ref_cnt for b in self.bm.blocks}
        was_free = {b.block_id for b in self.bm.free_block_queue}
        table = list(seq.block_table)
        taken = self.bm.append_slots(seq, n)
        if taken is None:
            assert seq.block_table == table and {b.block_id: b.ref_cnt for b in self.bm.blocks} == refs
            return
        assert set(taken) <= was_free and all(refs[b] == 0 for b in taken), "a block in use was handed out"
        assert seq.block_table == table + taken, "a block table only grows"
        self.scheduled[seq.seq_id] = n

    @precondition(lambda self: self.scheduled)
    @rule(data=st.data())
    def take_back(self, data):
        """Preemption while scheduling: a scheduled sequence is freed before the step runs."""
        seq_id = data.draw(st.sampled_from(sorted(self.scheduled)))
        seq = next(s for s in self.live if s.seq_id == seq_id)
        self.finish(seq, preempt=True)

    @rule()
    def run(self):
        """The step: every scheduled write (the forward pass), then the full blocks offered to the cache."""
        for seq in self.live:
            n = self.scheduled.get(seq.seq_id)
            if n is None:
                continue
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = self.bm.blocks[seq.block_table[pos // self.bs]]
                # a shared block is a cached full block, and a cached block is never written: its hash names its K/V
                assert block.ref_cnt == 1 and block.block_hash is None, (
                    f"a step writes into block {block.block_id}: ref_cnt {block.ref_cnt}, hash {block.block_hash}")
                self.slots[block.block_id][pos % self.bs] = tuple(tokens[:pos + 1])
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq, n)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token_id(1 + seq.num_tokens % 3)
        self.scheduled.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        self.finish(data.draw(st.sampled_from(self.live)), preempt)

    def finish(self, seq: Sequence, preempt: bool) -> None:
        self.bm.free(seq)
        assert seq.block_table == []
        self.live.remove(seq)
        self.scheduled.pop(seq.seq_id, None)
        if preempt:
            seq.num_computed_tokens = 0
            self.waiting.append(seq)

    # ---- what must always hold ----

    @invariant()
    def no_block_leaks(self):
        assert_pool_whole(self.bm)

    @invariant()
    def ref_cnt_counts_holders_and_only_prefix_cache_hits_share(self):
        holders: dict[int, list[tuple[Sequence, int]]] = {}  # block -> (holder, index in its block table)
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table))
            # every computed or scheduled token has its slot; no block past the sequence's last token
            needed = seq.num_computed_tokens + self.scheduled.get(seq.seq_id, 0)
            assert -(-needed // self.bs) <= len(seq.block_table) <= seq.num_blocks(self.bs)
            for index, block_id in enumerate(seq.block_table):
                holders.setdefault(block_id, []).append((seq, index))
        assert [b.ref_cnt for b in self.bm.blocks] == [len(holders.get(i, [])) for i in range(self.bm.num_blocks)]
        assert all(not s.block_table for s in self.waiting)
        for block_id, held_by in holders.items():
            if len(held_by) == 1:
                continue
            # shared: the cache named this block, and each holder has computed all of it, as the same block
            # of its own tokens (a hit on the wrong block, or a shared block still being written, fails here)
            block = self.bm.blocks[block_id]
            assert block.block_hash is not None and self.bm.cached_blocks.get(block.block_hash) is block, (
                f"block {block_id} is shared by {[s for s, _ in held_by]} but not cached")
            for seq, index in held_by:
                assert (index + 1) * self.bs <= seq.num_computed_tokens, f"{seq} shares block {block_id}, not computed"
                assert seq.block_hashes(self.bs)[index] == block.block_hash, f"{seq} shares another prefix's block"

    @invariant()
    def every_cached_hash_names_what_its_block_holds(self):
        for block in self.bm.blocks:  # a block keeps a hash only while the table maps that hash to it
            assert block.block_hash is None or self.bm.cached_blocks.get(block.block_hash) is block
        for block_hash, block in self.bm.cached_blocks.items():
            assert block.block_hash == block_hash
            content = self.slots[block.block_id]
            assert all(slot is not None for slot in content), "a cached block has an unwritten slot"
            prefix = content[-1]
            assert all(slot == prefix[:len(prefix) - self.bs + 1 + j] for j, slot in enumerate(content))
            assert len(prefix) % self.bs == 0 and block_hashes(prefix, self.bs, [])[-1] == block_hash

    @invariant()
    def every_computed_token_is_in_the_sequences_blocks(self):
        for seq in self.live:
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                slot = self.slots[seq.block_table[pos // self.bs]][pos % self.bs]
                assert slot == tuple(tokens[:pos + 1]), f"{seq}: position {pos} holds {slot}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.live):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks and all(b.ref_cnt == 0 for b in self.bm.blocks)


CachingBlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestCachingBlockManager = CachingBlockManagerMachine.TestCase


def test_two_sequences_with_one_prompt_share_its_full_blocks_through_the_cache():
    """n > 1: the first request computes the prompt; the second finds its full blocks in the prefix cache."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 10 tokens: two full blocks, then a block holding 2
    first, second = Sequence(0, prompt), Sequence(1, prompt)
    assert bm.allocate(first) == [0, 1, 2] and first.num_computed_tokens == 0
    first.num_computed_tokens = 10  # its step computed the whole prompt
    bm.cache_full_blocks(first, 10)
    assert bm.allocate(second) == [0, 1, 3]  # the full blocks shared, a fresh block for the partial last one
    assert second.num_computed_tokens == 8  # only tokens 8 and 9 are computed again, into block 3
    assert [b.ref_cnt for b in bm.blocks[:4]] == [2, 2, 1, 1] and bm.num_free_blocks == 4
    hashes = first.block_hashes(4)
    assert bm.cached_blocks == {hashes[0]: bm.blocks[0], hashes[1]: bm.blocks[1]}  # the partial block is not cached
    bm.free(first)
    bm.free(second)
    # each last block goes back first, the shared ones when their last holder lets go: cached, evicted last
    assert [b.block_id for b in bm.free_block_queue] == [4, 5, 6, 7, 2, 3, 1, 0]
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    assert bm.cached_blocks == {hashes[0]: bm.blocks[0], hashes[1]: bm.blocks[1]}
    assert [bm.blocks[i].block_hash for i in (0, 1)] == hashes[:2]
