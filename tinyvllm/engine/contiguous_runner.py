"""Running the model for one sequence on a contiguous KV cache: prefill, decode, and `generate` (Phase 1)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from tinygrad import Tensor, UOp

from tinyvllm.attention.contiguous import ContiguousAttentionMetadata, allocate_contiguous_kv_cache
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.input_buffer import InputBuffer
from tinyvllm.jit import Jit
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sample.sampler import Sampler, make_generator
from tinyvllm.sampling_params import SamplingParams


class ContiguousModelRunner:
    def __init__(self, model: LlamaForCausalLM, max_model_len: int, prefill_chunk_size: int = 32):
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model, self.max_model_len = model, max_model_len
        self.prefill_chunk_size = min(prefill_chunk_size, max_model_len)
        self.kv_caches = allocate_contiguous_kv_cache(model.config, max_model_len, dtype=model.dtype,
                                                      device=model.device)
        # a variable's range must keep every slice in bounds: a chunk starting at s writes rows s .. s+chunk-1
        self.v_start_pos = UOp.variable("start_pos", 0, max_model_len - 1)
        self.v_chunk_start = UOp.variable("chunk_start", 0, max_model_len - self.prefill_chunk_size)
        self._prefill_jit = Jit(self._forward)
        self._decode_jit = Jit(self._forward)
        # the token ids each graph reads, refilled in place every step (see tinyvllm/input_buffer.py)
        self._chunk_ids = InputBuffer((1, self.prefill_chunk_size), np.int32, model.device)
        self._token_id = InputBuffer((1, 1), np.int32, model.device)

    def _forward(self, input_ids: Tensor, start_pos: int | UOp) -> Tensor:
        """input_ids: (1,T) at positions start_pos.. -> logits of the last token (1, vocab), float32."""
        T = input_ids.shape[1]
        positions = (Tensor.arange(T) + start_pos).reshape(1, T)
        hidden = self.model(input_ids, positions, self.kv_caches, ContiguousAttentionMetadata(start_pos))
        return self.model.compute_logits(hidden[:, -1]).realize()

    def free(self) -> None:
        """Nothing to give back: the rows stay reserved for the next sequence."""

    def prefill(self, token_ids: list[int]) -> np.ndarray:
        """Fill the cache with the whole prompt; returns the last token's logits (vocab,)."""
        n = len(token_ids)
        if not 0 < n < self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; it must have 1 to {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len}, one position is kept for the first output token)")
        chunk = self.prefill_chunk_size
        num_chunked = n // chunk * chunk if n > 1 else 0
        logits = None
        for start in range(0, num_chunked, chunk):
            input_ids = self._chunk_ids.write(token_ids[start:start + chunk])
            logits = self._prefill_jit(input_ids, self.v_chunk_start.bind(start))
        for pos in range(num_chunked, n):
            logits = self._decode_logits(token_ids[pos], pos)
        return logits.numpy()[0]

    def decode(self, token_id: int, position: int) -> np.ndarray:
        """Feed one token at `position` (its K/V are appended to the cache); returns its logits (vocab,)."""
        if not 0 <= position < self.max_model_len:
            raise ValueError(f"position {position} is outside the KV cache (max_model_len {self.max_model_len})")
        return self._decode_logits(token_id, position).numpy()[0]

    def _decode_logits(self, token_id: int, position: int) -> Tensor:
        return self._decode_jit(self._token_id.write(token_id), self.v_start_pos.bind(position))


def generate(runner: ContiguousModelRunner, tokenizer: Tokenizer, prompt_token_ids: list[int],
             params: SamplingParams) -> Iterator[tuple[int, str]]:
    """Phase 1's whole engine (llama2.c's loop): prefill, then sample and decode until a stop -> (token, text)."""
    sampler = Sampler()
    generator = None if params.is_greedy else make_generator(params.seed)
    stream = TextStream(tokenizer, params, prompt_token_ids)
    stop_ids = params.all_stop_token_ids(tokenizer.stop_token_ids)
    output: list[int] = []
    logits = runner.prefill(prompt_token_ids)
    while True:
        token = sampler(logits, params, prompt_token_ids, output, generator, tokenizer.stop_token_ids)
        output.append(token)
        position = len(prompt_token_ids) + len(output) - 1  # where this token's K/V go when it is decoded
        if token in stop_ids:  # the sampler banned them until min_tokens were out
            yield token, stream.finish()  # a stop token's own text is not shown
            return
        piece, stopped = stream.add(token)
        done = stopped or len(output) == params.max_tokens or position + 1 >= runner.max_model_len
        yield token, piece + (stream.finish() if done and not stopped else "")
        if done:
            return
        logits = runner.decode(token, position)
