"""Sequence and SequenceStatus: derived properties through a request's life, with no device."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.sampling_params import SamplingParams


def test_finished_statuses_and_openai_finish_reasons():
    for status in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.PREEMPTED):
        assert not status.is_finished
        assert status.finish_reason is None
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert SequenceStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert all(s.is_finished for s in SequenceStatus if s.name.startswith("FINISHED_"))


def test_new_sequence():
    params = SamplingParams(max_tokens=4)
    seq = Sequence(7, [5, 6, 7], params, arrival_time=1.5, prompt="hi")
    assert (seq.seq_id, seq.prompt, seq.arrival_time, seq.sampling_params) == (7, "hi", 1.5, params)
    assert seq.status == SequenceStatus.WAITING and not seq.is_finished
    assert seq.all_token_ids == [5, 6, 7]
    assert (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_tokens) == (3, 0, 3)
    assert seq.last_token_id == 7
    assert seq.num_computed_tokens == 0 and seq.block_table == []
    assert seq.is_prefill and seq.num_uncomputed_tokens == 3


def test_defaults_and_the_prompt_is_copied():
    prompt = [1, 2]
    seq = Sequence(0, prompt)
    prompt.append(3)
    assert seq.prompt_token_ids == [1, 2]
    assert isinstance(seq.sampling_params, SamplingParams)
    assert seq.arrival_time > 0 and seq.prompt is None


def test_empty_prompt_is_a_value_error():
    with pytest.raises(ValueError, match="at least one token"):
        Sequence(0, [])


def test_life_of_a_sequence_chunked_prefill_decode_preempt_recompute():
    seq = Sequence(0, [10, 11, 12, 13, 14])
    # chunked prefill: 3 tokens, then 2; only the step that reaches the last token samples
    seq.num_computed_tokens += 3
    assert seq.is_prefill and seq.num_uncomputed_tokens == 2
    seq.num_computed_tokens += 2
    seq.append_token_id(20)
    assert not seq.is_prefill and seq.num_uncomputed_tokens == 1  # a decode: compute token 20
    assert seq.last_token_id == 20 and seq.all_token_ids == [10, 11, 12, 13, 14, 20]
    seq.num_computed_tokens += 1
    seq.append_token_id(21)
    assert (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_tokens) == (5, 2, 7)
    assert not seq.is_prefill
    # preemption by recompute: all 7 tokens, prompt and output, must be computed again
    seq.num_computed_tokens = 0
    seq.status = SequenceStatus.PREEMPTED
    assert seq.is_prefill and seq.num_uncomputed_tokens == 7
    seq.num_computed_tokens = 5  # past the prompt, but still not caught up: still a prefill
    assert seq.is_prefill
    seq.num_computed_tokens = 6
    assert not seq.is_prefill


def test_one_token_prompt_is_a_prefill_until_it_samples():
    seq = Sequence(0, [1])
    assert seq.is_prefill and seq.num_uncomputed_tokens == 1
    seq.num_computed_tokens = 1
    seq.append_token_id(2)
    assert not seq.is_prefill


@given(num_tokens=st.integers(1, 300), block_size=st.sampled_from([1, 2, 8, 16, 32]))
def test_num_blocks_is_ceil_of_tokens_over_block_size(num_tokens, block_size):
    seq = Sequence(0, list(range(num_tokens)))
    n = seq.num_blocks(block_size)
    assert (n - 1) * block_size < num_tokens <= n * block_size  # enough, and waste under one block


def test_repr_names_the_state():
    text = repr(Sequence(3, [1, 2]))
    assert "seq_id=3" in text and "WAITING" in text and "num_tokens=2" in text
