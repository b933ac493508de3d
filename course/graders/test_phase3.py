"""Phase 3's graders: the scheduler's admission (token budget, max_num_seqs, chunked prefill), preemption by
recompute, and the stop rules (course/phase3/). Plain Python through `Scheduler.schedule()` and
`update_from_output()`, no device."""

from __future__ import annotations

import pytest

from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.sampling_params import SamplingParams

EOS = 0


def scheduler(num_blocks=64, block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32):
    return Scheduler(num_blocks, block_size, max_model_len, max_num_seqs, max_num_batched_tokens, eos_token_ids=[EOS])


def add(sched: Scheduler, seq_id, prompt_len: int, **params) -> Sequence:
    seq = Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(**{"max_tokens": 100, **params}))
    sched.add_seq(seq)
    return seq


def step(sched: Scheduler, token: int = 7):
    """One step: schedule, then every sequence that samples gets `token`."""
    out = sched.schedule()
    sampled = {seq.seq_id: [token] for seq in out.scheduled_seqs if out.samples(seq)}
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


# ---- admit_waiting ----

@pytest.mark.task("admit_waiting")
def test_admission_fills_the_budget_in_order():
    sched = scheduler(max_num_batched_tokens=32)
    a, b = add(sched, "a", 10), add(sched, "b", 12)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled_seqs] == ["a", "b"], (
        f"two short prompts fit the budget of 32: both admitted, in arrival order; got "
        f"{[s.seq_id for s in out.scheduled_seqs]}")
    assert out.num_scheduled_tokens == {"a": 10, "b": 12}, f"each gets its whole prompt, got {out.num_scheduled_tokens}"
    assert a.status == b.status == SequenceStatus.RUNNING and list(sched.running) == [a, b]


@pytest.mark.task("admit_waiting")
def test_a_long_prompt_is_chunked():
    sched = scheduler(max_num_batched_tokens=16)
    seq = add(sched, "long", 40)
    chunks = [step(sched).num_scheduled_tokens.get("long") for _ in range(3)]
    assert chunks == [16, 16, 8], (
        f"a 40-token prompt with a budget of 16 per step should be computed in chunks 16, 16, 8 (chunked prefill); "
        f"got {chunks}")
    assert seq.num_output_tokens == 1, "the token is sampled only after the last chunk"


@pytest.mark.task("admit_waiting")
def test_the_budget_is_shared_and_the_rest_waits():
    sched = scheduler(max_num_batched_tokens=16)
    add(sched, "a", 10)
    add(sched, "b", 10)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}, (
        f"a takes 10 of the 16, b gets the 6 left (its first chunk); got {out.num_scheduled_tokens}")


@pytest.mark.task("admit_waiting")
def test_max_num_seqs_caps_the_running():
    sched = scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        add(sched, i, 4)
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled_seqs] == [0, 1] and [s.seq_id for s in sched.waiting] == [2], (
        f"max_num_seqs=2: two admitted, the third waits; scheduled {[s.seq_id for s in out.scheduled_seqs]}")


@pytest.mark.task("admit_waiting")
def test_the_head_without_blocks_blocks_the_queue():
    sched = scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=64)
    add(sched, "a", 20)  # 5 blocks
    add(sched, "big", 16)  # 4 blocks: only 3 left
    add(sched, "small", 2)  # 1 block would fit, but must not jump the queue
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled_seqs] == ["a"], (
        f"'big' needs 4 blocks and 3 are free: it waits, and 'small' behind it waits too (no skipping ahead); got "
        f"{[s.seq_id for s in out.scheduled_seqs]}")


# ---- preempt ----

def full_cache() -> tuple[Scheduler, Sequence, Sequence]:
    """Two sequences that fill a 4-block pool: the next step must preempt the newer one."""
    sched = scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=32)
    old, new = add(sched, "old", 8), add(sched, "new", 7)
    step(sched)  # both prefilled: old has 9 tokens (3 blocks needed next), new 8 (2 blocks, both full)
    return sched, old, new


@pytest.mark.task("preempt")
def test_preemption_frees_the_newest():
    sched, old, new = full_cache()
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted_seqs] == ["new"], (
        f"out of blocks: the newest running sequence is preempted; preempted {[s.seq_id for s in out.preempted_seqs]}")
    assert new.status == SequenceStatus.PREEMPTED, f"a preempted sequence is PREEMPTED, got {new.status.name}"
    assert new.block_table == [], f"a preempted sequence gives its blocks back, still holds {new.block_table}"
    assert new.num_computed_tokens == 0, (
        f"preemption by recompute forgets the K/V: num_computed_tokens should be 0, got {new.num_computed_tokens}")
    assert sched.num_preemptions == 1, f"num_preemptions should count it: {sched.num_preemptions}"


@pytest.mark.task("preempt")
def test_the_preempted_goes_back_first_and_recomputes():
    sched, old, new = full_cache()
    sched.add_seq(late := Sequence("late", [1, 2], SamplingParams(max_tokens=4)))
    sched.schedule()
    assert list(sched.waiting)[:1] == [new], (
        f"a preempted sequence waits at the head of the queue, ahead of later arrivals; waiting = "
        f"{[s.seq_id for s in sched.waiting]}")
    sched.finish_seq("old", SequenceStatus.FINISHED_ABORTED)  # blocks come free
    out = sched.schedule()
    assert out.scheduled_seqs[0] is new and out.num_scheduled_tokens["new"] == new.num_tokens, (
        f"readmitted, it recomputes all its {new.num_tokens} tokens (prompt and output) in one prefill; got "
        f"{out.num_scheduled_tokens}")
    assert late.status == SequenceStatus.RUNNING


# ---- check_stop ----

def one_token(params: dict, token: int, prompt_len: int = 4, max_model_len: int = 64) -> Sequence:
    """A sequence after its prompt's step sampled `token`."""
    sched = scheduler(max_model_len=max_model_len)
    seq = add(sched, 0, prompt_len, **params)
    step(sched, token)
    return seq


@pytest.mark.task("check_stop")
def test_eos_stops():
    seq = one_token({}, EOS)
    assert seq.status == SequenceStatus.FINISHED_STOPPED, f"the model's EOS stops a sequence, got {seq.status.name}"
    seq = one_token({"ignore_eos": True}, EOS)
    assert not seq.is_finished, "ignore_eos=True: EOS is an ordinary token"


@pytest.mark.task("check_stop")
def test_min_tokens_holds_eos_back():
    seq = one_token({"min_tokens": 2}, EOS)
    assert not seq.is_finished, "min_tokens=2: EOS as the first output token must not stop"


@pytest.mark.task("check_stop")
def test_a_stop_token_is_the_stop_reason():
    seq = one_token({"stop_token_ids": [7]}, 7)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 7, (
        f"a token of stop_token_ids stops with stop_reason = that token; got {seq.status.name}, {seq.stop_reason}")


@pytest.mark.task("check_stop")
def test_max_tokens_caps_the_length():
    seq = one_token({"max_tokens": 1}, 7)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED, (
        f"max_tokens=1 and one token out: FINISHED_LENGTH_CAPPED, got {seq.status.name}")
    seq = one_token({}, 7)
    assert seq.status == SequenceStatus.RUNNING, f"an ordinary token goes on, got {seq.status.name}"


@pytest.mark.task("check_stop")
def test_a_full_context_caps_the_length():
    seq = one_token({}, 7, prompt_len=15, max_model_len=16)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED, (
        f"15 prompt tokens + 1 = max_model_len 16: the context is full, FINISHED_LENGTH_CAPPED; got {seq.status.name}")
