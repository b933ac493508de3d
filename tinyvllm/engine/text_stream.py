"""From sampled token ids to the text a user sees, one token at a time.

    token ids --IncrementalDetokenizer--> text pieces --StopStringChecker--> text safe to show
    (UTF-8 safe: a character split across tokens     (a stop string split across pieces is found;
     is emitted only once it is whole)                text that may start one is held back)
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyvllm.model.detokenizer import IncrementalDetokenizer
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sample.stop import StopStringChecker
from tinyvllm.sampling_params import SamplingParams


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_token_ids)
        self.stop_checker = StopStringChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one sampled token; return (new text to show, whether a stop string ended the output)."""
        piece = self.detokenizer.add(token_id)
        stopped = False
        if self.stop_checker is not None:
            piece, stopped = self.stop_checker.feed(piece)
        self.text += piece
        return piece, stopped

    def finish(self) -> str:
        """The output ended for another reason: release any text held back for a possible stop string."""
        rest = self.stop_checker.flush() if self.stop_checker is not None and not self.stop_checker.stopped else ""
        self.text += rest
        return rest

    @property
    def stop_str(self) -> str | None:
        return self.stop_checker.stop_str if self.stop_checker is not None else None
