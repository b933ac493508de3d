"""Prompt lookup decoding (vLLM's `ngram` method; Saxena 2023): the draft copies what followed the earliest earlier
occurrence of the longest recurring suffix (docs/phases/07b-speculative-decoding.md, section 5).

    tokens:  def area ( r ) : return 3.14 * r * r  ...  def area ( r ) :
                                                        `-------------' the last 5 tokens (n = 5)
             `-------------' found here first    -> propose "return 3.14 * r" (k = 4)
"""

from __future__ import annotations

import numpy as np

from tinyvllm.spec_decode.proposer import Draft, DraftRequest


def find_ngram_drafts(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens after the earliest match of the longest recurring suffix (n in [min_n, max_n]); [] if none."""
    if k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:num - 1], n)  # (num - n, n): n-grams before it
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """The ngram `Proposer`: stateless between steps."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(find_ngram_drafts(r.seq.all_token_ids, min(self.k, r.max_drafts), self.min_n, self.max_n))
                for r in requests]

    def free(self, seq_id: int | str) -> None:
        pass  # no per-sequence state
