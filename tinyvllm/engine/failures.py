"""A failure ends the request that caused it, not the batch (vLLM aborts the offending request, not its step).

    step [a b c d] fails  ->  [a] ok   [b] ok   [c] fails again: c ends with the error   [d] ok
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.sample.sampling_batch import failure_message

logger = logging.getLogger("tinyvllm.engine")


def retry_in_parts(scheduler_output: SchedulerOutput, error: Exception,
                   execute_model: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
    """Run a failed step again one sequence at a time; a sequence that fails again alone is `failed` with its
    error. Returns what the step would have returned, merged from its parts."""
    logger.error("the engine step failed (%s: %s); retrying its %d sequences one at a time",
                 type(error).__name__, error, len(scheduler_output.scheduled_seqs))
    merged = ModelRunnerOutput()
    for seq in scheduler_output.scheduled_seqs:
        part = SchedulerOutput([seq], {seq.seq_id: scheduler_output.num_scheduled_tokens[seq.seq_id]})
        if seq.seq_id in scheduler_output.scheduled_spec_decode_tokens:
            part.scheduled_spec_decode_tokens[seq.seq_id] = scheduler_output.scheduled_spec_decode_tokens[seq.seq_id]
        try:
            output = execute_model(part)
        except Exception as part_error:
            logger.exception("request %s failed in the engine step; the other requests go on", seq.seq_id,
                             exc_info=part_error)
            merged.failed[seq.seq_id] = failure_message(part_error)
            continue
        for name in ("sampled_token_ids", "logprobs", "prompt_logprobs", "pooler_output", "failed"):
            getattr(merged, name).update(getattr(output, name))
    return merged
