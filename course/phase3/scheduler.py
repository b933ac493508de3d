"""Phase 3, tasks admit_waiting, preempt and check_stop: the scheduler's step plan, its way out of a full cache, and
when a sequence is done.

The engine calls them as `Scheduler._admit_waiting`, `Scheduler._preempt` and `Scheduler._check_stop`
(tinyvllm/core/scheduler.py, from `schedule()` and `update_from_output()`). Each is written here as a function of
`self`, the Scheduler; it may use:

    self.waiting, self.running (deques of Sequence), self.max_num_seqs, self.max_model_len, self.eos_token_ids
    self.block_manager (.allocate(seq) -> block table or None, .free(seq)), self.num_preemptions
    self._start_running(seq): an admitted sequence joins the running queue (status RUNNING, first-admission records)
    self._enqueue(seq, front=True): back into the waiting queue (at its head under fcfs)
    seq.num_uncomputed_tokens, seq.num_computed_tokens, seq.spec_token_ids, seq.status, seq.seq_id
    SequenceStatus: WAITING, RUNNING, PREEMPTED, FINISHED_STOPPED, FINISHED_LENGTH_CAPPED (tinyvllm.core.sequence)

Chapter: docs/phases/03-continuous-batching.md (sections 4-6, "Build it"). Grade: make course P=3
"""

from __future__ import annotations

from tinyvllm.core.sequence import SequenceStatus  # noqa: F401  (for your code)


def admit_waiting(self, token_budget: int, scheduled: list, num_scheduled_tokens: dict) -> int:
    """Admit sequences from the head of self.waiting, in order, while token_budget > 0 and fewer than
    self.max_num_seqs sequences run. For the head: ask the block manager for its blocks (allocate); if it says
    None, stop (the head waits; never skip ahead of it, or a long prompt could wait forever). Otherwise pop it from
    the waiting queue, self._start_running(seq), and schedule min(seq.num_uncomputed_tokens, token_budget) of its
    tokens: a prompt longer than the budget left is cut (chunked prefill; its next chunk comes next step). Record
    it: scheduled.append(seq), num_scheduled_tokens[seq.seq_id] = n, and spend n of the budget.
    Returns the budget left.
    """
    raise NotImplementedError("course/phase3/scheduler.py: admit_waiting is yours to write")


def preempt(self, seq) -> None:
    """Preemption by recompute: `seq` (already removed from self.running) gives all its blocks back, forgets what
    was computed (num_computed_tokens = 0, and any draft tokens: spec_token_ids = []), counts in
    self.num_preemptions, becomes PREEMPTED and goes back to the waiting queue at the front
    (self._enqueue(seq, front=True)): readmitted first, it recomputes its prompt and output in one prefill.
    """
    raise NotImplementedError("course/phase3/scheduler.py: preempt is yours to write")


def check_stop(self, seq):
    """After a token was appended to `seq`: the status it finishes with, or None to go on. In this order:

    1. FINISHED_STOPPED if it has at least params.min_tokens output tokens and its last token is in
       params.all_stop_token_ids(self.eos_token_ids) (the model's EOS tokens unless ignore_eos, plus
       stop_token_ids); a token from params.stop_token_ids is also recorded: seq.stop_reason = that token.
    2. FINISHED_LENGTH_CAPPED if params.max_tokens is not None and it has max_tokens output tokens.
    3. FINISHED_LENGTH_CAPPED if it has self.max_model_len tokens in all (the context is full).

    params is seq.sampling_params; seq.num_output_tokens, seq.num_tokens, seq.last_token_id.
    """
    raise NotImplementedError("course/phase3/scheduler.py: check_stop is yours to write")
