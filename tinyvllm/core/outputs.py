"""What crosses the boundaries of one step, as plain data (vLLM v1's names, `vllm/v1/outputs.py`):

    Scheduler.schedule() --SchedulerOutput--> ModelRunner.execute_model() --ModelRunnerOutput-->
        Scheduler.update_from_output() --list[EngineCoreOutput]--> OutputProcessor (text, RequestOutputs)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# one token's logprobs: (logprob of the token, [(token_id, logprob), ...] the top alternatives, best first)
Logprob = tuple[float, list[tuple[int, float]]]


@dataclass
class ModelRunnerOutput:
    """What the model runner computed in one step, by request id."""

    # the tokens each request emits: one sampled token, or (speculative decoding) its accepted drafts and one more
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # SamplingParams.logprobs: one entry per emitted token; with logprobs=-1, the (V,) float32 log-softmax row
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: the prompt positions this step computed
    prompt_logprobs: dict[str, list[Logprob | None]] = field(default_factory=dict)
    # a pooling request whose prompt is now all computed: its pooled hidden state (hidden_size,)
    pooler_output: dict[str, Any] = field(default_factory=dict)
    # a request whose own parameters, grammar or part of the step failed: it alone ends, with this message
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """One request's news from one step: the tokens it got, and whether (and why) it finished."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Any] | None = None
    new_prompt_logprobs: list[Logprob | None] | None = None
    pooling_output: Any = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (SequenceStatus.finish_reason)
    stop_reason: int | None = None  # the stop token that ended it, when it is one of the request's stop_token_ids
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at its first admission
    first_scheduled_time: float | None = None  # when a step first ran it (its queue time ends)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
