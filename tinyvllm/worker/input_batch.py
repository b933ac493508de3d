"""The model runner's persistent batch: what it keeps of each request it runs (vLLM v1's `InputBatch` and
`CachedRequestState`, vllm/v1/worker/gpu_input_batch.py).

    SchedulerOutput --update()--> requests: req_id -> CachedRequestState   (from its first step to its finish)
                                  rows:     the scheduled requests' sampling parameters, one row each

    row  req    temperature  top_k   top_p  min_p         a request takes a free row when it is scheduled and
    0    "a"    0.0          V       1.0    0.0           gives it back when a step leaves it out (preempted,
    1    "c"    0.8          50      0.9    0.0           waiting for blocks) or it finishes; its parameters are
    2    -      (free)                                    written once, when it takes the row
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.sample.sampler import make_generator


@dataclass
class CachedRequestState:
    seq: Sequence  # the scheduler's: read here, never written
    generator: np.random.Generator | None  # None when greedy
    row: int | None = None  # its row of the batch while it is scheduled
    hidden_sum: np.ndarray | None = None  # MEAN pooling: the sum of the prompt's final hidden states so far
    hidden_last: np.ndarray | None = None  # LAST pooling: the last computed prompt token's
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: the positions recorded so far

    @property
    def params(self):
        return self.seq.sampling_params

    @property
    def needs_hidden_states(self) -> bool:
        """Whether its next step needs every position's output, not only the last one's."""
        seq = self.seq
        return seq.pooling_params is not None or (seq.sampling_params.prompt_logprobs is not None
                                                  and seq.num_computed_tokens < seq.num_prompt_tokens)


class InputBatch:
    """The requests the runner knows (`requests`) and the rows of those scheduled this step, with their sampling
    parameters (`temperature`, `top_k`, `top_p`, `min_p`: (max_num_reqs,) each)."""

    def __init__(self, max_num_reqs: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.requests: dict[int | str, CachedRequestState] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))  # popped from the end: row 0 first
        self.temperature = np.zeros(max_num_reqs, np.float32)  # 0 = greedy
        self.top_k = np.full(max_num_reqs, vocab_size, np.int32)  # vocab = off
        self.top_p = np.ones(max_num_reqs, np.float32)  # 1 = off
        self.min_p = np.zeros(max_num_reqs, np.float32)  # 0 = off

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the finished requests, give back the rows of those this step leaves out, and give a row to
        each scheduled request that has none (a new one gets its state: its generator, made from its seed)."""
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None and state.row is not None:
                self.free_rows.append(state.row)
        scheduled = {seq.seq_id for seq in scheduler_output.scheduled_seqs}
        for req_id, state in self.requests.items():
            if state.row is not None and req_id not in scheduled:
                self.free_rows.append(state.row)
                state.row = None
        for seq in scheduler_output.scheduled_seqs:
            state = self.requests.get(seq.seq_id)
            if state is None or state.seq is not seq:  # new (or a request id used again after it finished)
                params = seq.sampling_params
                state = self.requests[seq.seq_id] = CachedRequestState(
                    seq, None if params.is_greedy else make_generator(params.seed))
            if state.row is None:
                self._add_row(state)

    def _add_row(self, state: CachedRequestState) -> None:
        params, row = state.params, self.free_rows.pop()
        state.row = row
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size
        self.top_p[row], self.min_p[row] = params.top_p, params.min_p

    def generator_states(self, seqs: list[Sequence]) -> dict[int | str, dict]:
        """The state of each of these requests' generators: a step that fails is retried from them."""
        return {seq.seq_id: state.generator.bit_generator.state for seq in seqs
                if (state := self.requests.get(seq.seq_id)) is not None and state.generator is not None}

    def restore_generators(self, states: dict[int | str, dict]) -> None:
        for req_id, rng_state in states.items():
            self.requests[req_id].generator.bit_generator.state = rng_state
