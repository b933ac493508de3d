"""The continuous-batching engine (Phase 3): requests join and leave the running batch at every step.

    add_request --> Scheduler.waiting
    step():  schedule()  ->  model_runner.execute_model()  ->  sample  ->  update_from_output()  ->  outputs
                 |                  |                             |                 |
          who runs, how many   one forward pass over all     sampler.prepare   append tokens, stop checks,
          tokens (budget)      scheduled tokens              and .finish       free finished sequences' blocks

A request with `n > 1` becomes n requests of one completion each (`parent_request.py`), as in vLLM v1: the
scheduler only sees requests, one `Sequence` each, whose `seq_id` is the request id; the n share the prompt's
K/V (computed once, forked, copy-on-write). A request's text and outputs are its RequestState's
(request_state.py); the sampler assembles its batch (sample/sampling_batch.py); a failure ends the request
that caused it, not the batch (failures.py). Every entry point runs on this class: `main.py` and `Generator`
(one request, streamed), `LLM.generate` (a batch), and the server (`AsyncLLMEngine`, on its own thread).
"""

from __future__ import annotations

import logging
import os
import time

from tinyvllm.attention.kv_cache import (
    PagedKVCache,
    activation_bytes,
    kv_cache_budget,
    num_blocks_for_memory,
    resolve_kv_cache_dtype,
)
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.engine.beam_search import BeamSearchParams, BeamSearchRequests
from tinyvllm.engine.engine_state import StepLog, engine_state, engine_stats
from tinyvllm.engine.failures import RequestFailures, generator_states
from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.parent_request import ParentRequests
from tinyvllm.engine.request_state import RequestState
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import load_model
from tinyvllm.model.quantization import check_quantization
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.outputs import RequestMetrics, RequestOutput
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sample.sampler import make_generator
from tinyvllm.sample.sampling_batch import StepSampler
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger("tinyvllm.engine")


class LLMEngine:
    """Requests in (`add_request`), one step at a time (`step`), outputs out.

    Args:
        model: a .gguf file, an HF checkpoint directory, None for the default (SmolLM2-135M-Instruct), or a
            `LlamaForCausalLM` already loaded, with its `tokenizer` (tests and tutorials share one model).
        dtype: "auto" computes in float16 on a GPU and float32 on the CPU (tinyvllm/platforms.py).
        max_model_len: the longest sequence (default: the model's, at most what the KV blocks hold).
        block_size: tokens per KV cache block.
        kv_cache_memory: bytes for the KV cache, e.g. "2GiB" (default: 512MiB on the CPU, on a GPU what
            `gpu_memory_utilization`, vLLM's flag, default 0.9, leaves once the weights are loaded).
        max_num_seqs, max_num_batched_tokens: the most sequences, and tokens, in one step.
        device: the tinygrad device, e.g. "CPU", "CUDA" (default: tinygrad's choice).
        num_gpu_blocks_override: the number of KV blocks, instead of a budget (vLLM's flag).
        portable_attention: keep the portable paged attention instead of the kernels.
        scheduling_policy: "fcfs", or "priority": by each request's `priority` (lower first), preempting the lowest.
        enable_prefix_caching: reuse the K/V of prompt prefixes seen before (on by default, as in vLLM).
        kv_cache_dtype: "auto" (the model's), "float32", "float16", "int8" or "fp8" (e4m3), the last two scaled.
        quantization: "auto" keeps a GGUF's blocks, "none" dequantizes, "q8_0"/"q4_0"/"q4_1" quantize at load.
        speculative_config: vLLM's {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}.
        tensor_parallel_size, pipeline_parallel_size: devices each layer, or the stack of layers, is split over.
    """

    def __init__(self, model: str | os.PathLike | LlamaForCausalLM | None = None, *, tokenizer: Tokenizer | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, block_size: int = 16,
                 kv_cache_memory: str | int | None = None, gpu_memory_utilization: float | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 device: str | None = None, num_gpu_blocks_override: int | None = None,
                 portable_attention: bool = False, scheduling_policy: str = "fcfs", enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", quantization: str = "auto", speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        resolve_kv_cache_dtype(kv_cache_dtype)  # a bad name fails here, before the model loads
        if speculative_config is not None:  # speculative decoding (Phase 7b): imported where a config asks for it
            from tinyvllm.spec_decode.config import SpeculativeConfig
            from tinyvllm.spec_decode.speculator import Speculator
        spec = self.speculative_config = None if speculative_config is None else SpeculativeConfig.from_dict(
            speculative_config)
        check_quantization(quantization)
        if isinstance(model, LlamaForCausalLM):
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLMEngine(model, tokenizer=...)")
            self.model, self.tokenizer, self.model_path = model, tokenizer, None
        else:
            self.model, self.tokenizer, self.model_path = load_model(model, dtype, device, quantization,
                                                                     tensor_parallel_size=tensor_parallel_size,
                                                                     pipeline_parallel_size=pipeline_parallel_size)
        self.model_name = "model" if self.model_path is None else self.model_path.name
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        config = self.model.kv_cache_config  # the model's, with KV heads counted over every device (Phase 8)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.model.dtype)  # "auto": the model's
        if not num_gpu_blocks_override:  # the budget: given, or what the GPU's memory leaves (attention/kv_cache.py)
            logits_rows = min(max_num_batched_tokens, max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
            budget = kv_cache_budget(kv_cache_memory, gpu_memory_utilization, self.model.device,
                                     activation_bytes(config, max_num_batched_tokens, logits_rows))
        num_blocks = num_gpu_blocks_override or num_blocks_for_memory(config, block_size, budget, self.kv_cache_dtype)
        self.max_model_len = max_model_len or min(config.max_position_embeddings, num_blocks * block_size)
        if not 2 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}], got {self.max_model_len}")
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len)
        self.kv_cache = PagedKVCache(config, num_blocks, block_size, self.kv_cache_dtype,
                                     self.model.kv_cache_devices)
        self.scheduler = Scheduler(num_blocks, block_size, self.max_model_len, max_num_seqs, max_num_batched_tokens,
                                   eos_token_ids=self.tokenizer.stop_token_ids, policy=scheduling_policy,
                                   enable_prefix_caching=enable_prefix_caching)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, max_num_batched_tokens,
                                        max_num_seqs, portable_attention=portable_attention)
        self.speculator = None if spec is None else Speculator(
            spec, self.model_runner, self.model, self.tokenizer, max_model_len=self.max_model_len,
            num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, portable_attention=portable_attention, model_name=self.model_name)
        self._spec_output_start: dict[str, int] = {}  # this step: request id -> its output length before the step
        self.requests: dict[str, RequestState] = {}  # unfinished requests the scheduler knows, by request id
        self._pooled: list[RequestOutput] = []  # pooling requests this step finished, reported by step()
        self.parent_requests = ParentRequests()  # n > 1: the user's request id -> its n child requests
        self.beam_search = BeamSearchRequests(self.scheduler, self.tokenizer)  # beams: forks of one another
        self.failures = RequestFailures(self.requests, self.scheduler, self.beam_search)  # each ends alone
        self.sampler = StepSampler(self.tokenizer, self.requests, self.failures.fail)  # sample/sampling_batch.py
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
        if not isinstance(params, PoolingParams) and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")
        if not isinstance(params, (BeamSearchParams, PoolingParams)):
            self.inputs.check_params(params)
            text, prompt_ids = self.inputs.process_prompt(prompt)
            self.parent_requests.add(request_id, params, in_use=lambda rid: rid in self.requests,
                                     add_child=lambda rid, child: self._add_one(rid, text, prompt_ids, child, priority))
            return
        text, prompt_ids = self.inputs.process_prompt(prompt)
        if request_id in self.requests or request_id in self.parent_requests.parents or (
                request_id in self.beam_search.requests):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(params, BeamSearchParams):
            self.beam_search.add(request_id, text, prompt_ids, params, RequestMetrics(time.monotonic()))
        else:  # pooling: one prefill, no token
            self._add_one(request_id, text, prompt_ids, SamplingParams(max_tokens=1), priority, pooling=params)

    def _add_one(self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams,
                 priority: int = 0, pooling: PoolingParams | None = None) -> None:
        seq = Sequence(request_id, prompt_ids, params, prompt=text, priority=priority)
        seq.skip_reading_prefix_cache = pooling is not None or params.prompt_logprobs is not None
        generator = None if params.is_greedy else make_generator(params.seed)
        matcher = None if params.structured_outputs is None else self.sampler.structured_outputs.matcher(
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
        self.model_runner.lap(None)
        if self.speculator is not None:  # drafts for this step (seq.spec_token_ids), counted by the scheduler
            self.speculator.propose(self.scheduler.running, self.requests)
        scheduler_output = self.scheduler.schedule()
        self._record_scheduled(scheduler_output.scheduled_seqs)
        self.model_runner.lap("schedule")
        begun = self.step_log.begin(scheduler_output)
        rng_states = generator_states(scheduler_output, self.requests)
        try:
            sampled = self._run_and_sample(scheduler_output)
        except Exception as e:  # no request's own try caught it: the forward pass, or the batch's sampling
            sampled = self.failures.retry_in_parts(scheduler_output, rng_states, e, self._run_and_sample)
        new_token_seqs = self.scheduler.update_from_output(scheduler_output, sampled)
        self.model_runner.lap("bookkeeping")
        outputs = self._make_outputs(new_token_seqs) + self.beam_search.update()
        if self.speculator is not None:  # the proposer drops what it holds for sequences that stopped running
            self.speculator.free_stale(self.scheduler.running)
        self.step_log.end(begun, len(new_token_seqs))
        self.model_runner.lap("detokenize")
        return outputs

    def _record_scheduled(self, seqs: list[Sequence]) -> None:
        """The time each request is first scheduled: where its queue time ends (the server's metrics)."""
        now = time.monotonic()
        for seq in seqs:
            owner = self.requests.get(seq.seq_id) or self.beam_search.request_of.get(seq.seq_id)  # a beam's search
            if owner is not None and owner.metrics.first_scheduled_time is None:
                owner.metrics.first_scheduled_time = now

    @property
    def step_timer(self):
        """A StepTimer (engine/step_timer.py) that times each phase of a step, or None (the default: no timing)."""
        return self.model_runner.step_timer

    @step_timer.setter
    def step_timer(self, timer) -> None:
        if timer is not None and timer.device is None:
            timer.device = self.model.device  # it waits for the device before each reading (engine/step_timer.py)
        self.model_runner.step_timer = timer  # the runner times input preparation and the forward pass

    def _run_and_sample(self, scheduler_output) -> dict[int | str, int]:
        """Forward pass, then one token per sequence that caught up: the sampler (sample/sampling_batch.py) sends
        each row to the device's batched graph, or to the host reference sampler."""
        if not scheduler_output.scheduled_seqs:
            self.failures.fail_unschedulable(scheduler_output)
            return {}
        hidden_for = frozenset(seq.seq_id for seq in scheduler_output.scheduled_seqs
                               if (state := self.requests.get(seq.seq_id)) is not None and state.needs_hidden_states)
        output = self.model_runner.execute_model(scheduler_output, hidden_for)
        seqs, logits, spec_rows = output.sampled_seqs, output.logits, output.spec_logits_rows
        if hidden_for:
            self._take_hidden_states(output)
        if not seqs:
            return {}
        self.beam_search.record(seqs, logits)  # beams sample nothing: the beam search reads their log-probabilities
        batch = self.sampler.prepare(seqs, *logits.shape, verifying=spec_rows)
        self.model_runner.lap("bookkeeping")
        tokens = self.model_runner.sample(logits, *batch.device_params, batch.keys, batch.use_filters, batch.bitmask)
        self.model_runner.lap("forward")  # the sampler runs on the device: its token ids are the forward pass's end
        sampled = self.sampler.finish(seqs, batch, tokens, logits)
        if spec_rows:  # the tokens each verifying request emits (a list), and where its output stood before them
            for seq in self.speculator.verify(seqs, logits, tokens, spec_rows, scheduler_output, sampled,
                                              self.requests):
                self._spec_output_start[seq.seq_id] = seq.num_output_tokens
        return {seq_id: token for seq_id, token in sampled.items() if seq_id in self.requests}

    def _take_hidden_states(self, output) -> None:
        """Each request that needs every position takes its part of the step's final hidden states (count, D)
        (RequestState.record_hidden_states; one that fails there ends alone). A pooling request whose prompt is
        all computed ends here, without a token (its row's is dropped)."""
        for seq_id, hidden in output.hidden_states.items():
            if (state := self.requests.get(seq_id)) is not None:
                try:
                    state.record_hidden_states(hidden, self.model_runner.position_logits)
                except Exception as e:  # this request alone ends
                    self.failures.fail(state.seq, e)
        for seq in output.sampled_seqs:
            if (state := self.requests.get(seq.seq_id)) is not None and state.pooling is not None:
                self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                self._pooled.append(self.requests.pop(seq.seq_id).pooled_output(time.monotonic()))

    def _make_outputs(self, new_token_seqs: list[Sequence]) -> list[RequestOutput]:
        """Text for each new token, stop strings (the scheduler checked stop tokens and lengths), outputs."""
        now = time.monotonic()
        for seq in new_token_seqs:
            try:
                self.requests[seq.seq_id].add_new_tokens(now, self.tokenizer.stop_token_ids, self.scheduler.finish_seq,
                                                         self._spec_output_start.pop(seq.seq_id, None))
            except Exception as e:  # detokenizing or a stop string failed: this request alone ends
                self.failures.fail(seq, e)
        self._spec_output_start.clear()
        outputs = self.failures.outputs + self._pooled  # finished this step outside the normal path
        self.failures.outputs, self._pooled = [], []
        for seq in new_token_seqs:
            state = self.requests.get(seq.seq_id)
            if state is None:
                continue  # failed above
            if seq.is_finished:
                del self.requests[seq.seq_id]
            outputs.append(state.output())
        return self.parent_requests.merge(outputs)

    def get_state(self) -> dict:
        """A snapshot of the block pool, the queues and the last steps (engine_state.py), on the stepping thread."""
        return engine_state(self)

    def get_stats(self) -> dict:
        """The counters of the server's /metrics (tinyvllm/engine/engine_state.py)."""
        return engine_stats(self)
