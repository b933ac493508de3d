"""Exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for requests that sample: it emits what p would.

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j))      (u_j ~ U[0,1): accept when u_j q_j(d_j) < p_j(d_j))
    at the first rejection: emit a token drawn from norm(max(0, p_j - q_j)), the run ends
    all k accepted: emit a bonus token drawn from p_k              (q = 0 on the bonus row: the same formula)

Proof and worked numbers: docs/phases/07b-speculative-decoding.md, section 3.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

from tinyvllm.sample import noise
from tinyvllm.sample.device_sampler import draw, processed_logits
from tinyvllm.sample.sampling_batch import SamplingRows
from tinyvllm.sampling_params import SamplingParams

NO_DRAFT = -1  # draft_token_ids on a bonus row (and on padding rows): q is 0 there


def rejection_sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                     draft_token_ids: Tensor, uniforms: Tensor, keys: Tensor, draft_probs: Tensor | None = None,
                     use_filters: bool = True) -> tuple[Tensor, Tensor]:
    """(accepted (R,), tokens (R,)) over each draft's row then the bonus row; draft_token_ids (R,) NO_DRAFT on bonus
    rows; draft_probs (R,V) q, or None: one-hot at the draft."""
    vocab = logits.shape[1]
    # p as the device sampler draws from it, filtered tokens exactly 0
    thresholds = draw(logits, temperature, top_k, top_p, min_p, keys)[1] if use_filters else None  # (R,1)
    p = processed_logits(logits, temperature, thresholds).softmax(-1)
    is_draft = Tensor.arange(vocab, dtype=dtypes.int32).reshape(1, vocab) == draft_token_ids.reshape(-1, 1)  # (R,V)
    q = is_draft.where(1.0, 0.0) if draft_probs is None else draft_probs  # (R,V)
    p_draft = is_draft.where(p, 0.0).sum(-1)  # (R,) p(d), 0 on bonus rows
    q_draft = is_draft.where(q, 0.0).sum(-1)  # (R,) q(d)
    accepted = uniforms * q_draft < p_draft  # u < p/q without dividing by q
    residual = (p - q).maximum(0.0)  # (R,V), = p on a bonus row
    # p == q up to rounding: nothing left (a rejection is then ~impossible), sample from p
    residual = (residual.sum(-1, keepdim=True) > 0).where(residual, p)
    # exponential race: argmax(r / c), c ~ Exp(1), picks i with probability r_i / sum(r)
    tokens = (residual / noise.exponential_clocks(keys, vocab)).argmax(-1).cast(dtypes.int32)
    return accepted, tokens


class VerifyBatch(SamplingRows):
    """The host's inputs to `rejection_sample` for one step, padded to `rows`."""

    def __init__(self, rows: int, vocab: int):
        super().__init__(rows, vocab, temperature=1.0)
        self.allocate()
        self.draft_token_ids = np.full(rows, NO_DRAFT, np.int32)  # (rows,)
        self.uniforms = np.ones(rows, np.float32)  # (rows,) U[0,1)
        self.draft_probs: np.ndarray | None = None  # (rows, vocab) q, once a request has one
        self.spans: list[tuple[int, int]] = []  # per request: (first row, number of drafts)
        self.num_rows_used = 0

    def add(self, draft_token_ids: list[int], params: SamplingParams, generator: np.random.Generator,
            draft_probs: np.ndarray | None = None) -> None:
        """One request's k drafts: k + 1 rows (its drafts', then the bonus row)."""
        k, first = len(draft_token_ids), self.num_rows_used
        assert first + k + 1 <= self.rows, f"{first + k + 1} verify rows do not fit in {self.rows}"
        self.draft_token_ids[first:first + k] = draft_token_ids
        self.uniforms[first:first + k] = generator.random(k)
        self.fill(first, params, generator, count=k + 1)
        if draft_probs is not None and self.draft_probs is None:  # the first q: earlier requests get one-hot rows
            self.draft_probs = np.zeros((self.rows, self.vocab), np.float32)
            drafted = np.flatnonzero(self.draft_token_ids[:first] != NO_DRAFT)
            self.draft_probs[drafted, self.draft_token_ids[drafted]] = 1.0
        if self.draft_probs is not None:  # the bonus row stays 0
            if draft_probs is None:
                self.draft_probs[np.arange(first, first + k), draft_token_ids] = 1.0
            else:
                self.draft_probs[first:first + k] = draft_probs
        self.spans.append((first, k))
        self.num_rows_used += k + 1

    def inputs(self) -> tuple[np.ndarray, ...]:
        """rejection_sample's inputs after the logits, in order."""
        q = () if self.draft_probs is None else (self.draft_probs,)
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.draft_token_ids, self.uniforms,
                self.keys, *q)


def emitted_tokens(draft_token_ids: list[int], accepted: np.ndarray, tokens: np.ndarray) -> tuple[list[int], int]:
    """(emitted tokens, drafts accepted) from one request's accepted (k,) and tokens (k + 1,)."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and accepted[num_accepted]:
        num_accepted += 1
    return list(draft_token_ids[:num_accepted]) + [int(tokens[num_accepted])], num_accepted
