"""The continuous-batching engine (Phase 3): requests join and leave the running batch at every step.

    add_request --> Scheduler.waiting
    step():  schedule()  ->  model_runner.execute_model()  ->  sample  ->  update_from_output()  ->  outputs
                 |                  |                                          |
          who runs, how many   one forward pass over all              append tokens, stop checks,
          tokens (budget)      scheduled tokens                       free finished sequences' blocks

Like nano-vllm's, `step()` is the algorithm in three lines; everything else is bookkeeping around it.
A request with `n > 1` becomes n sequences; the engine maps sequence ids back to requests, turns
tokens into text (TextStream: detokenization and stop strings), and builds cumulative `RequestOutput`s.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.core.kv_cache import PagedKVCache, num_blocks_for_memory
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.loader import load_model
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sample.sampler import Sampler, logprobs_of, make_generator
from tinyvllm.sampling_params import SamplingParams


@dataclass
class RequestState:
    """A request's sequences (one per completion) and what the user sees of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[TextStream]
    generators: list[np.random.Generator | None]
    logprobs: list[list] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "float32",
                 max_model_len: int | None = None, block_size: int = 16, kv_cache_memory: str | int = "512MiB",
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, device: str | None = None):
        self.model, self.tokenizer, self.model_path = load_model(model, dtype, device)
        self.model_name = self.model_path.name
        config = self.model.config
        num_blocks = num_blocks_for_memory(config, block_size, kv_cache_memory, self.model.dtype)
        self.max_model_len = max_model_len or min(config.max_position_embeddings, num_blocks * block_size)
        if not 2 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}], got {self.max_model_len}")
        self.kv_cache = PagedKVCache(config, num_blocks, block_size, self.model.dtype, self.model.device)
        self.scheduler = Scheduler(num_blocks, block_size, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                   eos_token_ids=self.tokenizer.stop_token_ids)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, max_num_batched_tokens,
                                        max_num_seqs)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self._seq_owner: dict[int, tuple[RequestState, int]] = {}  # seq_id -> (request, completion index)
        self._seq_ids = itertools.count()

    # ---- requests in ----

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None) -> None:
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
                raise ValueError(f"prompt token ids must be ints in [0, {self.tokenizer.vocab_size})")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                             f"{len(prompt_ids)} tokens, leaving no room for output")
        seqs = [Sequence(next(self._seq_ids), prompt_ids, params, prompt=text) for _ in range(params.n)]
        # with a seed, completion i draws from its own stream seed + i, so n > 1 completions differ but reproduce
        generators = [None if params.is_greedy else make_generator(None if params.seed is None else params.seed + i)
                      for i in range(params.n)]
        state = RequestState(request_id, text, prompt_ids, params, seqs,
                             [TextStream(self.tokenizer, params, prompt_ids) for _ in seqs], generators,
                             logprobs=[[] for _ in seqs], stop_reasons=[None for _ in seqs])
        self.requests[request_id] = state
        for index, seq in enumerate(seqs):
            self._seq_owner[seq.seq_id] = (state, index)
            self.scheduler.add_seq(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are free when this returns."""
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state is not None else []:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
            self._seq_owner.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        sampled = self._run_and_sample(scheduler_output)
        new_token_seqs = self.scheduler.update_from_output(scheduler_output, sampled)
        return self._make_outputs(new_token_seqs)

    def _run_and_sample(self, scheduler_output) -> dict[int, int]:
        """Forward pass, then one token per sequence that caught up: on the device in one batched graph,
        except for rows whose request needs the host reference sampler (penalties, logit bias, min_tokens,
        logprobs), which get their row of logits copied back."""
        if not scheduler_output.scheduled_seqs:
            return {}
        seqs, logits = self.model_runner.execute_model(scheduler_output)
        if not seqs:
            return {}
        rows, vocab = logits.shape
        temperature, top_p, min_p = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.float32)
        top_k, clocks = np.full(rows, vocab, np.int32), None  # clocks (rows, vocab) only once a row samples
        on_host = []
        for row, seq in enumerate(seqs):
            state, index = self._seq_owner[seq.seq_id]
            params = state.params
            if self._needs_host_sampler(seq, params):
                on_host.append(row)
                continue
            if not params.is_greedy:
                temperature[row], top_p[row], min_p[row] = params.temperature, params.top_p, params.min_p
                top_k[row] = params.top_k if params.top_k > 0 else vocab
                if clocks is None:
                    clocks = np.ones((rows, vocab), np.float32)
                clocks[row] = state.generators[index].standard_exponential(vocab)  # same draws as the host sampler
        use_filters = bool((top_k < vocab).any() or (top_p < 1).any() or (min_p > 0).any())
        # clocks None: every device row is greedy, and the device only takes the argmax
        tokens = self.model_runner.sample(logits, temperature, top_k, top_p, min_p, clocks, use_filters)
        host_logits = logits.numpy() if on_host else None
        sampled = {seq.seq_id: int(tokens[row]) for row, seq in enumerate(seqs)}
        for row in on_host:
            sampled[seqs[row].seq_id] = self._sample_on_host(seqs[row], host_logits[row])
        return sampled

    @staticmethod
    def _needs_host_sampler(seq: Sequence, params: SamplingParams) -> bool:
        return (params.uses_penalties or bool(params.logit_bias) or params.logprobs is not None
                or seq.num_output_tokens < params.min_tokens)

    def _sample_on_host(self, seq: Sequence, logits: np.ndarray) -> int:
        state, index = self._seq_owner[seq.seq_id]
        token = self.sampler(logits, state.params, seq.prompt_token_ids, seq.output_token_ids,
                             state.generators[index], self.tokenizer.stop_token_ids)
        if state.params.logprobs is not None:
            state.logprobs[index].append(logprobs_of(logits, token, state.params.logprobs))
        return token

    def _make_outputs(self, new_token_seqs: list[Sequence]) -> list[RequestOutput]:
        progressed: dict[str, RequestState] = {}
        now = time.monotonic()
        for seq in new_token_seqs:
            state, index = self._seq_owner[seq.seq_id]
            state.metrics.first_token_time = state.metrics.first_token_time or now
            token = seq.last_token_id
            if seq.status == SequenceStatus.FINISHED_STOPPED and token in state.params.all_stop_token_ids(
                    self.tokenizer.stop_token_ids):
                state.stop_reasons[index] = token if token in state.params.stop_token_ids else None
            else:
                _, stopped = state.texts[index].add(token)
                if stopped:
                    self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                    state.stop_reasons[index] = state.texts[index].stop_str
            if seq.is_finished and state.texts[index].stop_str is None:
                state.texts[index].finish()  # release text held back for a stop string that never came
            progressed[state.request_id] = state
        outputs = []
        for state in progressed.values():
            if state.finished:
                state.metrics.finished_time = now
                self.requests.pop(state.request_id, None)
                for seq in state.seqs:
                    self._seq_owner.pop(seq.seq_id, None)
            outputs.append(self.make_request_output(state))
        return outputs

    @staticmethod
    def make_request_output(state: RequestState) -> RequestOutput:
        completions = [
            CompletionOutput(index=i, text=state.texts[i].text, token_ids=list(seq.output_token_ids),
                             finish_reason=seq.status.finish_reason, stop_reason=state.stop_reasons[i],
                             logprobs=list(state.logprobs[i]) if state.params.logprobs is not None else None)
            for i, seq in enumerate(state.seqs)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished=state.finished, metrics=state.metrics)

    def get_stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks}
