"""What the engine returns per request, shaped like vLLM's `vllm.outputs`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # per token: (its logprob, [(token_id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float | None = None  # set by beam search

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic()
    first_scheduled_time: float | None = None  # the queue time ends, the prefill starts
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times its KV blocks were freed to make room, to be recomputed

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # this request failed inside a step (the others went on)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # per prompt token, as `CompletionOutput.logprobs` (None for the first); once the whole prompt is computed
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    pooled: list[float] | None = None  # a pooling request's pooled hidden state (hidden_size,); outputs empty
