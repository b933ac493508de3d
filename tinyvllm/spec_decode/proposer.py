"""What a proposer is: the interface between the speculator and whatever guesses the draft tokens, one `Draft` per
`DraftRequest`, in order (docs/phases/07b-speculative-decoding.md).

    NgramProposer       (ngram_proposer.py)   copies the tokens that followed an earlier occurrence of the
                                              request's last n tokens; deterministic, no model: probs None
    DraftModelProposer  (draft_model.py)      a smaller (or more quantized) model decodes k tokens of its own,
                                              sampling them as the request would: probs = its distribution q
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tinygrad import Tensor

from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """One running request that may speculate this step."""

    seq: Sequence
    params: SamplingParams  # temperature 0: greedy; else the draft samples with the request's filters
    generator: np.random.Generator | None  # the request's own (None when greedy): seeded requests reproduce
    max_drafts: int  # at most this many drafts (max_tokens / max_model_len leave no room for more)


@dataclass
class Draft:
    """What a proposer guessed for one request."""

    token_ids: list[int]  # 0 .. max_drafts proposed tokens
    # (len(token_ids), vocab) float32 on the model's device: the q each draft was drawn from (after the request's
    # filters); None for a deterministic proposer, whose q is one-hot at the token
    probs: Tensor | None = None


class DraftRunner(Protocol):
    """What the draft model asks of a model runner."""

    def compute_logits(self, scheduler_output: SchedulerOutput):
        """One forward pass over the scheduled tokens: the sequences that sample, and their rows of logits."""
        ...

    def sample(self, logits: Tensor, temperature: np.ndarray | None, top_k: np.ndarray | None,
               top_p: np.ndarray | None, min_p: np.ndarray | None, keys: np.ndarray | None,
               use_filters: bool) -> np.ndarray:
        """Each row's token, sampled on the device (keys None: every row greedy)."""
        ...


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in the same order."""
        ...

    def free(self, seq_id: int | str) -> None:
        """The sequence finished, was aborted or preempted: drop what the proposer holds for it."""
        ...
