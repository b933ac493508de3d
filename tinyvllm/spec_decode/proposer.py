"""The proposer interface: one `Draft` per `DraftRequest`, in order (docs/phases/07b-speculative-decoding.md)."""

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
    generator: np.random.Generator | None  # None when greedy
    max_drafts: int


@dataclass
class Draft:
    """What a proposer guessed for one request."""

    token_ids: list[int]  # 0 .. max_drafts tokens
    probs: Tensor | None = None  # (len(token_ids), vocab) q on the device; None: one-hot


class DraftRunner(Protocol):
    """What the draft model asks of a model runner."""

    def compute_logits(self, scheduler_output: SchedulerOutput):
        """One forward pass: the sequences that sample, and their rows of logits."""
        ...

    def sample(self, logits: Tensor, temperature: np.ndarray | None, top_k: np.ndarray | None,
               top_p: np.ndarray | None, min_p: np.ndarray | None, keys: np.ndarray | None,
               use_filters: bool) -> np.ndarray:
        """Each row's token (keys None: greedy)."""
        ...


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in the same order."""
        ...

    def free(self, seq_id: int | str) -> None:
        """Drop what it holds for a finished sequence."""
        ...
