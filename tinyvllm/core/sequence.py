"""One request's tokens and where it stands (vLLM v1's `Request`, nano-vllm's `Sequence`).

    tokens:    p0 p1 p2 p3 p4 | o0 o1            prompt (5) + output (2), num_tokens = 7
    computed:  ============== | ==               num_computed_tokens = 6
                                   ^ the next step computes o1 (a "decode") and samples o2
"""

from __future__ import annotations

import enum
import time

from tinyvllm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """WAITING -> RUNNING -> FINISHED_*, RUNNING -> PREEMPTED -> RUNNING; any status can become FINISHED_ABORTED."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # eos or a stop token (stop strings: the engine)
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens, or the model's max length
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request alone failed

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI API's `finish_reason`; None while running."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """A prompt, the tokens sampled after it, and how much of it is in the KV cache; position pos lives in block
    `block_table[pos // block_size]`."""

    def __init__(self, seq_id: int | str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 arrival_time: float | None = None, prompt: str | None = None, priority: int = 0, *,
                 pooling_params: object | None = None, grammar: object | None = None, mm_features: list = ()):
        if len(prompt_token_ids) == 0:
            raise ValueError(f"sequence {seq_id}: the prompt must have at least one token")
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower is served first
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = -1  # prompt tokens the prefix cache held at first admission (-1: not yet)
        self.block_table: list[int] = []
        self.spec_token_ids: list[int] = []  # draft tokens to verify next step
        self.pooling_params = pooling_params
        self.grammar = grammar  # structured outputs' matcher
        self.mm_features = list(mm_features)  # Phase 10
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the stop token id that ended it, if one of stop_token_ids
        self._block_hashes: list[bytes] = []

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, block_table={self.block_table})")

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """It needs every prompt position's output, so computes them all."""
        return self.pooling_params is not None or self.sampling_params.prompt_logprobs is not None

    # ---- tokens ----

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """The token ids at positions [start, end)."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(end - num_prompt, 0)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    # ---- progress ----

    @property
    def num_uncomputed_tokens(self) -> int:
        """num_tokens - num_computed_tokens: 1 for a decode, more while prefilling."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Nothing sampled yet, or more than the last sampled token is left to compute (a recompute)."""
        return self.num_output_tokens == 0 or self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # ---- blocks ----

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The prefix-cache hash of each full block, each computed once."""
        if len(self._block_hashes) < self.num_tokens // block_size:
            from tinyvllm.core.prefix_cache import block_hashes

            block_hashes(self.all_token_ids, block_size, self._block_hashes, mm_features=self.mm_features)
        return self._block_hashes

    def num_blocks(self, block_size: int) -> int:
        return -(-self.num_tokens // block_size)
