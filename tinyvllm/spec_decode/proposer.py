"""What a proposer is: the interface between the speculator and whatever guesses the draft tokens.

Each step the speculator hands the proposer the running requests that may speculate (one `DraftRequest` each) and
gets back one `Draft` per request, in the same order. Two proposers implement it:

    NgramProposer       (ngram_proposer.py)   copies the tokens that followed an earlier occurrence of the
                                              request's last n tokens; deterministic, no model: probs None
    DraftModelProposer  (draft_model.py)      a smaller (or more quantized) model decodes k tokens of its own,
                                              sampling them as the request would: probs = its distribution q

The drafts' distribution q is what exact rejection sampling (rejection_sampler.py) needs for requests with
temperature > 0: draft d_j is kept with probability min(1, p(d_j) / q(d_j)). A deterministic proposer's q is
one-hot at the token it proposed, so `probs=None` stands for it without a (k, vocab) tensor of zeros and ones.
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

    seq: Sequence  # its tokens so far: seq.all_token_ids; seq.seq_id; seq.block_table
    params: SamplingParams  # temperature 0 = greedy; else the draft samples with the same temperature/top_k/top_p/min_p
    generator: np.random.Generator | None  # the request's own generator (None when greedy): seeded requests reproduce
    max_drafts: int  # at most this many drafts (max_tokens / max_model_len leave no room for more)


@dataclass
class Draft:
    """What a proposer guessed for one request."""

    token_ids: list[int]  # 0 .. max_drafts proposed tokens
    # (len(token_ids), vocab) float32 on the model's device: the distribution q each draft token was drawn from
    # (after the request's sampling filters); None for a deterministic proposer (ngram: q is one-hot at the token)
    probs: Tensor | None = None


class DraftRunner(Protocol):
    """What the draft model asks of a model runner. The engine hands in its runner's class (ModelRunner,
    tinyvllm/worker/model_runner.py), built as `runner_class(model, kv_cache, max_model_len, max_num_batched_tokens,
    max_num_seqs, portable_attention=...)`, so that speculative decoding never imports the engine package back."""

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
