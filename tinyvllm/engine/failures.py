"""A failure ends the request that caused it, not the batch (vLLM aborts the offending request, not its step).

Most failures belong to one request and are caught where they happen (its sampling parameters, its grammar, its
text): `fail` ends it alone, with FINISHED_ERROR and its blocks freed, and step() reports its output. What is left
fails the whole step: the forward pass (say an index past a buffer, a kernel refusing a shape) or the batch's
sampling graph. Then the step runs again, part by part, a part being one sequence and the completions forked
from it this step (`retry_in_parts`):

    step [a b c d] fails  ->  [a] ok   [b] ok   [c] fails again: c ends with the error   [d] ok

The parts that fail again caused it; the others get their tokens as if nothing had happened: a part recomputes
the same K/V, and each random generator restarts from its state before the step (`generator_states`), so a
seeded request draws the same numbers. vLLM aborts every request a failed step held; retrying costs one forward
pass per part, once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tinyvllm.core.scheduler import Scheduler, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.outputs import RequestOutput

logger = logging.getLogger("tinyvllm.engine")


def generator_states(scheduler_output: SchedulerOutput, requests: dict) -> dict[int | str, dict]:
    """The state of each scheduled sampled request's random generator (`requests`: seq_id -> the engine's
    RequestState), taken before the step, so that a step retried in parts draws the same numbers as the step
    that failed would have (seeded outputs stay reproducible)."""
    states = {}
    for seq in scheduler_output.scheduled_seqs:
        state = requests.get(seq.seq_id)
        if state is not None and state.generator is not None:
            states[seq.seq_id] = state.generator.bit_generator.state
    return states


class RequestFailures:
    """Ends failed requests for an engine: `requests` (its RequestStates by seq_id), its scheduler and its beam
    searches. `outputs`: the requests finished with an error since step() last reported them."""

    def __init__(self, requests: dict, scheduler: Scheduler, beam_search):
        self.requests, self.scheduler, self.beam_search = requests, scheduler, beam_search
        self.outputs: list[RequestOutput] = []

    def fail(self, seq: Sequence, error: Exception) -> None:
        """Finish one request with an error (its blocks are freed) and leave the rest of the step alone."""
        logger.exception("request %s failed in the engine step; the other requests go on", seq.seq_id,
                         exc_info=error)
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        if self.beam_search.owns(seq.seq_id):  # a beam: its whole beam search ends
            self.outputs.append(self.beam_search.fail(seq.seq_id, message))
            return
        state = self.requests.pop(seq.seq_id)
        state.error = message
        self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_ERROR)
        state.metrics.finished_time = time.monotonic()
        self.outputs.append(state.output())

    def fail_unschedulable(self, scheduler_output: SchedulerOutput) -> None:
        """Nothing was scheduled, nothing runs and nothing was preempted: no block will come free, so the head
        of the waiting queue can never be admitted. It ends with an error instead of waiting forever (the
        pool can only be that short when blocks leaked, or a test took them: tinyvllm/engine/fault_injection.py)."""
        scheduler = self.scheduler
        if scheduler_output.preempted_seqs or scheduler.running or not scheduler.waiting:
            return
        seq, bm = scheduler.waiting[0], scheduler.block_manager
        self.fail(seq, RuntimeError(
            f"out of KV cache blocks: the request needs {seq.num_blocks(bm.block_size)} blocks, {bm.num_free_blocks} "
            f"of the {bm.num_blocks} are free and no running request will give any back"))

    def retry_in_parts(self, scheduler_output: SchedulerOutput, rng_states: dict[int | str, dict], error: Exception,
                       run: Callable[[SchedulerOutput], dict]) -> dict[int | str, int]:
        """Run the failed step again one part at a time with `run` (the engine's forward pass and sampling of a
        SchedulerOutput), each generator reset to its state in `rng_states` first; the requests of a part that
        fails again end with its error. Returns the tokens the other parts sampled, as the step would have."""
        logger.error("the engine step failed (%s: %s); retrying its %d sequences one at a time",
                     type(error).__name__, error, len(scheduler_output.scheduled_seqs))
        parts: dict[int | str, list[Sequence]] = {}
        for seq in scheduler_output.scheduled_seqs:  # a forked sequence samples its source's row: same part
            parts.setdefault(scheduler_output.forked_from.get(seq.seq_id, seq.seq_id), []).append(seq)
        sampled: dict[int | str, int] = {}
        blocks_to_copy = scheduler_output.blocks_to_copy  # copied once, by the first part, before any write
        for part in parts.values():
            part = [seq for seq in part if not seq.is_finished]  # a beam search failed by an earlier part ended
            if not part:
                continue
            ids = {seq.seq_id for seq in part}
            sub = SchedulerOutput(part, {i: scheduler_output.num_scheduled_tokens[i] for i in ids}, [], blocks_to_copy,
                                  {i: src for i, src in scheduler_output.forked_from.items() if i in ids},
                                  {i: d for i, d in scheduler_output.scheduled_spec_decode_tokens.items() if i in ids})
            blocks_to_copy = []
            for seq_id in ids & rng_states.keys():
                self.requests[seq_id].generator.bit_generator.state = rng_states[seq_id]
            try:
                sampled.update(run(sub))
            except Exception as part_error:
                for seq in part:
                    if not seq.is_finished:
                        self.fail(seq, part_error)
        return sampled
