"""What the engine knows of one request beyond its Sequence: its text, its generator and grammar, its logprobs and
timings, and the outputs the user sees (vLLM v1 keeps the same in its output processor's `RequestState`,
vllm/v1/engine/output_processor.py).

After every step, each request with new tokens turns them into text (`add_new_tokens`: detokenization and stop
strings, which the scheduler cannot see), then into a cumulative `RequestOutput` (`output`). A request that needs
every position's output, not only the last (`needs_hidden_states`: a pooling request, or prompt logprobs), takes
it from the step's final hidden states (`record_hidden_states`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sample.sampler import logprobs_of
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.pooling_params import PoolingParams  # a pooling request's (Phase 9)


@dataclass
class RequestState:
    """One request the scheduler runs (one completion: n > 1 is fanned out above, see parent_request.py),
    and what the user sees of it."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    seq: Sequence  # seq.seq_id == request_id
    text: TextStream
    generator: np.random.Generator | None  # None when greedy
    matcher: object | None = None  # llguidance's LLMatcher when the output follows a grammar (structured outputs)
    logprobs: list = field(default_factory=list)
    stop_reason: str | int | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    error: str | None = None  # why the engine finished it with FINISHED_ERROR
    pooling: PoolingParams | None = None  # a pooling request: a prefill that samples nothing
    hidden_sum: np.ndarray | None = None  # MEAN pooling: the sum of the prompt's final hidden states so far
    hidden_last: np.ndarray | None = None  # LAST pooling: the last computed token's
    prompt_logprobs: list = field(default_factory=list)  # SamplingParams.prompt_logprobs: per prompt token so far

    @property
    def needs_hidden_states(self) -> bool:
        """Whether its next step needs every position's output, not only the last one's."""
        return self.pooling is not None or (self.params.prompt_logprobs is not None
                                            and self.seq.num_computed_tokens < self.seq.num_prompt_tokens)

    # ---- what a step computed ----

    def record_hidden_states(self, hidden: np.ndarray, position_logits: Callable[[int | str], np.ndarray]) -> None:
        """What it takes from this step's final hidden states of its tokens, hidden (count, D): a pooling request
        adds them to its pool, a request with prompt_logprobs the logprobs of its prompt tokens (from
        `position_logits(seq_id)`, the runner's). A sequence computed again from its start (preempted) starts
        over. Call it before the scheduler counts the step's tokens as computed."""
        seq = self.seq
        start = seq.num_computed_tokens  # the step's first position
        if self.pooling is not None:
            in_prompt = hidden[:max(seq.num_prompt_tokens - start, 0)].astype(np.float64)
            self.hidden_sum = (0 if start == 0 else self.hidden_sum) + in_prompt.sum(axis=0)
            if len(in_prompt):
                self.hidden_last = in_prompt[-1]
        elif len(self.prompt_logprobs) < seq.num_prompt_tokens:
            self._record_prompt_logprobs(start, hidden.shape[0], position_logits)

    def _record_prompt_logprobs(self, start: int, count: int,
                                position_logits: Callable[[int | str], np.ndarray]) -> None:
        """The logprob of each prompt token at positions start+1 .. start+count given the tokens before it, with
        the `prompt_logprobs` most likely alternatives (raw logprobs, as the sampled tokens' are)."""
        seq, k = self.seq, self.params.prompt_logprobs
        if start == 0:
            self.prompt_logprobs = [None]  # the first token: nothing comes before it to predict it
        if len(self.prompt_logprobs) != start + 1:
            return  # recomputed after a preemption: these positions are already recorded
        logits = position_logits(seq.seq_id)  # (count, V)
        for j in range(count):
            position = start + j + 1  # the token row j predicts
            if position >= seq.num_prompt_tokens:
                break
            self.prompt_logprobs.append(logprobs_of(logits[j], seq.prompt_token_ids[position], k))

    def add_new_tokens(self, now: float, stop_token_ids: list[int], finish_seq: Callable[[str, SequenceStatus], None],
                       spec_start: int | None = None) -> None:
        """The new token's text, stop strings (the scheduler checked stop tokens and lengths), timings.
        `spec_start`: where its output stood before a verify step emitted several tokens (they are read one by
        one). `finish_seq(seq_id, status)`: the scheduler's, for a stop string found in the text."""
        seq = self.seq
        self.metrics.first_token_time = self.metrics.first_token_time or now
        if spec_start is not None and self._add_spec_tokens(spec_start, now, finish_seq):
            return
        token = seq.last_token_id
        if seq.status == SequenceStatus.FINISHED_STOPPED and token in self.params.all_stop_token_ids(stop_token_ids):
            self.stop_reason = token if token in self.params.stop_token_ids else None
        else:
            _, stopped = self.text.add(token)
            if stopped:
                finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                self.stop_reason = self.text.stop_str
        if seq.is_finished:
            if self.text.stop_str is None:
                self.text.finish()  # release text held back for a stop string that never came
            self.metrics.finished_time = now

    def _add_spec_tokens(self, start: int, now: float, finish_seq: Callable[[str, SequenceStatus], None]) -> bool:
        """The text of the tokens a verify step emitted before its last one, each in turn as plain decoding would
        see them. A stop string in one of them ends the request there: the tokens after it are dropped (they were
        never produced, as far as the user can tell). Returns True if it ended; the last token is then done."""
        seq = self.seq
        for j in range(start, seq.num_output_tokens - 1):
            _, stopped = self.text.add(seq.output_token_ids[j])
            if not stopped:
                continue
            if seq.is_finished:  # the scheduler ended it at a later token (stop token, length): the string comes first
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
            del seq.output_token_ids[j + 1:]
            self.stop_reason = self.text.stop_str
            self.metrics.finished_time = now
            return True
        return False

    # ---- what the user sees ----

    def pooled_output(self, now: float) -> RequestOutput:
        """A pooling request's one output, when its prompt is all computed (`now`): its pooled vector (see
        tinyvllm/pooling_params.py)."""
        seq = self.seq
        self.metrics.first_token_time = self.metrics.finished_time = now
        if self.pooling.pooling_type == "MEAN":
            vector = self.hidden_sum / seq.num_prompt_tokens
        else:
            vector = self.hidden_last
        vector = vector.astype(np.float64)
        if self.pooling.normalize:
            vector = vector / max(np.linalg.norm(vector), 1e-12)  # as torch's F.normalize: no division by 0
        return RequestOutput(self.request_id, self.prompt, seq.prompt_token_ids, [], finished=True,
                             metrics=self.metrics, num_cached_tokens=0, pooled=vector.tolist())

    def output(self) -> RequestOutput:
        seq = self.seq
        completion = CompletionOutput(index=0, text=self.text.text, token_ids=list(seq.output_token_ids),
                                      finish_reason=seq.status.finish_reason, stop_reason=self.stop_reason,
                                      logprobs=list(self.logprobs) if self.params.logprobs is not None else None)
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and len(self.prompt_logprobs) == seq.num_prompt_tokens:
            prompt_logprobs = list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.is_finished, metrics=self.metrics, error=self.error,
                             num_cached_tokens=max(seq.num_cached_tokens, 0), prompt_logprobs=prompt_logprobs)
