"""BlockManager without prefix caching: property tests over random allocate / append / preempt / free, and slot mapping.

Pure Python, no device. The state machine keeps a shadow of what each sequence should hold and checks
after every step that no block leaks, none is freed twice, ref counts match the block tables, no two
sequences hold the same block (only prefix-cache hits share a block, and caching is off here: see
tests/core/test_block_manager_caching.py), and running out of blocks answers False / None and changes nothing.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_pool_whole(bm: BlockManager) -> None:
    """Every block is either in the free queue, once, with no holder, or held: none leaked, none counted twice."""
    free_ids = [b.block_id for b in bm.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == bm.num_free_blocks, "a block is in the free queue twice"
    assert all(bm.blocks[i].ref_cnt == 0 for i in free_ids)
    used = sum(1 for b in bm.blocks if b.ref_cnt > 0)
    assert bm.num_free_blocks + used == bm.num_blocks, "a block leaked"


def snapshot(bm: BlockManager, seqs) -> tuple:
    """Everything an operation that failed must leave untouched."""
    return ([b.block_id for b in bm.free_block_queue], [b.ref_cnt for b in bm.blocks],
            [list(s.block_table) for s in seqs])


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.live: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # hold none (new, or preempted)
        self.freed: list[Sequence] = []  # finished: hold none
        self.expected_num_blocks: dict[int, int] = {}  # shadow of len(block_table) per live seq
        self.next_id = 0

    def new_seq(self, prompt_len: int) -> Sequence:
        seq = Sequence(self.next_id, [self.next_id % 97] * prompt_len)
        self.next_id += 1
        return seq

    def all_seqs(self):
        return self.live + self.waiting + self.freed

    @rule(prompt_len=st.integers(1, 40))
    def add(self, prompt_len):
        self.waiting.append(self.new_seq(prompt_len))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def allocate(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        before = snapshot(self.bm, self.all_seqs())
        can = self.bm.can_allocate(seq)
        table = self.bm.allocate(seq)
        assert can == (table is not None) == (seq.num_blocks(self.bm.block_size) <= len(before[0]))
        if table is None:
            assert snapshot(self.bm, self.all_seqs()) == before
            return
        assert len(table) == cdiv(seq.num_tokens, self.bm.block_size)  # exactly ceil(num_tokens / bs)
        self.waiting.remove(seq)
        self.live.append(seq)
        self.expected_num_blocks[seq.seq_id] = len(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(0, 40))
    def step(self, data, chunk):
        """One engine step for a live seq: compute up to `chunk` of its uncomputed tokens; sample if caught up."""
        seq = data.draw(st.sampled_from(self.live))
        n = min(chunk, seq.num_uncomputed_tokens)
        before = snapshot(self.bm, self.all_seqs())
        table, free_ids = list(seq.block_table), before[0]
        can = self.bm.can_append_slots(seq, n)
        new_blocks = self.bm.append_slots(seq, n)
        assert can == (new_blocks is not None)
        if new_blocks is None:
            assert snapshot(self.bm, self.all_seqs()) == before
            return
        assert seq.block_table == table + new_blocks, "a block table only grows"
        assert set(new_blocks) <= set(free_ids), "a block in use was handed out"
        bs = self.bm.block_size
        self.expected_num_blocks[seq.seq_id] = max(self.expected_num_blocks[seq.seq_id],
                                                   cdiv(seq.num_computed_tokens + n, bs))
        assert len(new_blocks) <= cdiv(n, bs) + 1  # a decode (n = 1) adds at most one block
        # the slots for this step's tokens exist and lie in the seq's own blocks
        slots = self.bm.get_slot_mapping(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        assert all(s // bs in seq.block_table for s in slots)
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.append_token_id(seq.num_tokens % 97)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        """Finish a seq, or preempt it by recompute (blocks freed, it waits to be allocated again)."""
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        assert seq.block_table == []
        self.live.remove(seq)
        del self.expected_num_blocks[seq.seq_id]
        if preempt:
            seq.num_computed_tokens = 0
            self.waiting.append(seq)
        else:
            self.freed.append(seq)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_twice_is_an_error(self, data):
        seq = data.draw(st.sampled_from(self.freed))
        before = snapshot(self.bm, self.all_seqs())
        with pytest.raises(AssertionError, match="freed twice"):
            self.bm.free(seq)
        assert snapshot(self.bm, self.all_seqs()) == before

    @invariant()
    def every_block_is_free_or_held(self):
        assert_pool_whole(self.bm)

    @invariant()
    def ref_cnt_counts_holders_and_nothing_is_shared(self):
        holders: dict[int, list[Sequence]] = {}
        for seq in self.live:
            assert len(seq.block_table) == len(set(seq.block_table))
            for block_id in seq.block_table:
                holders.setdefault(block_id, []).append(seq)
        for block in self.bm.blocks:
            assert block.ref_cnt == len(holders.get(block.block_id, []))
        # only prefix-cache hits share a block, and prefix caching is off here: a shared block is a block in use
        # handed out again (its ref_cnt raised instead of reset would still match the holders above)
        for block_id, seqs in holders.items():
            assert len(seqs) == 1, f"block {block_id} is shared by {seqs}"
        assert not self.bm.cached_blocks and all(b.block_hash is None for b in self.bm.blocks)
        assert all(not s.block_table for s in self.waiting + self.freed)

    @invariant()
    def each_seq_holds_the_blocks_its_tokens_need(self):
        bs = self.bm.block_size
        for seq in self.live:
            n = len(seq.block_table)
            assert n == self.expected_num_blocks[seq.seq_id]
            assert n * bs >= seq.num_computed_tokens  # every computed token has a slot
            assert n <= cdiv(seq.num_tokens, bs)  # waste under one block per sequence

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.live):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_cnt == 0 for b in self.bm.blocks)
        assert sorted(b.block_id for b in self.bm.free_block_queue) == list(range(self.bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


# ---- exhaustion, explicitly ----

def test_running_out_answers_false_and_none_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = Sequence(0, list(range(9)))  # needs 3 blocks
    assert not bm.can_allocate(big) and bm.allocate(big) is None
    assert big.block_table == [] and bm.num_free_blocks == 2
    seq = Sequence(1, list(range(8)))  # exactly 2 blocks: the pool is full
    assert bm.allocate(seq) == [0, 1] and bm.num_free_blocks == 0
    seq.num_computed_tokens = 8
    seq.append_token_id(0)
    assert bm.can_append_slots(seq, 0)  # nothing new to compute: no block needed
    assert not bm.can_append_slots(seq, 1) and bm.append_slots(seq, 1) is None
    assert seq.block_table == [0, 1]
    bm.free(seq)
    assert bm.num_free_blocks == 2


def test_decode_takes_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(0, [1, 2, 3])
    bm.allocate(seq)
    seq.num_computed_tokens = 3
    grown = []
    for _ in range(10):  # decode: each step computes the token sampled last step
        seq.append_token_id(0)
        grown.append(len(bm.append_slots(seq, 1)))
        seq.num_computed_tokens += 1
    # tokens 3..12 computed: new blocks at positions 4 and 8 and 12
    assert grown == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert len(seq.block_table) == cdiv(seq.num_computed_tokens, 4) == 4


def test_bad_pool_sizes_are_value_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


# ---- slot mapping ----

@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_slot_mapping_for_prompts_crossing_block_boundaries(block_size):
    lengths = sorted({n for n in (1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2) if n >= 1})
    bm = BlockManager(num_blocks=64, block_size=block_size)
    # fragment the pool so block tables are not contiguous ranges
    spacers = [Sequence(100 + i, [0] * block_size) for i in range(6)]
    for s in spacers:
        bm.allocate(s)
    for s in spacers[::2]:
        bm.free(s)
    seqs = [Sequence(i, list(range(n))) for i, n in enumerate(lengths)]
    slots_in_use = {slot for s in spacers[1::2] for slot in bm.get_slot_mapping(s, 0, s.num_tokens)}
    for seq in seqs:
        assert bm.allocate(seq) is not None
        slots = bm.get_slot_mapping(seq, 0, seq.num_tokens)
        for pos, slot in enumerate(slots):
            assert slot == seq.block_table[pos // block_size] * block_size + pos % block_size
            assert slot // block_size == seq.block_table[pos // block_size] and slot % block_size == pos % block_size
        assert len(set(slots)) == len(slots) and not slots_in_use & set(slots), "two tokens share a slot"
        slots_in_use |= set(slots)
        # a decode step's single slot is the next one of the same mapping
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token_id(0)
        bm.append_slots(seq, 1)
        (slot,) = bm.get_slot_mapping(seq, seq.num_tokens - 1, seq.num_tokens)
        pos = seq.num_tokens - 1
        assert slot == seq.block_table[pos // block_size] * block_size + pos % block_size
        assert slot not in slots_in_use
        slots_in_use.add(slot)
        # a chunk in the middle is a slice of the whole
        assert bm.get_slot_mapping(seq, 1, seq.num_tokens) == bm.get_slot_mapping(seq, 0, seq.num_tokens)[1:]


def test_slot_mapping_outside_the_block_table_is_an_assertion():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(0, [1, 2, 3])
    bm.allocate(seq)
    assert bm.get_slot_mapping(seq, 0, 4) == [0, 1, 2, 3]  # the last block's spare slot is addressable
    with pytest.raises(AssertionError, match="outside"):
        bm.get_slot_mapping(seq, 0, 5)
