"""What crosses the boundaries of one step, as plain data (vLLM v1's `vllm/v1/outputs.py`):

    Scheduler.schedule() --SchedulerOutput--> ModelRunner.execute_model() --ModelRunnerOutput-->
        Scheduler.update_from_output() --list[EngineCoreOutput]--> OutputProcessor (text, RequestOutputs)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Logprob = tuple[float, list[tuple[int, float]]]  # (the token's logprob, [(token_id, logprob), ...] best first)


@dataclass
class ModelRunnerOutput:
    """What the model runner computed in one step, by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # one token, or accepted drafts + one
    logprobs: dict[str, list[Any]] = field(default_factory=dict)  # per emitted token; -1: the (V,) row
    prompt_logprobs: dict[str, list[Logprob | None]] = field(default_factory=dict)  # the positions computed
    pooler_output: dict[str, Any] = field(default_factory=dict)  # a finished prompt's pooled state (hidden_size,)
    failed: dict[str, str] = field(default_factory=dict)  # a request that alone ends, with this message


@dataclass
class EngineCoreOutput:
    """One request's news from one step: its tokens, and whether (and why) it finished."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Any] | None = None
    new_prompt_logprobs: list[Logprob | None] | None = None
    pooling_output: Any = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token that ended it, if one of stop_token_ids
    error: str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
