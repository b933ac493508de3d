"""Phase 1's engine: one request at a time, prefill then decode, streamed token by token.

    prompt --tokenize--> ids --prefill--> logits --sample--> token --decode--> logits --sample--> ...
                                                               |                                  |
                                                               +--> TextStream --> text deltas    +--> stop?

Stop conditions, checked after every sampled token, in vLLM's order:
  1. a stop token (the model's eos unless `ignore_eos`, plus `stop_token_ids`)   -> finish_reason "stop"
  2. a stop string in the text (the string itself is not emitted)               -> "stop"
  3. `max_tokens` reached, or the KV cache (max_model_len) full                  -> "length"

`stream()` is the one generator; `generate()` just joins it, so streaming and blocking calls can
never disagree.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tinyvllm.core.kv_cache import num_blocks_for_memory
from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
from tinyvllm.engine.paged_runner import PagedModelRunner
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.loader import load_model
from tinyvllm.sample.sampler import Sampler, make_generator
from tinyvllm.sampling_params import SamplingParams


@dataclass
class StreamChunk:
    """What one decode step adds to the output."""

    text: str  # newly printable text; may be '' (half a character, or held back for a stop string)
    token_id: int | None  # None for the final flush of held-back text
    finish_reason: str | None = None  # "stop" | "length" on the last chunk


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    time_to_first_token: float = 0.0  # seconds from the call to the first sampled token
    decode_time: float = 0.0  # seconds spent after the first token

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_time if self.decode_time > 0 else 0.0


KV_CACHES = ("paged", "contiguous")


class Generator:
    """kv_cache="paged" (Phase 2, the default): blocks of `block_size` tokens from a pool sized by
    `kv_cache_memory`; "contiguous" (Phase 1): max_model_len rows reserved up front."""

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "float32",
                 max_model_len: int | None = None, device: str | None = None, prefill_chunk_size: int = 32,
                 kv_cache: str = "paged", block_size: int = 16, kv_cache_memory: str | int = "512MiB"):
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model, self.tokenizer, self.model_path = load_model(model, dtype, device)
        limit = self.model.config.max_position_embeddings
        if max_model_len is not None and not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {max_model_len}")
        self.max_model_len = max_model_len or limit
        if kv_cache == "paged":
            num_blocks = num_blocks_for_memory(self.model.config, block_size, kv_cache_memory, self.model.dtype)
            self.runner = PagedModelRunner(self.model, self.max_model_len, num_blocks, block_size, prefill_chunk_size)
        else:
            self.runner = ContiguousModelRunner(self.model, self.max_model_len, prefill_chunk_size)
        self.sampler = Sampler()

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                return self.tokenizer.encode(text, add_special_tokens=False)
            return self.tokenizer.encode(prompt)
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt):
            raise ValueError(f"a token-id prompt must be a non-empty list of ints in [0, {self.tokenizer.vocab_size})")
        return list(prompt)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
               chat: bool = False, result: GenerationResult | None = None) -> Iterator[StreamChunk]:
        """Yield the output as it is generated. Pass `result` to have it filled in along the way."""
        params = sampling_params or SamplingParams()
        start = time.perf_counter()
        prompt_ids = self.encode_prompt(prompt, chat)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context is {self.max_model_len} "
                             f"tokens (max_model_len) and at least one must be left to generate")
        result = result if result is not None else GenerationResult(prompt_ids)
        result.prompt_token_ids = prompt_ids
        text = TextStream(self.tokenizer, params, prompt_ids)

        try:
            yield from self._decode_loop(prompt_ids, params, result, text, start)
        finally:
            self.runner.free()  # the paged cache gives the blocks back, however the stream ends

    def _decode_loop(self, prompt_ids: list[int], params: SamplingParams, result: GenerationResult,
                     text: TextStream, start: float) -> Iterator[StreamChunk]:
        max_tokens = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        eos_ids = self.tokenizer.stop_token_ids
        stop_ids = params.all_stop_token_ids(eos_ids)
        generator = None if params.is_greedy else make_generator(params.seed)
        logits = self.runner.prefill(prompt_ids)
        first_token_time = None
        while True:
            token = self.sampler(logits, params, prompt_ids, result.token_ids, generator, eos_ids)
            if first_token_time is None:
                first_token_time = time.perf_counter()
                result.time_to_first_token = first_token_time - start
            result.token_ids.append(token)
            finish_reason = None
            if token in stop_ids and len(result.token_ids) > params.min_tokens:
                finish_reason, delta = "stop", ""  # the stop token itself is not text
            else:
                delta, stopped = text.add(token)
                if stopped:
                    finish_reason = "stop"
                elif len(result.token_ids) >= max_tokens:
                    finish_reason = "length"
            if finish_reason is not None and text.stop_str is None:
                delta += text.finish()
            result.text = text.text
            result.decode_time = time.perf_counter() - first_token_time
            if finish_reason is not None:
                result.finish_reason = finish_reason
                yield StreamChunk(delta, token, finish_reason)
                return
            yield StreamChunk(delta, token)
            position = len(prompt_ids) + len(result.token_ids) - 1
            logits = self.runner.decode(token, position)

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                 chat: bool = False) -> GenerationResult:
        """Blocking: run the stream to its end and return everything at once."""
        result = GenerationResult([])
        for _ in self.stream(prompt, sampling_params, chat=chat, result=result):
            pass
        return result
