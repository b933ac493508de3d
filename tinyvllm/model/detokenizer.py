r"""Streaming detokenization: one token id in, the text it completes out, never half a UTF-8 character.

Taught in docs/phases/01-appendix-tokens-and-sampling.md.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tinyvllm.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, never emitting half a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # the generated ones, not the prompt
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        # until the text begins, sentencepiece's first space is the dummy prefix, dropped
        self._started = False
        for token_id in prompt_token_ids:  # the prompt's text is not ours to emit: decode it and drop it
            self._decode_next(token_id)

    def _decode_next(self, token_id: int) -> str:
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        token_bytes = self.tokenizer.token_bytes(token_id)
        new_text = self._utf8.decode(token_bytes)
        if not self._started and token_bytes:
            new_text = self.tokenizer.strip_dummy_prefix(new_text)
            self._started = True
        return new_text

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is unfinished)."""
        self.token_ids.append(token_id)
        new_text = self._decode_next(token_id)
        self._pieces.append(new_text)
        return new_text

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)
