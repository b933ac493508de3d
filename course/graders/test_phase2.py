"""Phase 2's graders: slot_mapping, BlockManager.append_slots and .free, paged_attention (course/phase2/). The
block manager's are plain Python, no device; paged_attention is checked against the plain recipe on a cache whose
blocks are scattered and whose unfilled slots hold garbage."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from tinyvllm.attention import paged
from tinyvllm.core import block_manager
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.sequence import Sequence


def running_seq(num_tokens: int, num_computed: int = 0, seq_id: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(range(1, num_tokens + 1)))
    seq.num_computed_tokens = num_computed
    return seq


# ---- slot_mapping ----

@pytest.mark.task("slot_mapping")
def test_slot_mapping_follows_the_block_table():
    slots = block_manager.slot_mapping([7, 2], 4, 0, 6)
    assert slots == [28, 29, 30, 31, 8, 9], (
        f"block_table [7, 2], block_size 4: positions 0..5 live in block 7 (slots 28..31) then block 2 (8, 9); "
        f"got {slots}")


@pytest.mark.task("slot_mapping")
def test_slot_mapping_of_one_decode_position():
    slots = block_manager.slot_mapping([5, 0, 3], 16, 37, 38)
    assert slots == [3 * 16 + 5], f"position 37, block_size 16: block_table[2] = 3, offset 5 -> slot 53; got {slots}"
    assert block_manager.slot_mapping([5], 16, 4, 4) == [], "an empty range [4, 4) has no slots"


@pytest.mark.task("slot_mapping")
def test_the_block_manager_asks_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running_seq(6)
    bm.allocate(seq)  # blocks 0, 1
    got = bm.get_slot_mapping(seq, 2, 6)
    assert got == [2, 3, 4, 5], f"BlockManager.get_slot_mapping(seq, 2, 6) with blocks [0, 1]: got {got}"


# ---- append_slots ----

@pytest.mark.task("append_slots")
def test_append_slots_with_room_in_the_last_block_takes_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running_seq(6)
    bm.allocate(seq)
    seq.num_computed_tokens = 6
    seq.append_token_id(9)
    taken = bm.append_slots(seq, 1)
    assert taken == [], (f"position 6 fits in the second block (slots 4..7 of the sequence): nothing to take, "
                         f"got {taken}")
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6, f"block_table {seq.block_table}"


@pytest.mark.task("append_slots")
def test_append_slots_takes_a_block_at_the_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running_seq(8)
    bm.allocate(seq)  # 2 full blocks
    seq.num_computed_tokens = 8
    taken = bm.append_slots(seq, 1)
    assert taken is not None and len(taken) == 1, f"position 8 needs a third block of 4: expected one id, got {taken}"
    assert seq.block_table[-1] == taken[0] and len(seq.block_table) == 3, f"block_table {seq.block_table}"
    assert bm.blocks[taken[0]].ref_cnt == 1, "a block taken for a sequence has ref_cnt 1"


@pytest.mark.task("append_slots")
def test_append_slots_for_a_chunk_takes_several():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running_seq(3)
    seq.block_table = []
    taken = bm.append_slots(seq, 10)  # positions 0..9: 3 blocks
    assert taken is not None and len(taken) == 3, (f"10 new tokens from position 0 need ceil(10/4) = 3 blocks, "
                                                   f"got {taken}")


@pytest.mark.task("append_slots")
def test_append_slots_out_of_blocks_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = running_seq(8)
    bm.allocate(seq)
    seq.num_computed_tokens = 8
    table_before = list(seq.block_table)
    taken = bm.append_slots(seq, 1)
    assert taken is None, f"no block is free: append_slots should answer None (the scheduler preempts), got {taken}"
    assert seq.block_table == table_before and bm.num_free_blocks == 0, "a failed append_slots must change nothing"


# ---- free ----

@pytest.mark.task("free")
def test_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = running_seq(10)
    bm.allocate(seq)  # 3 blocks
    bm.free(seq)
    assert bm.num_free_blocks == 8, f"after free all 8 blocks should be free, {bm.num_free_blocks} are"
    assert seq.block_table == [], f"a freed sequence holds no blocks, block_table = {seq.block_table}"
    assert all(block.ref_cnt == 0 for block in bm.blocks), [block.ref_cnt for block in bm.blocks]


@pytest.mark.task("free")
def test_free_gives_the_last_block_back_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = running_seq(12)
    table = bm.allocate(seq)  # [0, 1, 2]
    bm.free(seq)
    order = [block.block_id for block in bm.free_block_queue]
    assert order == [3, *reversed(table)], (
        f"the free queue should end with the blocks last first ({list(reversed(table))}), got {order}")


@pytest.mark.task("free")
def test_free_keeps_a_shared_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = running_seq(4, seq_id="a"), running_seq(4, seq_id="b")
    bm.allocate(a)
    b.block_table = list(a.block_table)  # b shares a's block (as a forked sequence or a cached prefix does)
    bm.blocks[a.block_table[0]].ref_cnt += 1
    bm.free(a)
    block = bm.blocks[b.block_table[0]]
    assert block.ref_cnt == 1, f"b still holds the block: its ref_cnt should drop from 2 to 1, got {block.ref_cnt}"
    assert bm.num_free_blocks == 3, f"a block with ref_cnt 1 is not free: 3 should be free, {bm.num_free_blocks} are"


@pytest.mark.task("free")
def test_free_twice_is_a_bug():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = running_seq(4)
    bm.allocate(seq)
    bm.free(seq)
    with pytest.raises(AssertionError):
        bm.free(seq)


# ---- paged_attention ----

def attention_numpy(q, keys, values, positions):
    """q (T, H, Hd) at positions (T,), keys/values (S, KvH, Hd) of positions 0..S-1: causal GQA."""
    T, H, Hd = q.shape
    G = H // keys.shape[1]
    k, v = np.repeat(keys, G, axis=1), np.repeat(values, G, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(Hd)
    scores = scores + np.where(np.arange(len(keys))[None, :] > positions[:, None], -np.inf, 0.0)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


def scattered_cache(contexts: list[int], block_size=4, num_blocks=12, kv_heads=2, head_dim=8, seed=0):
    """Each sequence's K/V at random blocks of a cache full of garbage: (k_cache, v_cache, block_tables, keys,
    values), keys[i] / values[i] the i-th sequence's (context, KvH, Hd)."""
    rng = np.random.default_rng(seed)
    k_cache = (100 * rng.standard_normal((num_blocks, block_size, kv_heads, head_dim))).astype(np.float32)
    v_cache = (100 * rng.standard_normal((num_blocks, block_size, kv_heads, head_dim))).astype(np.float32)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(-(-c // block_size) for c in contexts)
    tables, keys, values = np.zeros((len(contexts), max_blocks), dtype=np.int32), [], []
    for i, context in enumerate(contexts):
        k = rng.standard_normal((context, kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((context, kv_heads, head_dim)).astype(np.float32)
        for pos in range(context):
            if pos % block_size == 0:
                tables[i, pos // block_size] = free.pop()
            k_cache[tables[i, pos // block_size], pos % block_size] = k[pos]
            v_cache[tables[i, pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


@pytest.mark.task("paged_attention")
def test_paged_attention_decode_reads_through_the_block_table():
    contexts = [7, 10]  # the last blocks partly filled: their other slots hold garbage (100x larger)
    k_cache, v_cache, tables, keys, values = scattered_cache(contexts)
    q = np.random.default_rng(1).standard_normal((2, 1, 4, 8)).astype(np.float32)
    positions = np.array([[c - 1] for c in contexts], dtype=np.int32)
    out = paged.paged_attention(Tensor(q), Tensor(k_cache), Tensor(v_cache), Tensor(tables), tables.shape[1],
                                Tensor(positions)).numpy()
    for i, context in enumerate(contexts):
        expected = attention_numpy(q[i], keys[i], values[i], positions[i])
        err = np.abs(out[i] - expected).max()
        assert err < 1e-4, (f"sequence {i} (context {context}, blocks {list(tables[i])}): the output differs from "
                            f"attention over its own tokens by {err:.3g}; are the unfilled slots masked (key s > "
                            f"position p)?")


@pytest.mark.task("paged_attention")
def test_paged_attention_prefill_is_causal():
    k_cache, v_cache, tables, keys, values = scattered_cache([9], seed=2)
    q = np.random.default_rng(3).standard_normal((1, 9, 4, 8)).astype(np.float32)
    positions = np.arange(9, dtype=np.int32)[None]
    out = paged.paged_attention(Tensor(q), Tensor(k_cache), Tensor(v_cache), Tensor(tables), tables.shape[1],
                                Tensor(positions)).numpy()
    err = np.abs(out[0] - attention_numpy(q[0], keys[0], values[0], positions[0])).max()
    assert err < 1e-4, f"a 9-token prefill: query t may see keys 0..t only; the output differs by {err:.3g}"
