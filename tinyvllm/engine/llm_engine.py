"""The engine every entry point runs on (Phase 3; vLLM v1's `LLMEngine`, v1/engine/llm_engine.py).

    add_request --InputProcessor--> token ids, checked --> EngineCore (scheduler + model runner)
    step():  EngineCore.step() --EngineCoreOutputs--> OutputProcessor --RequestOutputs--> the caller
                                                      (text, stop strings: those requests are aborted in the core)
"""

from __future__ import annotations

import os
import time

from tinyvllm.config import EngineConfig
from tinyvllm.core.outputs import EngineCoreOutput
from tinyvllm.engine.arg_utils import EngineArgs
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.engine_state import engine_state, engine_stats
from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.parent_request import ParentRequests
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import load_model
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.outputs import RequestMetrics, RequestOutput
from tinyvllm.plugins import provided
from tinyvllm.sampling_params import SamplingParams


class LLMEngine:
    """Requests in (`add_request`), one step at a time (`step`), outputs out. `model`: a .gguf, an HF directory, None
    (the default model) or a loaded `LlamaForCausalLM` with its `tokenizer`; other keywords are `EngineArgs`'."""

    def __init__(self, model: str | os.PathLike | LlamaForCausalLM | None = None, *,
                 tokenizer: Tokenizer | None = None, config: EngineConfig | None = None, **engine_args):
        loaded = isinstance(model, LlamaForCausalLM)
        if config is None:
            config = EngineArgs(model=None if loaded else model, **engine_args).create_engine_config()
        if loaded:
            if tokenizer is None:
                raise ValueError("an already loaded model needs its tokenizer: LLMEngine(model, tokenizer=...)")
            self.model, self.tokenizer, self.model_path = model, tokenizer, None
        else:
            mc, pc = config.model_config, config.parallel_config
            self.model, self.tokenizer, self.model_path = load_model(
                mc.model, mc.dtype, config.device_config.device, mc.quantization,
                tensor_parallel_size=pc.tensor_parallel_size, pipeline_parallel_size=pc.pipeline_parallel_size,
                mmproj=mc.mmproj)
        self.model_name = "model" if self.model_path is None else self.model_path.name
        self.engine_core = EngineCore(config, self.model, self.tokenizer, self.model_name)
        self.config = self.engine_core.config  # with the KV cache's size and the context length filled in
        mc = self.config.model_config
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self._multimodal_processor(),
                                              mc.max_logprobs, mc.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parent_requests = ParentRequests()  # n > 1: the user's request id -> its n child requests
        self._beam_search = None  # beam searches (Phase 7a), built at the first one

    def _multimodal_processor(self):
        tower = getattr(self.model, "vision_tower", None)
        if tower is None:
            return None
        return provided("multimodal_inputs")(self.tokenizer, tower, self.scheduler.encoder_cache_manager.cache_size,
                                             self.config.model_config.max_images_per_prompt)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(config=engine_args.create_engine_config())

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # what the engine core holds, for its dashboard, benchmarks and tests (nothing here writes through them)
    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def model_runner(self):
        return self.engine_core.model_runner

    @property
    def kv_cache(self):
        return self.engine_core.model_runner.kv_cache

    # ---- requests in ----

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params=None, priority: int = 0) -> None:
        """Queue a prompt (text, token ids, or vLLM's prompt dict). Bad input raises ValueError and changes nothing;
        `priority`: lower is served first; `params`: SamplingParams, BeamSearchParams or PoolingParams."""
        params = params or SamplingParams()
        request = self.input_processor.process(request_id, prompt, params, priority, self._in_use)
        if request.beam_search is not None:
            self.beam_search.add(request_id, request.prompt, request.prompt_token_ids, request.beam_search,
                                 RequestMetrics(request.arrival_time))
            return
        share_prompt = self.config.cache_config.enable_prefix_caching and request.params.prompt_logprobs is None
        self.parent_requests.add(request_id, request.params, in_use=self._in_use, share_prompt=share_prompt,
                                 add_child=lambda rid, child: self._add_to_core(rid, request, child))

    def _add_to_core(self, request_id: str, request, params: SamplingParams) -> None:
        grammar, request.grammar = request.grammar or self.input_processor.grammar(params), None  # each its own
        self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids, params,
                                          request.arrival_time)
        self.engine_core.add_request(request_id, request.prompt_token_ids, params, priority=request.priority,
                                     arrival_time=request.arrival_time, pooling_params=request.pooling_params,
                                     grammar=grammar, mm_features=request.mm_features)

    def _in_use(self, request_id: str) -> bool:
        return (request_id in self.output_processor.request_states or request_id in self.parent_requests.parents
                or (self._beam_search is not None and request_id in self._beam_search.requests))

    @property
    def beam_search(self):
        if self._beam_search is None:
            from tinyvllm.engine.beam_search import BeamSearchRequests

            self._beam_search = BeamSearchRequests(
                lambda rid, prompt_ids, params: self.engine_core.add_request(rid, prompt_ids, params),
                self.engine_core.abort_requests, self.tokenizer, self.max_model_len)
        return self._beam_search

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (all n completions, or all beams); its blocks are free when this returns."""
        if self._beam_search is not None and self._beam_search.abort(request_id):
            return
        request_ids = self.parent_requests.request_ids(request_id)
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)
        self.parent_requests.forget(request_id)
        self.parent_requests.release_pending(request_id)  # one completion alone: the others need not wait for it

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        core_outputs: list[EngineCoreOutput] = self.engine_core.step()
        beam_outputs = []
        if self._beam_search is not None:
            core_outputs, beam_outputs = self._beam_search.take(core_outputs)
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(core_outputs)
        self.engine_core.abort_requests(reqs_to_abort)  # a stop string, or a failure in the text
        outputs = self.parent_requests.merge(request_outputs) + beam_outputs
        self.model_runner.lap("detokenize")
        return outputs

    @property
    def step_timer(self):
        """A StepTimer (engine/step_timer.py) that times each phase of a step, or None (the default: no timing)."""
        return self.model_runner.step_timer

    @step_timer.setter
    def step_timer(self, timer) -> None:
        if timer is not None and timer.device is None:
            timer.device = self.model.device  # it waits for the device before each reading (engine/step_timer.py)
        self.model_runner.step_timer = timer

    def get_state(self) -> dict:
        """A snapshot of the block pool, the queues and the last steps (engine_state.py), on the stepping thread."""
        return engine_state(self)

    def get_stats(self) -> dict:
        """The counters of the server's /metrics (tinyvllm/engine/engine_state.py)."""
        return engine_stats(self)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer
