"""BlockManager with prefix caching, fork and copy-on-write: a hypothesis state machine that also plays the device.

Pure Python, no model. The machine keeps what a real KV cache would hold: for every slot of every block, the
token ids that the K/V written there depend on (the token at that position and every token before it). Rules
run the engine's protocol in any order: admit a prompt (with hits on a few shared system prompts), schedule a
sequence's next chunk (append_slots, copy-on-write included), run the scheduled step (the pending copies first,
then every scheduled write, then the full blocks offered to the cache), fork, finish or preempt, and take a
scheduled sequence back (a preemption in the middle of scheduling). After every rule it checks:

  - no block leaks: free + in use + held for a pending copy == the pool, no block twice in the free queue;
  - ref_cnt is the number of sequences holding the block; a block taken from the free queue had ref_cnt 0;
  - every cached hash maps to a block whose slots hold exactly the tokens that hash names;
  - every token a sequence has computed is in its blocks (through copies not yet made, as the step will see it):
    a shared block written by one sharer, a copy that missed a token, a wrong cache hit all fail here.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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

    @rule(system=st.integers(0, len(SYSTEM_PROMPTS) - 1), keep=st.integers(1, 9), tail=st.lists(st.integers(1, 3),
                                                                                                max_size=6))
    def add(self, system, keep, tail):
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
        """The scheduler gives a live sequence its next chunk: slots for it, copy-on-write included."""
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
        for index, (old, new) in enumerate(zip(table, seq.block_table)):
            if old != new:  # replaced: it was shared, and its copy is pending
                assert refs[old] > 1 and self.bm.pending_copies[new] == old
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
        """The step: the copies first (on the device, before the forward pass), then every write, then caching."""
        copies = self.bm.take_blocks_to_copy()
        srcs, dsts = {src for src, _ in copies}, [dst for _, dst in copies]
        # one launch makes every copy at once (a GPU runs them in parallel): no block may be read and written
        assert len(set(dsts)) == len(dsts) and not srcs & set(dsts), f"copies {copies} overlap"
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        assert not self.bm.held_for_copy and not self.bm.pending_copies
        for seq in self.live:
            n = self.scheduled.get(seq.seq_id)
            if n is None:
                continue
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = self.bm.blocks[seq.block_table[pos // self.bs]]
                assert block.ref_cnt == 1, f"a step writes into block {block.block_id}, shared by {block.ref_cnt}"
                self.slots[block.block_id][pos % self.bs] = tuple(tokens[:pos + 1])
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq, n)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token_id(1 + seq.num_tokens % 3)
        self.scheduled.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        """n > 1 or a beam: the child shares every block of a sequence not scheduled this step."""
        parents = [s for s in self.live if s.seq_id not in self.scheduled]
        if not parents:
            return
        parent = data.draw(st.sampled_from(parents))
        child = Sequence(self.next_id, parent.prompt_token_ids)
        self.next_id += 1
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert child.block_table == parent.block_table and self.bm.num_free_blocks == free_before
        if data.draw(st.booleans()) and parent.output_token_ids and parent.num_uncomputed_tokens == 1:
            child.output_token_ids[-1] = 1 + parent.output_token_ids[-1] % 3  # a beam: another last token
        self.live.append(child)

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
        bm = self.bm
        free_ids = [b.block_id for b in bm.free_block_queue]
        held = [b.block_id for b in bm.held_for_copy]
        assert len(free_ids) == len(set(free_ids)) == bm.num_free_blocks, "a block is in the free queue twice"
        assert all(bm.blocks[i].ref_cnt == 0 for i in free_ids + held)
        assert not set(held) & set(free_ids) and set(held) <= set(bm.pending_copies.values())
        used = sum(1 for b in bm.blocks if b.ref_cnt > 0)
        assert bm.num_free_blocks + used + len(held) == bm.num_blocks, "a block leaked"

    @invariant()
    def ref_cnt_counts_holders(self):
        holders: dict[int, int] = {}
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table))
            # every computed or scheduled token has its slot; no block past the sequence's last token
            needed = seq.num_computed_tokens + self.scheduled.get(seq.seq_id, 0)
            assert -(-needed // self.bs) <= len(seq.block_table) <= seq.num_blocks(self.bs)
            for block_id in seq.block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
        assert [b.ref_cnt for b in self.bm.blocks] == [holders.get(i, 0) for i in range(self.bm.num_blocks)]
        assert all(not s.block_table for s in self.waiting)

    @invariant()
    def every_cached_hash_names_what_its_block_holds(self):
        for block_hash, block in self.bm.cached_blocks.items():
            assert block.block_hash == block_hash
            content = self.slots[block.block_id]
            assert all(slot is not None for slot in content), "a cached block has an unwritten slot"
            prefix = content[-1]
            assert all(slot == prefix[:len(prefix) - self.bs + 1 + j] for j, slot in enumerate(content))
            assert len(prefix) % self.bs == 0 and block_hashes(prefix, self.bs, [])[-1] == block_hash

    @invariant()
    def every_computed_token_is_in_the_sequences_blocks(self):
        pending = dict(self.bm.pending_copies)  # dst -> src: what the next step's copies will put there
        for seq in self.live:
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                block_id = seq.block_table[pos // self.bs]
                slot = self.slots[pending.get(block_id, block_id)][pos % self.bs]
                assert slot == tuple(tokens[:pos + 1]), f"{seq}: position {pos} holds {slot}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.live):
            self.bm.free(seq)
        self.bm.take_blocks_to_copy()
        assert self.bm.num_free_blocks == self.bm.num_blocks and all(b.ref_cnt == 0 for b in self.bm.blocks)


CachingBlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestCachingBlockManager = CachingBlockManagerMachine.TestCase


def test_copy_on_write_copies_once_and_the_last_holder_writes_in_place():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Sequence(0, [1, 2, 3, 4, 5, 6])  # 6 tokens: block 0 full, block 1 half full
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    children = [Sequence(i, parent.prompt_token_ids) for i in (1, 2, 3)]
    for child in children:
        bm.fork(parent, child)
        child.num_computed_tokens = 6
    assert [b.ref_cnt for b in bm.blocks[:2]] == [4, 4] and bm.num_free_blocks == 6
    for i, seq in enumerate([parent, *children]):  # each writes its first sampled token at position 6
        seq.append_token_id(10 + i)
        bm.append_slots(seq, 1)
    copies = bm.take_blocks_to_copy()
    assert copies == [(1, 2), (1, 3), (1, 4)]  # three copies of the half-full block; the fourth writer keeps it
    assert [s.block_table for s in (parent, *children)] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert [b.ref_cnt for b in bm.blocks[:5]] == [4, 1, 1, 1, 1]  # the full block stays shared
    assert bm.num_free_blocks == 3


def test_a_copy_source_freed_before_its_copy_waits_out_of_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = Sequence(0, [1, 2]), Sequence(1, [1, 2])
    bm.allocate(a)
    a.num_computed_tokens = 2
    bm.fork(a, b)
    b.num_computed_tokens = 2
    a.append_token_id(7)
    assert bm.append_slots(a, 1) == [1]  # a copies block 0 into block 1
    bm.free(b)  # block 0's last holder lets go before the copy is made
    assert bm.num_free_blocks == 1 and [blk.block_id for blk in bm.held_for_copy] == [0]
    assert bm.allocate(Sequence(2, [5, 5, 5, 5, 5])) is None  # needs 2 blocks: block 0 is not one of the free
    assert bm.take_blocks_to_copy() == [(0, 1)] and bm.num_free_blocks == 2


def test_a_copy_into_a_block_freed_before_the_step_is_dropped():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = Sequence(0, [1, 2]), Sequence(1, [1, 2])
    bm.allocate(a)
    a.num_computed_tokens = 2
    bm.fork(a, b)
    b.num_computed_tokens = 2
    a.append_token_id(7)
    bm.append_slots(a, 1)
    bm.free(a)  # preempted while scheduling: nobody reads its copy
    assert bm.take_blocks_to_copy() == [] and bm.num_free_blocks == 2
