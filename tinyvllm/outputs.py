"""What the engine returns per request, shaped like vLLM's `vllm.outputs` so vLLM users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" (OpenAI's names), None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    # per generated token: (logprob of the sampled token, [(token_id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float | None = None  # of its tokens (vLLM's field); set by beam search

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None  # when a step first ran it: the queue time ends, the prefill starts
    first_token_time: float | None = None
    finished_time: float | None = None

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
    error: str | None = None  # set when this request failed inside a step (the other requests went on)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (vLLM's field)
    # SamplingParams.prompt_logprobs: per prompt token, as `CompletionOutput.logprobs` (None for the first, which
    # nothing predicts); filled once the whole prompt is computed
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # a pooling request (PoolingParams): the prompt's pooled hidden state, (hidden_size,) floats (vLLM's
    # PoolingOutput.data); outputs is then empty
    pooled: list[float] | None = None
