"""From what a caller gives `add_request` to what the engine core takes: the prompt's token ids and the request's
parameters, checked against the model (vLLM v1's `InputProcessor`, vllm/v1/engine/input_processor.py, does the same
before a request reaches its engine core)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.plugins import provided
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class ProcessedRequest:
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # a pooling request's: one step that samples nothing
    priority: int
    arrival_time: float
    pooling_params: object | None = None  # PoolingParams (Phase 9)
    beam_search: object | None = None  # BeamSearchParams (Phase 7a)
    grammar: object | None = None  # the compiled grammar (structured outputs), for the first completion
    mm_features: list = field(default_factory=list)  # Phase 10


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, multimodal=None, max_logprobs: int = MAX_LOGPROBS,
                 seed: int = 0):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.seeds = np.random.default_rng(seed)  # vLLM's --seed: an unseeded random request's seed comes from here
        self.max_logprobs = tokenizer.vocab_size if max_logprobs == -1 else max_logprobs  # ModelConfig's
        self.multimodal = multimodal  # Phase 10's MultiModalProcessor
        self._structured_outputs = None  # the grammars' compiler (Phase 9), built at the first request with one

    def process(self, request_id: str, prompt: str | list[int], params, priority: int,
                in_use: Callable[[str], bool]) -> ProcessedRequest:
        """Check everything about a request that can be checked before it runs: a ValueError says what is wrong."""
        arrival_time = time.monotonic()
        if isinstance(params, SamplingParams):
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")
            self.check_params(params)
            text, prompt_ids, mm_features = self.process_prompt_dict(prompt)
            grammar = self.grammar(params)  # one that does not compile: ValueError, nothing added
            if params.seed is None and not params.is_greedy:  # the same requests after a restart: the same text
                params = dataclasses.replace(params, seed=int(self.seeds.integers(2**63)))
            return ProcessedRequest(text, prompt_ids, params, priority, arrival_time, grammar=grammar,
                                    mm_features=mm_features)
        text, prompt_ids, mm_features = self.process_prompt_dict(prompt)
        if mm_features:
            raise ValueError("images are taken by generation requests (SamplingParams) only")
        if in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = provided("pooling_params")  # Phase 9's embeddings: PoolingParams
        if pooling is not None and isinstance(params, pooling):  # one prefill, no token
            return ProcessedRequest(text, prompt_ids, SamplingParams(max_tokens=1), 0, arrival_time,
                                    pooling_params=params)
        beam_search = provided("beam_search_params")  # Phase 7a: BeamSearchParams
        if beam_search is None or not isinstance(params, beam_search):
            raise ValueError(f"params must be SamplingParams, BeamSearchParams or PoolingParams, "
                             f"got {type(params).__name__}")
        return ProcessedRequest(text, prompt_ids, SamplingParams(), 0, arrival_time, beam_search=params)

    def process_prompt_dict(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], list]:
        """`process_prompt` of vLLM's prompt dicts too (with images: their features)."""
        if not isinstance(prompt, dict):
            return *self.process_prompt(prompt), []
        if "multi_modal_data" not in prompt:
            if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & set(prompt):
                raise ValueError(f"a prompt dict has 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            return *self.process_prompt(prompt.get("prompt", prompt.get("prompt_token_ids"))), []
        if self.multimodal is None:
            raise ValueError("multi_modal_data: this model takes no images (load a vision-language checkpoint, "
                             "such as an Idefics3 / SmolVLM directory)")
        text, prompt_ids, features = self.multimodal.process(prompt)
        return text, self.process_prompt(prompt_ids)[1], features

    def process_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text, or None when it came as token ids; its token ids). It must leave room for output."""
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

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids in this model's vocabulary, logprobs within
        max_logprobs (vLLM's wording; -1 counts as the vocabulary)."""
        vocab = self.tokenizer.vocab_size
        self.num_logprobs("sample", params.logprobs)
        self.num_logprobs("prompt", params.prompt_logprobs)
        for field_name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{field_name} must be token ids in [0, {vocab}) for this model, got {bad[:5]}")

    def num_logprobs(self, kind: str, k: int | None) -> int | None:
        """How many alternatives a `kind` ("sample" or "prompt") logprobs request means (-1: the vocabulary);
        a ValueError in vLLM's words when that is more than max_logprobs."""
        k = self.tokenizer.vocab_size if k == -1 else k
        if k and k > self.max_logprobs:
            raise ValueError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: "
                             f"{self.max_logprobs}")
        return k

    def grammar(self, params: SamplingParams):
        """A fresh compiled grammar for one request's output (structured outputs), or None; ValueError if the
        grammar does not compile."""
        if params.structured_outputs is None:
            return None
        if self._structured_outputs is None:
            from tinyvllm.sample.structured_output import StructuredOutputManager

            self._structured_outputs = StructuredOutputManager(self.tokenizer)
        return self._structured_outputs.matcher(params.structured_outputs)
