"""The continuous-batching engine (Phase 3): requests join and leave the running batch at every step.

    add_request --> Scheduler.waiting
    step():  schedule()  ->  model_runner.execute_model()  ->  sample  ->  update_from_output()  ->  outputs
                 |                  |                                          |
          who runs, how many   one forward pass over all              append tokens, stop checks,
          tokens (budget)      scheduled tokens                       free finished sequences' blocks

Like nano-vllm's, `step()` is the algorithm in three lines; everything else is bookkeeping around it.
A request with `n > 1` becomes n requests of one completion each (`parent_request.py`), as in vLLM v1: the
scheduler only sees requests, one `Sequence` each, whose `seq_id` is the request id; the n share the
prompt's K/V (computed once, forked, copy-on-write). The engine turns
tokens into text (TextStream: detokenization and stop strings) and builds cumulative `RequestOutput`s.

Every entry point runs on this class: `main.py` and `Generator` (one request, streamed), `LLM.generate`
(a batch), and the server (`AsyncLLMEngine` steps it on its own thread).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.core.kv_cache import (
    PagedKVCache,
    activation_bytes,
    kv_cache_budget,
    num_blocks_for_memory,
    resolve_kv_cache_dtype,
)
from tinyvllm.core.scheduler import Scheduler, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.engine_state import StepLog, engine_state
from tinyvllm.engine.beam_search import BeamSearchParams, BeamSearchRequests
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.parent_request import ParentRequests
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import load_model
from tinyvllm.model.quantization import check_quantization
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sample.noise import draw_keys
from tinyvllm.sample.sampler import Sampler, logprobs_of, make_generator
from tinyvllm.sample.structured_output import StructuredOutputManager, apply_bitmask_numpy
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.config import SpeculativeConfig
from tinyvllm.spec_decode.speculator import Speculator

logger = logging.getLogger("tinyvllm.engine")


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

    def pooled_output(self) -> RequestOutput:
        """A pooling request's one output: its pooled vector (see tinyvllm/pooling_params.py)."""
        seq = self.seq
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


@dataclass
class SamplingBatch:
    """One step's per-row sampling inputs (see device_sampler): rows of greedy defaults until a request fills its
    own. keys (rows, 2) exist once a row samples (its draw key, see sample/noise.py); bitmask (rows, ceil(vocab/32))
    once a row has a grammar."""

    temperature: np.ndarray  # (rows,) float32, 0 = greedy
    top_k: np.ndarray  # (rows,) int32, vocab = off
    top_p: np.ndarray  # (rows,) float32, 1 = off
    min_p: np.ndarray  # (rows,) float32, 0 = off
    keys: np.ndarray | None = None  # (rows, 2) uint32
    bitmask: np.ndarray | None = None
    use_filters: bool = False
    on_host: list[int] = field(default_factory=list)  # rows the host reference sampler takes

    @property
    def device_params(self) -> tuple[np.ndarray, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p


class LLMEngine:
    """model: a .gguf file, an HF checkpoint directory, None for the default model (SmolLM2-135M-Instruct), or a
    `LlamaForCausalLM` already loaded (then pass its `tokenizer` too: tests and tutorials share one model
    between engines). `dtype` "auto" computes in float16 on a GPU and float32 on the CPU (tinyvllm/platforms.py).
    The KV cache gets `kv_cache_memory` bytes where given; otherwise, on a GPU, the share `gpu_memory_utilization`
    (vLLM's flag, default 0.9) of the device's memory leaves once the weights are loaded, and 512MiB on the CPU
    (core/kv_cache.py, `kv_cache_budget`). `num_gpu_blocks_override` sets the number of KV blocks instead
    (vLLM's flag); `portable_attention=True` keeps the portable paged attention instead of the kernels;
    `scheduling_policy="priority"` serves requests by their `priority` (lower first) and preempts the lowest;
    `enable_prefix_caching` (on by default, as in vLLM) reuses the K/V of prompt prefixes seen before;
    `kv_cache_dtype` stores K/V as "auto" (the model's dtype), "float32", "float16", "int8" or "fp8" (e4m3),
    the last two with one scale per token per KV head (vLLM's flag; docs/phases/07c-kv-cache-quantization.md);
    `quantization` (vLLM's flag: "auto" keeps a GGUF's quantized blocks, "none" dequantizes, "q8_0" / "q4_0" /
    "q4_1" quantize at load; see tinyvllm/model/quantization.py) picks how the weights are stored.
    `speculative_config` (vLLM's: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}, see
    spec_decode/config.py) turns on speculative decoding (tinyvllm/spec_decode/): greedy requests and sampled ones
    (exact rejection sampling); requests with penalties, logit bias, logprobs, min_tokens or a grammar decode one
    token a step (spec_decode/speculator.py says why)."""

    def __init__(self, model: str | os.PathLike | LlamaForCausalLM | None = None, *, tokenizer: Tokenizer | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, block_size: int = 16,
                 kv_cache_memory: str | int | None = None, gpu_memory_utilization: float | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 device: str | None = None, num_gpu_blocks_override: int | None = None,
                 portable_attention: bool = False, scheduling_policy: str = "fcfs", enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", quantization: str = "auto", speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        resolve_kv_cache_dtype(kv_cache_dtype)  # a bad name fails here, before the model loads
        self.speculative_config = None if speculative_config is None else SpeculativeConfig.from_dict(
            speculative_config)
        check_quantization(quantization)
        if isinstance(model, LlamaForCausalLM):
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLMEngine(model, tokenizer=...)")
            self.model, self.tokenizer, self.model_path = model, tokenizer, None
            self.model_name = "model"
        else:
            self.model, self.tokenizer, self.model_path = load_model(model, dtype, device, quantization,
                                                                     tensor_parallel_size=tensor_parallel_size,
                                                                     pipeline_parallel_size=pipeline_parallel_size)
            self.model_name = self.model_path.name
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        config = self.model.kv_cache_config  # the model's, with KV heads counted over every device (Phase 8)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.model.dtype)  # "auto": the model's
        spec = self.speculative_config
        if not num_gpu_blocks_override:  # the budget: given, or what the GPU's memory leaves (core/kv_cache.py)
            logits_rows = min(max_num_batched_tokens, max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
            budget = kv_cache_budget(kv_cache_memory, gpu_memory_utilization, self.model.device,
                                     activation_bytes(config, max_num_batched_tokens, logits_rows))
        num_blocks = num_gpu_blocks_override or num_blocks_for_memory(config, block_size, budget, self.kv_cache_dtype)
        self.max_model_len = max_model_len or min(config.max_position_embeddings, num_blocks * block_size)
        if not 2 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}], got {self.max_model_len}")
        self.kv_cache = PagedKVCache(config, num_blocks, block_size, self.kv_cache_dtype,
                                     self.model.kv_cache_devices)
        self.scheduler = Scheduler(num_blocks, block_size, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                   eos_token_ids=self.tokenizer.stop_token_ids, policy=scheduling_policy,
                                   enable_prefix_caching=enable_prefix_caching)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, max_num_batched_tokens,
                                        max_num_seqs, portable_attention=portable_attention,
                                        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens)
        self.speculator = None if spec is None else Speculator(
            spec, self.model_runner, self.model, self.tokenizer, max_model_len=self.max_model_len,
            num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, portable_attention=portable_attention, model_name=self.model_name)
        self._spec_output_start: dict[str, int] = {}  # this step: request id -> its output length before the step
        self.sampler = Sampler()
        self.structured_outputs = StructuredOutputManager(self.tokenizer)
        self.requests: dict[str, RequestState] = {}  # unfinished requests the scheduler knows, by request id
        self._failed: list[RequestOutput] = []  # requests this step finished with an error, reported by step()
        self._pooled: list[RequestOutput] = []  # pooling requests this step finished, reported by step()
        self.parent_requests = ParentRequests()  # n > 1: the user's request id -> its n child requests
        self.beam_search = BeamSearchRequests(self.scheduler, self.tokenizer)  # beams: forks of one another
        self.step_log = StepLog()  # the last steps' records, for get_state() (the server's dashboard)

    # ---- requests in ----

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a prompt (text, or token ids). Bad input raises ValueError and changes nothing. `priority`
        counts under the "priority" scheduling policy: lower is served first (vLLM's convention).
        `BeamSearchParams` make it a beam search (engine/beam_search.py): one output, when it ends.
        `PoolingParams` make it a pooling request: its prompt is computed (in chunks, like any prefill) and
        nothing is sampled; its one output carries the pooled final hidden states (`RequestOutput.pooled`)."""
        params = sampling_params or SamplingParams()
        if isinstance(params, PoolingParams):
            text, prompt_ids = self._process_prompt(prompt)
            if request_id in self.requests or request_id in self.parent_requests.parents or (
                    request_id in self.beam_search.requests):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._add_one(request_id, text, prompt_ids, SamplingParams(max_tokens=1), priority, pooling=params)
            return
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")
        if isinstance(params, BeamSearchParams):
            text, prompt_ids = self._process_prompt(prompt)
            if request_id in self.requests or request_id in self.beam_search.requests or (
                    request_id in self.parent_requests.parents):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.beam_search.add(request_id, text, prompt_ids, params, RequestMetrics(time.monotonic()))
            return
        self._check_params(params)
        text, prompt_ids = self._process_prompt(prompt)
        self.parent_requests.add(request_id, params, in_use=lambda rid: rid in self.requests,
                                 add_child=lambda rid, child: self._add_one(rid, text, prompt_ids, child, priority))

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids must be in this model's vocabulary."""
        vocab = self.tokenizer.vocab_size
        for field_name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{field_name} must be token ids in [0, {vocab}) for this model, got {bad[:5]}")

    def _process_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
                raise ValueError(f"prompt token ids must be ints in [0, {self.tokenizer.vocab_size})")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens, but "
                             f"the prompt has "
                             f"{len(prompt_ids)} tokens, leaving no room for output")
        return text, prompt_ids

    def _add_one(self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams,
                 priority: int = 0, pooling: PoolingParams | None = None) -> None:
        seq = Sequence(request_id, prompt_ids, params, prompt=text, priority=priority)
        seq.skip_reading_prefix_cache = pooling is not None or params.prompt_logprobs is not None
        generator = None if params.is_greedy else make_generator(params.seed)
        matcher = None if params.structured_outputs is None else self.structured_outputs.matcher(
            params.structured_outputs)  # a grammar that does not compile: ValueError, nothing added
        self.requests[request_id] = RequestState(request_id, text, params, seq,
                                                 TextStream(self.tokenizer, params, prompt_ids), generator, matcher,
                                                 pooling=pooling)
        source = self.parent_requests.prompt_source(request_id)  # n > 1: the sibling that computes the prompt
        self.scheduler.add_seq(seq, share_prompt_with=None if source is None else self.requests[source].seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (all n completions, or all beams); its blocks are free when this returns."""
        if self.beam_search.abort(request_id):
            return
        for rid in self.parent_requests.request_ids(request_id):
            state = self.requests.pop(rid, None)
            if state is not None and not state.seq.is_finished:
                self.scheduler.abort(rid)
        self.parent_requests.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        self._lap(None)
        if self.speculator is not None:  # drafts for this step (seq.spec_token_ids), counted by the scheduler
            self.speculator.propose(self.scheduler.running, self.requests)
        scheduler_output = self.scheduler.schedule()
        self._record_scheduled(scheduler_output.scheduled_seqs)
        self._lap("schedule")
        begun = self.step_log.begin(scheduler_output)
        rng_states = self._rng_states(scheduler_output)
        try:
            sampled = self._run_and_sample(scheduler_output)
        except Exception as e:  # no request's own try caught it: the forward pass, or the batch's sampling
            sampled = self._retry_in_parts(scheduler_output, rng_states, e)
        new_token_seqs = self.scheduler.update_from_output(scheduler_output, sampled)
        self._lap("bookkeeping")
        outputs = self._make_outputs(new_token_seqs) + self.beam_search.update()
        if self.speculator is not None:  # the proposer drops what it holds for sequences that stopped running
            self.speculator.free_stale(self.scheduler.running)
        self.step_log.end(begun, len(new_token_seqs))
        self._lap("detokenize")
        return outputs

    def _record_scheduled(self, seqs: list[Sequence]) -> None:
        """The time each request is first scheduled: where its queue time ends (the server's metrics)."""
        now = time.monotonic()
        for seq in seqs:
            owner = self.requests.get(seq.seq_id) or self.beam_search.request_of.get(seq.seq_id)  # a beam's search
            metrics = None if owner is None else owner.metrics
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    @property
    def step_timer(self):
        """A StepTimer (engine/step_timer.py) that times each phase of a step, or None (the default: no timing)."""
        return self.model_runner.step_timer

    @step_timer.setter
    def step_timer(self, timer) -> None:
        if timer is not None and timer.device is None:
            timer.device = self.model.device  # it waits for the device before each reading (engine/step_timer.py)
        self.model_runner.step_timer = timer  # the runner times input preparation and the forward pass

    def _lap(self, phase: str | None) -> None:
        """Profiling only: the time since the last lap belongs to `phase` (None: a step starts)."""
        timer = self.model_runner.step_timer
        if timer is None:
            return
        if phase is None:
            timer.start()
        else:
            timer.lap(phase)

    def _run_and_sample(self, scheduler_output) -> dict[int | str, int]:
        """Forward pass, then one token per sequence that caught up: on the device in one batched graph,
        except for rows whose request needs the host reference sampler (penalties, logit bias, min_tokens,
        logprobs), which get their row of logits copied back. Structured outputs mask both paths."""
        if not scheduler_output.scheduled_seqs:
            self._fail_unschedulable(scheduler_output)
            return {}
        hidden_for = frozenset(seq.seq_id for seq in scheduler_output.scheduled_seqs
                               if (state := self.requests.get(seq.seq_id)) is not None and state.needs_hidden_states)
        seqs, logits = self.model_runner.execute_model(scheduler_output, hidden_for)
        spec_rows = self.model_runner.spec_logits_rows  # speculative decoding: the drafts' rows of the logits
        if hidden_for:
            self._record_hidden_states()
            pooled = [seq for seq in seqs if seq.seq_id in self.requests and self.requests[seq.seq_id].pooling]
            for seq in pooled:  # its prompt is all computed: it ends here, without a token (its row is sampled with
                self._finish_pooled(seq)  # the batch's, as a finished request's, and dropped)
        if not seqs:
            return {}
        beam_rows = [row for row, seq in enumerate(seqs) if self.beam_search.owns(seq.seq_id)]
        if beam_rows:  # beams sample nothing: the beam search reads their log-probabilities
            host = logits.numpy()
            for row in beam_rows:
                self.beam_search.record(seqs[row], host[row])
        batch = self._sampling_batch(seqs, *logits.shape, verifying=spec_rows)
        self._lap("bookkeeping")
        tokens = self.model_runner.sample(logits, *batch.device_params, batch.keys, batch.use_filters,
                                          batch.bitmask)
        self._lap("forward")  # the sampler runs on the device: its token ids are the forward pass's end
        sampled = {seq.seq_id: int(tokens[row]) for row, seq in enumerate(seqs) if row not in batch.on_host}
        if spec_rows:  # the tokens each verifying request emits (a list), and where its output stood before them
            for seq in self.speculator.verify(seqs, logits, tokens, spec_rows, scheduler_output, sampled,
                                              self.requests):
                self._spec_output_start[seq.seq_id] = seq.num_output_tokens
        host_logits = logits.numpy() if batch.on_host else None
        for row in batch.on_host:
            try:
                mask = None if batch.bitmask is None else batch.bitmask[row]
                sampled[seqs[row].seq_id] = self._sample_on_host(seqs[row], host_logits[row], mask)
            except Exception as e:
                self._fail(seqs[row], e)
        for seq in seqs:  # the grammar moves on by the token just sampled
            state = self.requests.get(seq.seq_id)
            if state is not None and state.matcher is not None and seq.seq_id in sampled:
                try:
                    self.structured_outputs.accept(state.matcher, sampled[seq.seq_id])
                except Exception as e:
                    self._fail(seq, e)
        return {seq_id: token for seq_id, token in sampled.items() if seq_id in self.requests}

    def _rng_states(self, scheduler_output: SchedulerOutput) -> dict[str, dict]:
        """The state of each scheduled sampled request's random generator, so that a step retried in parts
        draws the same numbers as the step that failed would have (seeded outputs stay reproducible)."""
        states = {}
        for seq in scheduler_output.scheduled_seqs:
            state = self.requests.get(seq.seq_id)
            if state is not None and state.generator is not None:
                states[seq.seq_id] = state.generator.bit_generator.state
        return states

    def _retry_in_parts(self, scheduler_output: SchedulerOutput, rng_states: dict[str, dict],
                        error: Exception) -> dict[int | str, int]:
        """The step failed as a whole (say an index past a buffer, a kernel refusing a shape): retry it one part
        at a time, a part being one sequence and the completions forked from it this step. The parts that fail
        again caused it: their requests end with the error; the others get their tokens as if nothing had
        happened (a part recomputes the same K/V; the generators restart from their states before the step).
        vLLM aborts the requests a failed step held; retrying costs one forward pass per part, once."""
        logger.error("the engine step failed (%s: %s); retrying its %d sequences one at a time",
                     type(error).__name__, error, len(scheduler_output.scheduled_seqs))
        parts: dict[int | str, list[Sequence]] = {}
        for seq in scheduler_output.scheduled_seqs:  # a forked sequence samples its source's row: same part
            parts.setdefault(scheduler_output.forked_from.get(seq.seq_id, seq.seq_id), []).append(seq)
        sampled: dict[int | str, int] = {}
        blocks_to_copy = scheduler_output.blocks_to_copy  # copied once, by the first part, before any write
        for part in parts.values():
            part = [seq for seq in part if not seq.is_finished]  # a beam search failed by an earlier part ended
            if not part:
                continue
            ids = {seq.seq_id for seq in part}
            sub = SchedulerOutput(part, {i: scheduler_output.num_scheduled_tokens[i] for i in ids}, [], blocks_to_copy,
                                  {i: src for i, src in scheduler_output.forked_from.items() if i in ids},
                                  {i: d for i, d in scheduler_output.scheduled_spec_decode_tokens.items() if i in ids})
            blocks_to_copy = []
            for seq_id in ids & rng_states.keys():
                self.requests[seq_id].generator.bit_generator.state = rng_states[seq_id]
            try:
                sampled.update(self._run_and_sample(sub))
            except Exception as part_error:
                for seq in part:
                    if not seq.is_finished:
                        self._fail(seq, part_error)
        return sampled

    def _record_hidden_states(self) -> None:
        """What the requests that need every position take from this step's final hidden states: a pooling
        request adds its tokens' to its pool, a request with prompt_logprobs the logprobs of its prompt tokens.
        A sequence computed again from its start (preempted) starts over."""
        for seq_id, hidden in self.model_runner.hidden_states.items():  # (count, D) each
            state = self.requests.get(seq_id)
            if state is None:
                continue
            seq = state.seq
            start = seq.num_computed_tokens  # the step's first position (update_from_output has not run yet)
            try:
                if state.pooling is not None:
                    in_prompt = hidden[:max(seq.num_prompt_tokens - start, 0)].astype(np.float64)
                    state.hidden_sum = (0 if start == 0 else state.hidden_sum) + in_prompt.sum(axis=0)
                    if len(in_prompt):
                        state.hidden_last = in_prompt[-1]
                elif len(state.prompt_logprobs) < seq.num_prompt_tokens:
                    self._record_prompt_logprobs(state, start, hidden.shape[0])
            except Exception as e:  # this request alone ends
                self._fail(seq, e)

    def _record_prompt_logprobs(self, state: RequestState, start: int, count: int) -> None:
        """The logprob of each prompt token at positions start+1 .. start+count given the tokens before it, with
        the `prompt_logprobs` most likely alternatives (raw logprobs, as the sampled tokens' are)."""
        seq, k = state.seq, state.params.prompt_logprobs
        if start == 0:
            state.prompt_logprobs = [None]  # the first token: nothing comes before it to predict it
        if len(state.prompt_logprobs) != start + 1:
            return  # recomputed after a preemption: these positions are already recorded
        logits = self.model_runner.position_logits(seq.seq_id)  # (count, V)
        for j in range(count):
            position = start + j + 1  # the token row j predicts
            if position >= seq.num_prompt_tokens:
                break
            state.prompt_logprobs.append(logprobs_of(logits[j], seq.prompt_token_ids[position], k))

    def _finish_pooled(self, seq: Sequence) -> None:
        state = self.requests.pop(seq.seq_id)
        self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        state.metrics.first_token_time = state.metrics.finished_time = time.monotonic()
        self._pooled.append(state.pooled_output())

    def _sampling_batch(self, seqs: list[Sequence], rows: int, vocab: int,
                        verifying: dict | tuple = ()) -> SamplingBatch:
        """Each row's sampling parameters, draw key and grammar mask, one request at a time: a request whose
        parameters fail here ends alone (its row stays greedy and its token is dropped). A sampled request that
        verifies drafts (`verifying`, seq_id -> its drafts' rows) stays greedy here too: rejection sampling
        draws its tokens (spec_decode/rejection_sampler.py)."""
        batch = SamplingBatch(np.zeros(rows, np.float32), np.full(rows, vocab, np.int32), np.ones(rows, np.float32),
                              np.zeros(rows, np.float32))
        for row, seq in enumerate(seqs):
            state = self.requests.get(seq.seq_id)
            if state is None:
                continue  # a beam (its row stays greedy, its token unused)
            params = state.params
            try:
                if state.matcher is not None:
                    if batch.bitmask is None:
                        batch.bitmask = self.structured_outputs.allocate_bitmask(rows)
                    self.structured_outputs.fill_bitmask(state.matcher, batch.bitmask, row)
                if self._needs_host_sampler(seq, params):
                    batch.on_host.append(row)
                    continue
                if params.is_greedy or seq.seq_id in verifying:
                    continue
                top_k = min(params.top_k, vocab) if params.top_k > 0 else vocab
                key = draw_keys(state.generator, 1)[0]  # the host sampler draws its key the same way
            except Exception as e:  # one request's parameters must never fail the batch
                self._fail(seq, e)
                continue
            batch.temperature[row], batch.top_k[row] = params.temperature, top_k
            batch.top_p[row], batch.min_p[row] = params.top_p, params.min_p
            if batch.keys is None:
                batch.keys = np.zeros((rows, 2), np.uint32)
            batch.keys[row] = key
        batch.use_filters = bool((batch.top_k < vocab).any() or (batch.top_p < 1).any() or (batch.min_p > 0).any())
        return batch

    @staticmethod
    def _needs_host_sampler(seq: Sequence, params: SamplingParams) -> bool:
        return (params.uses_penalties or bool(params.logit_bias) or params.logprobs is not None
                or seq.num_output_tokens < params.min_tokens)

    def _sample_on_host(self, seq: Sequence, logits: np.ndarray, bitmask_row: np.ndarray | None = None) -> int:
        state = self.requests[seq.seq_id]
        allowed = logits if bitmask_row is None else apply_bitmask_numpy(logits, bitmask_row)
        token = self.sampler(allowed, state.params, seq.prompt_token_ids, seq.output_token_ids, state.generator,
                             self.tokenizer.stop_token_ids)
        if state.params.logprobs is not None:  # of the model's own distribution, as vLLM's raw logprobs
            state.logprobs.append(logprobs_of(logits, token, state.params.logprobs))
        return token

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """Finish one request with an error (its blocks are freed) and leave the rest of the step alone,
        as vLLM aborts the offending request, not the batch. step() reports it."""
        logger.exception("request %s failed in the engine step; the other requests go on", seq.seq_id,
                         exc_info=error)
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        if self.beam_search.owns(seq.seq_id):  # a beam: its whole beam search ends
            self._failed.append(self.beam_search.fail(seq.seq_id, message))
            return
        state = self.requests.pop(seq.seq_id)
        state.error = message
        self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_ERROR)
        state.metrics.finished_time = time.monotonic()
        self._failed.append(state.output())

    def _fail_unschedulable(self, scheduler_output) -> None:
        """Nothing was scheduled, nothing runs and nothing was preempted: no block will come free, so the head
        of the waiting queue can never be admitted. It ends with an error instead of waiting forever (the
        pool can only be that short when blocks leaked, or a test took them: tinyvllm/engine/fault_injection.py)."""
        scheduler = self.scheduler
        if scheduler_output.preempted_seqs or scheduler.running or not scheduler.waiting:
            return
        seq, bm = scheduler.waiting[0], scheduler.block_manager
        self._fail(seq, RuntimeError(
            f"out of KV cache blocks: the request needs {seq.num_blocks(bm.block_size)} blocks, {bm.num_free_blocks} "
            f"of the {bm.num_blocks} are free and no running request will give any back"))

    def _make_outputs(self, new_token_seqs: list[Sequence]) -> list[RequestOutput]:
        """Text for each new token, stop strings (the scheduler checked stop tokens and lengths), outputs."""
        now = time.monotonic()
        for seq in new_token_seqs:
            try:
                self._process_token(seq, now)
            except Exception as e:  # detokenizing or a stop string failed: this request alone ends
                self._fail(seq, e)
        self._spec_output_start.clear()
        outputs = list(self._failed) + self._pooled
        self._failed.clear()
        self._pooled = []
        for seq in new_token_seqs:
            state = self.requests.get(seq.seq_id)
            if state is None:
                continue  # failed above
            if seq.is_finished:
                del self.requests[seq.seq_id]
            outputs.append(state.output())
        return self.parent_requests.merge(outputs)

    def _process_token(self, seq: Sequence, now: float) -> None:
        """The new token's text, stop strings (the scheduler checked stop tokens and lengths), timings."""
        state = self.requests[seq.seq_id]
        state.metrics.first_token_time = state.metrics.first_token_time or now
        start = self._spec_output_start.pop(seq.seq_id, None)
        if start is not None and self._process_spec_tokens(seq, state, start, now):
            return
        token = seq.last_token_id
        if seq.status == SequenceStatus.FINISHED_STOPPED and token in state.params.all_stop_token_ids(
                self.tokenizer.stop_token_ids):
            state.stop_reason = token if token in state.params.stop_token_ids else None
        else:
            _, stopped = state.text.add(token)
            if stopped:
                self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                state.stop_reason = state.text.stop_str
        if seq.is_finished:
            if state.text.stop_str is None:
                state.text.finish()  # release text held back for a stop string that never came
            state.metrics.finished_time = now

    def _process_spec_tokens(self, seq: Sequence, state: RequestState, start: int, now: float) -> bool:
        """The text of the tokens a verify step emitted before its last one, each in turn as plain decoding would
        see them. A stop string in one of them ends the request there: the tokens after it are dropped (they were
        never produced, as far as the user can tell). Returns True if it ended; the last token is then done."""
        for j in range(start, seq.num_output_tokens - 1):
            _, stopped = state.text.add(seq.output_token_ids[j])
            if not stopped:
                continue
            if seq.is_finished:  # the scheduler ended it at a later token (stop token, length): the string comes first
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
            del seq.output_token_ids[j + 1:]
            state.stop_reason = state.text.stop_str
            state.metrics.finished_time = now
            return True
        return False

    def get_state(self) -> dict:
        """A snapshot of the block pool, the queues and the last steps (tinyvllm/engine/engine_state.py); take it on
        the thread that steps the engine."""
        return engine_state(self)

    def get_stats(self) -> dict:
        bm = self.scheduler.block_manager
        last_step = self.step_log.records[-1] if self.step_log.records else None
        iteration_tokens = 0 if last_step is None else last_step.num_prefill_tokens + last_step.num_decode_tokens
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
                "num_cached_blocks": len(bm.cached_blocks),  # free or not: blocks a new prompt may hit
                "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
                "num_preemptions": self.scheduler.num_preemptions,
                # tokens the last step computed (vLLM's iteration_tokens_total); 0 before any step
                "iteration_tokens": iteration_tokens,
                "kv_cache_dtype": self.kv_cache_dtype.name,  # Phase 7c: how K/V are stored, and what a token costs
                "kv_cache_bytes_per_token": self.kv_cache.bytes_per_token,
                "quantization": self.model.quantization, "weight_bytes": self.model.weight_formats(),
                **(self.speculator.stats() if self.speculator is not None else {})}
