"""What a request takes from every prompt position (tinyvllm/worker/hidden_states.py), on the runner's per-request
state (worker/input_batch.py): a pooling request's pool, built chunk by chunk and begun again after a preemption,
and its MEAN or LAST vector."""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.core.sequence import Sequence
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.hidden_states import pooled, record_hidden_states
from tinyvllm.worker.input_batch import CachedRequestState

HIDDEN = np.arange(10, dtype=np.float32).reshape(5, 2) + 1  # five prompt positions, D = 2


def no_logits():
    raise AssertionError("a pooling request needs no logits")


def pool_in_chunks(pooling: PoolingParams, chunks: list[int]) -> CachedRequestState:
    seq = Sequence("p", [11, 12, 13, 14, 15], SamplingParams(max_tokens=1), pooling_params=pooling)
    state = CachedRequestState(seq, generator=None)
    assert state.needs_hidden_states
    start = 0
    for size in chunks:
        seq.num_computed_tokens = start
        assert record_hidden_states(state, HIDDEN[start:start + size], no_logits) is None
        start += size
    return state


@pytest.mark.parametrize("chunks", [[5], [2, 3], [1, 1, 3]])
def test_mean_pooling_is_the_same_whatever_the_chunks(chunks):
    state = pool_in_chunks(PoolingParams("MEAN", normalize=False), chunks)
    np.testing.assert_allclose(pooled(state), HIDDEN.mean(axis=0))


def test_last_pooling_normalized_and_a_recompute_begins_again():
    state = pool_in_chunks(PoolingParams("LAST", normalize=True), [3, 2])
    np.testing.assert_allclose(pooled(state), HIDDEN[-1] / np.linalg.norm(HIDDEN[-1]))
    state.seq.num_computed_tokens = 0  # preempted and computed again from its start: the pool starts over
    record_hidden_states(state, HIDDEN * 0 + 1, no_logits)
    state.seq.num_computed_tokens = 5
    assert pooled(state).tolist() == pytest.approx([2**-0.5, 2**-0.5])


def test_a_plain_request_needs_no_hidden_states():
    state = CachedRequestState(Sequence("s", [1, 2, 3], SamplingParams()), generator=None)
    assert not state.needs_hidden_states and state.params.max_tokens == SamplingParams().max_tokens
