"""Structured outputs: every sampled token keeps the output inside a grammar (a JSON schema, a regex, one of
a list of choices, or a Lark grammar), so the text always parses.

The grammar work is done by llguidance (https://github.com/guidance-ai/llguidance), the library llama.cpp
and vLLM use: for a request's output so far, its matcher computes which tokens may come next, as a bitmask
of the vocabulary: bit t % 32 of int32 word t // 32 is set when token t is allowed (about 0.1 ms a row:
it walks a token trie, not 49,152 strings). The engine applies the mask to the logits before sampling:

    matcher (one per constrained request)     bitmask (rows, ceil(V / 32)) int32     device sampler
      output so far --fill_bitmask(row)--> [ 0xffffffff | 0x00010400 | ... ] --> logits[~allowed] = -inf
            ^                                all ones for unconstrained rows          --> token
            +------------------------------------- accept(token) <--------------------------+

Rows without a grammar get all-ones masks, and a batch with no constrained row builds no mask at all.
When the grammar is complete the matcher allows only the end-of-sequence token, so the request stops
as it would on its own eos (a `max_tokens` cap can still cut it first, as in vLLM).
"""

from __future__ import annotations

import json
import re

import numpy as np

from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sampling_params import StructuredOutputsParams


# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. Flexible whitespace would let
# a model pad forever (nothing bounds a run of spaces or newlines); a schema's own "x-guidance" options win.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint (exactly one of its fields is set)."""
    from llguidance import LLMatcher

    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from e
    if params.json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(re.escape(choice) for choice in params.choice))
    return LLMatcher.grammar_from_lark(params.grammar)


class _VocabularyView:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every token's bytes and how text encodes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_special_tokens=False)


class StructuredOutputManager:
    """One per engine: the tokenizer's trie (built once, ~1 s, on the first constrained request) and a matcher
    per request."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            stops = sorted(self.tokenizer.stop_token_ids)  # a finished grammar allows these (the model's eos)
            self._ll_tokenizer = LLTokenizer(TokenizerWrapper(_VocabularyView(self.tokenizer)), eos_token=stops)
        return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for a request; a grammar that does not compile is a ValueError naming why."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, grammar_of(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """(rows, ceil(V / 32)) int32, all tokens allowed."""
        return np.full((rows, -(-self.vocab_size // 32)), -1, dtype=np.int32)

    @staticmethod
    def fill_bitmask(matcher, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, row)
        if matcher.is_error():
            raise RuntimeError(f"structured output matcher failed: {matcher.get_error()}")

    @staticmethod
    def accept(matcher, token_id: int) -> None:
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"token {token_id} does not fit the grammar: {matcher.get_error()}")


def apply_bitmask_numpy(logits: np.ndarray, bitmask_row: np.ndarray) -> np.ndarray:
    """The host twin of the device mask: logits (V,) with every token whose bit is clear set to -inf."""
    vocab = logits.shape[0]
    bits = (bitmask_row.reshape(-1, 1) >> np.arange(32, dtype=np.int32)) & 1  # (W, 32)
    allowed = bits.reshape(-1)[:vocab].astype(bool)
    return np.where(allowed, logits, -np.inf)
