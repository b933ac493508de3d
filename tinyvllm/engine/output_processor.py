"""From the engine core's token ids to what a user sees (vLLM v1's `OutputProcessor`, v1/engine/output_processor.py).

    EngineCoreOutput("r", new_token_ids=[42])  --RequestState: detokenize, stop strings, logprobs, timings-->
        RequestOutput("r", outputs=[CompletionOutput(text="... Paris", token_ids=[..., 42])])
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.core.outputs import EngineCoreOutput
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sample.sampling_batch import failure_message
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger("tinyvllm.engine")


@dataclass
class RequestState:
    """One request the core runs (one completion: n > 1 is fanned out above, engine/parent_request.py), and what the
    user sees of it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextStream
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # SamplingParams.prompt_logprobs, per prompt token so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it finished with "error"
    num_cached_tokens: int = 0

    def add_tokens(self, out: EngineCoreOutput, stop_token_ids: list[int]) -> bool:
        """Take a step's new tokens: their text (a stop token's is not shown) and stop strings, their logprobs.
        Returns True when a stop string ended the request here (the core must abort it)."""
        for j, token in enumerate(out.new_token_ids):
            self.output_token_ids.append(token)
            if out.new_logprobs is not None:
                self.logprobs.append(_logprobs_entry(out.new_logprobs[j], token))
            last = j == len(out.new_token_ids) - 1
            if last and out.finish_reason == "stop" and token in self.params.all_stop_token_ids(stop_token_ids):
                self.stop_reason = out.stop_reason  # a stop token: its text is not shown
                continue
            _, stopped = self.text.add(token)
            if stopped:
                self.finish_reason, self.stop_reason = "stop", self.text.stop_str
                return out.finish_reason is None
        self.finish_reason = out.finish_reason
        return False

    def output(self) -> RequestOutput:
        finished = self.finish_reason is not None
        if finished and self.text.stop_str is None:
            self.text.finish()  # release text held back for a stop string that never came
        completion = CompletionOutput(index=0, text=self.text.text, token_ids=list(self.output_token_ids),
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                      logprobs=list(self.logprobs) if self.params.logprobs is not None else None)
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids):
            prompt_logprobs = list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], finished=finished,
                             metrics=self.metrics, error=self.error, num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    def pooled_output(self, vector: np.ndarray) -> RequestOutput:
        """A pooling request's one output: its pooled vector (tinyvllm/pooling_params.py), no completion."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [], finished=True,
                             metrics=self.metrics, num_cached_tokens=0, pooled=vector.tolist())


def _logprobs_entry(entry, token: int):
    """A sampled token's logprobs as a user sees them: (its logprob, the top alternatives); logprobs=-1 sends the
    whole row, (V,), whose every token is then an alternative."""
    if not isinstance(entry, np.ndarray):
        return entry
    order = np.argsort(-entry, kind="stable")
    return float(entry[token]), [(int(t), float(entry[t])) for t in order]


class OutputProcessor:
    """The RequestStates of the requests in the core, by id; `process_outputs` after every step."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, TextStream(self.tokenizer, params, prompt_token_ids),
            RequestMetrics(arrival_time))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(the RequestOutputs of this step, the requests the core must abort: a stop string or a failure here)."""
        now, request_outputs, reqs_to_abort = time.monotonic(), [], []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            state.metrics.first_scheduled_time = state.metrics.first_scheduled_time or out.first_scheduled_time
            state.metrics.num_preemptions = max(state.metrics.num_preemptions, out.num_preemptions)
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs:
                state.prompt_logprobs += out.new_prompt_logprobs
            if out.pooling_output is not None:
                state.metrics.first_token_time = state.metrics.finished_time = now
                del self.request_states[out.request_id]
                request_outputs.append(state.pooled_output(out.pooling_output))
                continue
            if out.error is not None:
                state.finish_reason, state.error = "error", out.error
            elif out.new_token_ids or out.finished:
                state.metrics.first_token_time = state.metrics.first_token_time or now
                try:
                    if state.add_tokens(out, self.tokenizer.stop_token_ids):
                        reqs_to_abort.append(out.request_id)
                except Exception as e:  # detokenizing or a stop string failed: this request alone ends
                    logger.exception("request %s failed in the engine step; the other requests go on",
                                     out.request_id, exc_info=e)
                    state.finish_reason, state.error = "error", failure_message(e)
                    if not out.finished:
                        reqs_to_abort.append(out.request_id)
            else:
                continue  # prompt logprobs of a chunk: nothing to show yet
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
            request_outputs.append(state.output())
        return request_outputs, reqs_to_abort
