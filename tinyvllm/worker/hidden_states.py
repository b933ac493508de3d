"""What a request takes from every position of its prompt, not only the last one: a pooling request's pooled
hidden state (vLLM's pooler), and the prompt's logprobs (`SamplingParams.prompt_logprobs`). docs/phases/09.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tinyvllm.sample.sampler import logprobs_of
from tinyvllm.worker.input_batch import CachedRequestState


def record_hidden_states(state: CachedRequestState, hidden: np.ndarray,
                         position_logits: Callable[[], np.ndarray]) -> list | None:
    """Take this step's final hidden states of the request's tokens, hidden (count, D), before the scheduler counts
    them as computed."""
    seq = state.seq
    start = seq.num_computed_tokens  # the step's first position
    if seq.pooling_params is not None:
        in_prompt = hidden[:max(seq.num_prompt_tokens - start, 0)].astype(np.float64)
        state.hidden_sum = (0 if start == 0 else state.hidden_sum) + in_prompt.sum(axis=0)
        if len(in_prompt):
            state.hidden_last = in_prompt[-1]
        return None
    first_call = state.prompt_logprobs is None
    if first_call:  # the first token: nothing comes before it to predict it
        state.prompt_logprobs = [None]
    recorded = state.prompt_logprobs
    assert start + 1 <= len(recorded), f"prompt logprobs of {seq.seq_id}: position {start + 1} follows a gap"
    # row j predicts position start + j + 1; positions recorded before (a recompute after a preemption) are skipped
    positions = range(max(start + 1, len(recorded)), min(start + hidden.shape[0] + 1, seq.num_prompt_tokens))
    new = []
    if len(positions):
        logits = position_logits()  # (count, V)
        k = seq.sampling_params.prompt_logprobs
        k = logits.shape[-1] if k == -1 else k  # -1: the whole vocabulary
        new = [logprobs_of(logits[p - start - 1], seq.prompt_token_ids[p], k) for p in positions]
        recorded += new
    return ([None] if first_call else []) + new or None


def pooled(state: CachedRequestState) -> np.ndarray:
    """A pooling request's vector once its prompt is all computed: the MEAN or LAST of its final hidden states,
    scaled to unit length when asked (as torch's F.normalize: no division by 0)."""
    seq, pooling = state.seq, state.seq.pooling_params
    vector = state.hidden_sum / seq.num_prompt_tokens if pooling.pooling_type == "MEAN" else state.hidden_last
    vector = vector.astype(np.float64)
    if pooling.normalize:
        vector = vector / max(np.linalg.norm(vector), 1e-12)
    return vector
