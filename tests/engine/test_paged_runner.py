"""Phase 2's runner (tinyvllm/engine/paged_runner.py): the paged cache gives the contiguous cache's logits, with
sequences growing block by block in one shared pool, and a full pool refused without a change."""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
from tinyvllm.engine.paged_runner import PagedModelRunner
from tinyvllm.model.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def contiguous_logits(model, prompt: list[int], outputs: list[int]) -> list[np.ndarray]:
    runner = ContiguousModelRunner(model, max_model_len=64)
    logits = [runner.prefill(prompt)]
    for i, token in enumerate(outputs):
        logits.append(runner.decode(token, len(prompt) + i))
    return logits


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_two_interleaved_sequences_get_the_contiguous_logits(model, block_size):
    runner = PagedModelRunner(model, num_blocks=64 // block_size, block_size=block_size)
    seqs = [Sequence("a", [504, 3575, 282, 4649, 314]), Sequence("b", list(range(200, 209)))]
    logits = {seq.seq_id: [] for seq in seqs}
    for _ in range(4):  # a step of each in turn: their blocks interleave in the pool
        for seq in seqs:
            logits[seq.seq_id].append(runner.forward(seq))
            seq.append_token_id(int(logits[seq.seq_id][-1].argmax()))
    for seq in seqs:
        assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size)
        reference = contiguous_logits(model, seq.prompt_token_ids, seq.output_token_ids[:-1])
        np.testing.assert_allclose(np.stack(logits[seq.seq_id]), np.stack(reference), atol=1e-4)
    used = set(seqs[0].block_table) | set(seqs[1].block_table)
    assert len(used) == len(seqs[0].block_table) + len(seqs[1].block_table)  # no block held twice
    for seq in seqs:
        runner.free(seq)
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks


def test_a_full_pool_is_refused_and_nothing_changes(model):
    runner = PagedModelRunner(model, num_blocks=2, block_size=4)
    seq = Sequence("long", list(range(100, 109)))  # 9 tokens: 3 blocks
    with pytest.raises(MemoryError, match="blocks"):
        runner.forward(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and runner.block_manager.num_free_blocks == 2
    short = Sequence("short", list(range(100, 107)))  # 7 tokens: 2 blocks; the 9th token needs a third
    runner.forward(short)
    short.append_token_id(1)
    runner.forward(short)
    short.append_token_id(2)
    with pytest.raises(MemoryError):
        runner.forward(short)
    assert short.num_computed_tokens == 8 and len(short.block_table) == 2
