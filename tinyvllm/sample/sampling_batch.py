"""One step's sampling, row by row: parameters, device or host sampler, grammar mask
(docs/phases/04-batched-forward.md, section 6)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tinyvllm.sample.noise import draw_keys
from tinyvllm.sample.sampler import Sampler, full_logprobs, logprobs_of
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.core.sequence import Sequence

logger = logging.getLogger("tinyvllm.engine")


class SamplingRows:
    """The device sampler's per-row inputs, "off" until `fill`."""

    def __init__(self, rows: int, vocab: int, temperature: float = 0.0):
        self.rows, self.vocab, self.off_temperature = rows, vocab, temperature
        self.temperature: np.ndarray | None = None  # (rows,) 0 = greedy
        self.top_k: np.ndarray | None = None  # (rows,) vocab = off
        self.top_p: np.ndarray | None = None  # (rows,) 1 = off
        self.min_p: np.ndarray | None = None  # (rows,) 0 = off
        self.keys: np.ndarray | None = None  # (rows, 2) uint32

    def allocate(self) -> None:
        """Every row "off", with a key of zeros."""
        self.temperature = np.full(self.rows, self.off_temperature, np.float32)
        self.top_k = np.full(self.rows, self.vocab, np.int32)
        self.top_p = np.ones(self.rows, np.float32)
        self.min_p = np.zeros(self.rows, np.float32)
        self.keys = np.zeros((self.rows, 2), np.uint32)

    def fill(self, first: int, params: SamplingParams, generator: np.random.Generator, count: int = 1) -> None:
        """`count` rows from `first` sample with `params`, keys drawn from `generator`."""
        keys = draw_keys(generator, count)  # before any row changes
        if self.keys is None:
            self.allocate()
        rows = slice(first, first + count)
        self.temperature[rows] = params.temperature
        self.top_k[rows] = min(params.top_k, self.vocab) if params.top_k > 0 else self.vocab
        self.top_p[rows], self.min_p[rows] = params.top_p, params.min_p
        self.keys[rows] = keys

    @property
    def use_filters(self) -> bool:
        """Whether any row uses min-p, top-k or top-p."""
        if self.keys is None:
            return False
        return bool((self.top_k < self.vocab).any() or (self.top_p < 1).any() or (self.min_p > 0).any())

    @property
    def device_params(self) -> tuple[np.ndarray | None, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p


class SamplingBatch(SamplingRows):
    """One step's sampling inputs (keys None: greedy); bitmask (rows, ceil(vocab/32)) once a row has a grammar."""

    def __init__(self, rows: int, vocab: int):
        super().__init__(rows, vocab)
        self.bitmask: np.ndarray | None = None
        self.on_host: list[int] = []  # the rows the host sampler takes


def needs_host_sampler(seq: Sequence, params: SamplingParams) -> bool:
    """Whether a request's next token needs the host reference sampler."""
    return (params.uses_penalties or bool(params.logit_bias) or params.logprobs is not None
            or seq.num_output_tokens < params.min_tokens)


def failure_message(error: BaseException) -> str:
    return f"the engine failed while running this request: {type(error).__name__}: {error}"


class StepSampler:
    """`prepare` the batch before the device samples; `finish` with the host's rows and the grammars."""

    def __init__(self, input_batch, stop_token_ids: Iterable[int], on_device: bool = True):
        self.input_batch = input_batch
        self.on_device = on_device
        self.stop_token_ids = list(stop_token_ids)  # the model's
        self.host_sampler = Sampler()

    def prepare(self, seqs: list[Sequence], rows: int, vocab: int, verifying: dict | tuple,
                failed: dict) -> SamplingBatch:
        """Each row's parameters, key and grammar mask; a request whose parameters fail ends alone."""
        batch = SamplingBatch(rows, vocab)
        device_rows, batch_rows = [], []
        for row, seq in enumerate(seqs):
            state = self.input_batch.requests[seq.seq_id]
            try:
                if seq.grammar is not None:
                    from tinyvllm.sample.structured_output import StructuredOutputManager

                    if batch.bitmask is None:
                        batch.bitmask = np.full((rows, -(-vocab // 32)), -1, dtype=np.int32)  # all allowed
                    StructuredOutputManager.fill_bitmask(seq.grammar, batch.bitmask, row)
                if not self.on_device or needs_host_sampler(seq, state.params):
                    batch.on_host.append(row)
                elif not state.params.is_greedy and seq.seq_id not in verifying:
                    batch_rows.append(state.row)
                    device_rows.append(row)
                    if batch.keys is None:
                        batch.allocate()
                    batch.keys[row] = draw_keys(state.generator, 1)[0]
            except Exception as e:  # one request's parameters must never fail the batch
                fail(failed, seq, e)
        if device_rows:
            ib = self.input_batch
            batch.temperature[device_rows] = ib.temperature[batch_rows]
            batch.top_k[device_rows], batch.top_p[device_rows] = ib.top_k[batch_rows], ib.top_p[batch_rows]
            batch.min_p[device_rows] = ib.min_p[batch_rows]
        return batch

    def finish(self, seqs: list[Sequence], batch: SamplingBatch, tokens: np.ndarray, logits,
               failed: dict, logprobs: dict) -> dict[int | str, int]:
        """seq_id -> its token: the device's `tokens` (rows,), or the host sampler's."""
        sampled = {seq.seq_id: int(tokens[row]) for row, seq in enumerate(seqs)
                   if row not in batch.on_host and seq.seq_id not in failed}
        host_logits = logits.numpy() if batch.on_host else None
        for row in batch.on_host:
            seq = seqs[row]
            if seq.seq_id in failed:
                continue
            try:
                mask = None if batch.bitmask is None else batch.bitmask[row]
                sampled[seq.seq_id] = self.sample_on_host(seq, host_logits[row], mask, logprobs)
            except Exception as e:
                fail(failed, seq, e)
        for seq in seqs:
            if seq.grammar is not None and seq.seq_id in sampled:
                from tinyvllm.sample.structured_output import StructuredOutputManager

                try:
                    StructuredOutputManager.accept(seq.grammar, sampled[seq.seq_id])
                except Exception as e:
                    del sampled[seq.seq_id]
                    fail(failed, seq, e)
        return sampled

    def sample_on_host(self, seq: Sequence, logits: np.ndarray, bitmask_row: np.ndarray | None,
                       logprobs: dict) -> int:
        """One row on the host sampler; records the logprobs asked for (-1: the whole row)."""
        state = self.input_batch.requests[seq.seq_id]
        allowed = logits
        if bitmask_row is not None:
            from tinyvllm.sample.structured_output import apply_bitmask_numpy

            allowed = apply_bitmask_numpy(logits, bitmask_row)
        params = state.params
        token = self.host_sampler(allowed, params, seq.prompt_token_ids, seq.output_token_ids, state.generator,
                                  self.stop_token_ids)
        if params.logprobs == -1:  # beam search
            logprobs[seq.seq_id] = [full_logprobs(logits)]
        elif params.logprobs is not None:  # of the raw distribution, as vLLM's
            logprobs[seq.seq_id] = [logprobs_of(logits, token, params.logprobs)]
        return token


def fail(failed: dict, seq: Sequence, error: Exception) -> None:
    """Record that `seq`'s request failed: it alone ends."""
    logger.exception("request %s failed in the engine step; the other requests go on", seq.seq_id, exc_info=error)
    failed[seq.seq_id] = failure_message(error)
