"""One step's sampling, row by row (Phase 4): each row's parameters, where it is sampled, and its grammar.

Every sequence that caught up in a step owns one row of the step's logits (rows, V). Most rows are sampled
together on the device, in one graph (`ModelRunner.sample` around device_sampler.py), from per-row parameters;
a row whose request needs what only the host reference sampler does (sampler.py: penalties, logit bias,
min_tokens, logprobs) gets its row of logits copied back and is sampled there:

    row  request                  routed to   temperature  top_k  top_p  min_p  key      bitmask
    0    greedy                   device      0            V      1      0      -        all ones
    1    T=0.8, top_p=0.9         device      0.8          V      0.9    0      drawn    all ones
    2    repetition_penalty=1.2   host        0 (unused on the device)                   all ones
    3    JSON schema              device      0            V      1      0      -        its grammar's
         padding rows             device      0            V      1      0      -        all ones

The keys come from each request's own generator (noise.py), one per row and step, so a seeded request draws
the same numbers whichever rows it shares a step with. Structured outputs mask both paths; once the token is
known, the request's grammar moves on by it (structured_output.py).

`SamplingRows` fills the per-row parameters the device sampler takes: the engine's step (`SamplingBatch`), the
verifier of speculative decoding (spec_decode/rejection_sampler.py's `VerifyBatch`) and the draft model
(spec_decode/draft_model.py) all fill their rows through it. vLLM v1 keeps the same arrays in its
`SamplingMetadata` (vllm/v1/sample/metadata.py), built by the runner's input batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tinyvllm.sample.noise import draw_keys
from tinyvllm.sample.sampler import Sampler, logprobs_of
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.core.sequence import Sequence
    from tinyvllm.model.tokenizer import Tokenizer
    from tinyvllm.sample.structured_output import StructuredOutputManager


class SamplingRows:
    """The device sampler's per-row inputs (device_sampler.draw): each row holds the "off" values until `fill`
    gives it a request's parameters. `temperature` is the value of the rows nobody fills: 0 (greedy) where they
    are sampled as greedy rows, 1 where they are padding that a formula divides by (the verifier's). The arrays
    are made by the first `fill`: until a row samples, every row is greedy, and the device's greedy graph takes
    none of them (they stay None, as `keys` does)."""

    def __init__(self, rows: int, vocab: int, temperature: float = 0.0):
        self.rows, self.vocab, self.off_temperature = rows, vocab, temperature
        self.temperature: np.ndarray | None = None  # (rows,) 0 = greedy
        self.top_k: np.ndarray | None = None  # (rows,) vocab = off
        self.top_p: np.ndarray | None = None  # (rows,) 1 = off
        self.min_p: np.ndarray | None = None  # (rows,) 0 = off
        self.keys: np.ndarray | None = None  # (rows, 2) uint32 each row's draw key (noise.py)

    def allocate(self) -> None:
        """Every row "off", with a key of zeros: the arrays a row's parameters are written into."""
        self.temperature = np.full(self.rows, self.off_temperature, np.float32)
        self.top_k = np.full(self.rows, self.vocab, np.int32)
        self.top_p = np.ones(self.rows, np.float32)
        self.min_p = np.zeros(self.rows, np.float32)
        self.keys = np.zeros((self.rows, 2), np.uint32)

    def fill(self, first: int, params: SamplingParams, generator: np.random.Generator, count: int = 1) -> None:
        """Rows first .. first + count - 1 sample with `params`: top_k clamped to the vocabulary (<= 0: off),
        and a draw key each from the request's own generator (count keys, drawn before any row changes), so
        a seeded request repeats."""
        keys = draw_keys(generator, count)  # (count, 2)
        if self.keys is None:
            self.allocate()
        rows = slice(first, first + count)
        self.temperature[rows] = params.temperature
        self.top_k[rows] = min(params.top_k, self.vocab) if params.top_k > 0 else self.vocab
        self.top_p[rows], self.min_p[rows] = params.top_p, params.min_p
        self.keys[rows] = keys

    @property
    def use_filters(self) -> bool:
        """Whether any row uses min-p, top-k or top-p (without them the sampler's graph skips the filters). No row
        filled: none does."""
        if self.keys is None:
            return False
        return bool((self.top_k < self.vocab).any() or (self.top_p < 1).any() or (self.min_p > 0).any())

    @property
    def device_params(self) -> tuple[np.ndarray | None, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p


class SamplingBatch(SamplingRows):
    """One engine step's sampling inputs: rows of greedy defaults until a request fills its own. keys exist once
    a row samples on the device (None: the greedy graph runs); bitmask (rows, ceil(vocab/32)) int32 once a row
    has a grammar; `on_host`: the rows the host reference sampler takes."""

    def __init__(self, rows: int, vocab: int):
        super().__init__(rows, vocab)
        self.bitmask: np.ndarray | None = None
        self.on_host: list[int] = []


def needs_host_sampler(seq: Sequence, params: SamplingParams) -> bool:
    """Whether a request's next token needs the host reference sampler (what the device sampler does not do)."""
    return (params.uses_penalties or bool(params.logit_bias) or params.logprobs is not None
            or seq.num_output_tokens < params.min_tokens)


class StepSampler:
    """The engine's sampling of a step's rows: `prepare` assembles the batch (parameters, keys, grammar masks, and
    which rows go to the host) before the device samples; `finish` takes the device's tokens, samples the host's
    rows and moves the grammars on. `requests`: the engine's request states by seq_id (their `params`,
    `generator`, `matcher` and `logprobs`); a sequence without one (a beam) keeps a greedy row whose token is
    unused. A request whose sampling fails ends alone: `fail(seq, error)` (the engine's), the batch goes on."""

    def __init__(self, tokenizer: Tokenizer, requests: dict, fail: Callable[[Sequence, Exception], None]):
        self.tokenizer, self.requests, self.fail = tokenizer, requests, fail
        self.stop_token_ids = tokenizer.stop_token_ids  # the model's: min_tokens bans them
        self.host_sampler = Sampler()
        self._structured_outputs: StructuredOutputManager | None = None

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammars' matchers and masks (structured outputs, Phase 9), built at the first request with one."""
        if self._structured_outputs is None:
            from tinyvllm.sample.structured_output import StructuredOutputManager

            self._structured_outputs = StructuredOutputManager(self.tokenizer)
        return self._structured_outputs

    def prepare(self, seqs: list[Sequence], rows: int, vocab: int, verifying: dict | tuple = ()) -> SamplingBatch:
        """Each row's sampling parameters, draw key and grammar mask, one request at a time: a request whose
        parameters fail here ends alone (its row stays greedy and its token is dropped). A sampled request that
        verifies drafts (`verifying`, seq_id -> its drafts' rows) stays greedy here too: rejection sampling
        draws its tokens (spec_decode/rejection_sampler.py)."""
        batch = SamplingBatch(rows, vocab)
        for row, seq in enumerate(seqs):
            state = self.requests.get(seq.seq_id)
            if state is None:
                continue  # a beam (its row stays greedy, its token unused)
            params = state.params
            try:
                if state.matcher is not None:
                    if batch.bitmask is None:
                        batch.bitmask = self.structured_outputs.allocate_bitmask(rows)
                    self.structured_outputs.fill_bitmask(state.matcher, batch.bitmask, row)
                if needs_host_sampler(seq, params):
                    batch.on_host.append(row)
                    continue
                if params.is_greedy or seq.seq_id in verifying:
                    continue
                batch.fill(row, params, state.generator)  # the host sampler draws its key the same way
            except Exception as e:  # one request's parameters must never fail the batch
                self.fail(seq, e)
        return batch

    def finish(self, seqs: list[Sequence], batch: SamplingBatch, tokens: np.ndarray, logits) -> dict[int | str, int]:
        """seq_id -> its token: the device's (tokens (rows,)) for the device's rows; for the host's rows, their row
        of `logits` (rows, V) copied back and sampled by the reference sampler. Then each grammar accepts its
        request's token."""
        sampled = {seq.seq_id: int(tokens[row]) for row, seq in enumerate(seqs) if row not in batch.on_host}
        host_logits = logits.numpy() if batch.on_host else None
        for row in batch.on_host:
            try:
                mask = None if batch.bitmask is None else batch.bitmask[row]
                sampled[seqs[row].seq_id] = self.sample_on_host(seqs[row], self.requests[seqs[row].seq_id],
                                                                host_logits[row], mask)
            except Exception as e:
                self.fail(seqs[row], e)
        for seq in seqs:  # the grammar moves on by the token just sampled
            state = self.requests.get(seq.seq_id)
            if state is not None and state.matcher is not None and seq.seq_id in sampled:
                try:
                    self.structured_outputs.accept(state.matcher, sampled[seq.seq_id])
                except Exception as e:
                    self.fail(seq, e)
        return sampled

    def sample_on_host(self, seq: Sequence, state, logits: np.ndarray, bitmask_row: np.ndarray | None = None) -> int:
        """One row on the host reference sampler, its grammar's mask applied; records the token's logprobs when
        the request asks for them."""
        allowed = logits
        if bitmask_row is not None:  # a grammar's (structured outputs, Phase 9)
            from tinyvllm.sample.structured_output import apply_bitmask_numpy

            allowed = apply_bitmask_numpy(logits, bitmask_row)
        token = self.host_sampler(allowed, state.params, seq.prompt_token_ids, seq.output_token_ids, state.generator,
                                  self.stop_token_ids)
        if state.params.logprobs is not None:  # of the model's own distribution, as vLLM's raw logprobs
            state.logprobs.append(logprobs_of(logits, token, state.params.logprobs))
        return token
