"""From what a caller gives `add_request` to what the scheduler takes: the prompt's token ids, checked against
the model (vLLM v1's `InputProcessor`, vllm/v1/engine/input_processor.py, does the same before a request
reaches its engine core). Bad input raises ValueError here, before anything is added."""

from __future__ import annotations

from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

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
        """What SamplingParams cannot check alone: token ids must be in this model's vocabulary."""
        vocab = self.tokenizer.vocab_size
        for field_name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{field_name} must be token ids in [0, {vocab}) for this model, got {bad[:5]}")
