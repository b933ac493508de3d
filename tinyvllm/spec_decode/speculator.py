"""The speculator: speculative decoding's part of the model runner, in one place (vLLM v1 spreads it over the
runner's `propose_draft_token_ids`, its `RejectionSampler` and the scheduler's `update_draft_token_ids`).

    step N:  execute_model()  ->  speculator.verify()          ->  update_from_output()  ->  speculator.propose()
                                     |                                  |                        |
                         greedy: argmax comparison            appends the emitted tokens,   the drafts each running
                         sampled: rejection sampling          rolls back rejected drafts    request verifies in step
                         -> the tokens each request emits     (Scheduler._accept_spec...)   N + 1 (spec_token_ids)

The proposer drops what it holds for a request once it no longer runs (finished, aborted, preempted); the scheduler
keeps vLLM's counters (spec_decode_num_draft_tokens, ...).

Who speculates in a step: nobody when `disable_by_batch_size` or more requests are running (a large batch is no
longer bound by reading the weights: the drafts' extra rows cost compute, and the misses are wasted); otherwise
every running request that decodes one token (a prefill has nothing to draft after) and whose tokens come from
the device sampler. Not the others, each for a reason:

- penalties (repetition, frequency, presence): the target's distribution at draft j depends on the counts of the
  tokens before it, drafts included, so each verify row would need its own counts: not built.
- logit bias and min_tokens: the host reference sampler applies them (one row, one token a step).
- logprobs: each emitted token would need its logprobs from its row of the verify pass: not built.
- a grammar (structured outputs): the allowed tokens at draft j depend on the grammar state after d0 .. d(j-1),
  which needs a matcher that advances over the drafts and rolls back; not built.
- beams: the beam search picks their tokens from their log-probabilities.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.config import SpeculativeConfig
from tinyvllm.spec_decode.proposer import Draft, DraftRequest, Proposer
from tinyvllm.spec_decode.rejection_sampler import VerifyBatch, emitted_tokens
from tinyvllm.spec_decode.verify import accept_greedy


def speculates(seq: Sequence, params: SamplingParams, has_grammar: bool) -> bool:
    """Whether a running request may get drafts this step (see the module docstring for why not)."""
    return (seq.num_uncomputed_tokens == 1 and not has_grammar and not params.uses_penalties
            and not params.logit_bias and params.logprobs is None and seq.num_output_tokens >= params.min_tokens)


class Speculator:
    """Built by the model runner from the engine's `speculative_config`.

    Args:
        config: the checked speculative_config (method, num_speculative_tokens, ...).
        runner: the target's ModelRunner (its rejection sampling graphs).
        model, tokenizer: the target's (a draft model runs at its dtype, on its device, with the same tokenizer).
        max_model_len: the target's; no draft goes past it.
        num_blocks, block_size: the target's KV pool (a draft model's own pool is as large).
        max_num_batched_tokens, max_num_seqs: the target's step limits, which a draft model's runner shares.
        portable_attention: the draft model's runner keeps the portable paged attention too.
        model_name: the target's name, for the error that a draft with another tokenizer gets.
    """

    def __init__(self, config: SpeculativeConfig, runner, model, tokenizer, *, max_model_len: int, num_blocks: int,
                 block_size: int, max_num_batched_tokens: int, max_num_seqs: int, portable_attention: bool = False,
                 model_name: str = "(the target)"):
        self.config, self.runner, self.max_model_len = config, runner, max_model_len
        if config.method == "ngram":
            from tinyvllm.spec_decode.ngram_proposer import NgramProposer
            self.proposer: Proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                                    config.prompt_lookup_max)
        else:  # "draft_model"; imported here so that ngram never loads it
            from tinyvllm.spec_decode.draft_model import DraftModelProposer
            self.proposer = DraftModelProposer(config, model, tokenizer, runner_class=type(runner),
                                               num_blocks=num_blocks, block_size=block_size,
                                               max_model_len=max_model_len,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               max_num_seqs=max_num_seqs, portable_attention=portable_attention,
                                               target_name=model_name)
        self._drafts: dict[int | str, Draft] = {}  # the drafts proposed for the next step, by seq_id
        self._holding: set[int | str] = set()  # seq_ids the proposer has been asked about (it may hold state)

    # ---- after a step: the next step's drafts ----

    def propose(self, running: list[Sequence], input_batch) -> dict[int | str, list[int]]:
        """The drafts each running sequence verifies next step (the scheduler counts them in its
        num_tokens_with_spec). `input_batch`: the runner's (each request's parameters and generator). Never more
        drafts than could be kept: max_tokens and max_model_len bound the run."""
        self.free_stale(running)
        self._drafts.clear()
        asks = []
        disabled = self.config.disable_by_batch_size is not None and len(running) >= self.config.disable_by_batch_size
        for seq in running:
            state = input_batch.requests.get(seq.seq_id)
            if disabled or state is None or not speculates(seq, state.params, seq.grammar is not None):
                continue
            limit = self.max_model_len - seq.num_tokens  # the drafts' positions must fit
            if state.params.max_tokens is not None:  # the target adds one token after the drafts
                limit = min(limit, state.params.max_tokens - seq.num_output_tokens - 1)
            asks.append(DraftRequest(seq, state.params, state.generator, max(limit, 0)))
        for ask, draft in zip(asks, self.proposer.propose(asks) if asks else [], strict=True):
            assert len(draft.token_ids) <= ask.max_drafts, f"{len(draft.token_ids)} drafts, at most {ask.max_drafts}"
            self._drafts[ask.seq.seq_id] = draft
            self._holding.add(ask.seq.seq_id)
        return {seq_id: list(draft.token_ids) for seq_id, draft in self._drafts.items()}

    def free_stale(self, running: list[Sequence]) -> None:
        """The proposer lets go of every sequence that no longer runs (finished, aborted, failed, preempted)."""
        stale = self._holding - {seq.seq_id for seq in running}
        for seq_id in stale:
            self.proposer.free(seq_id)
        self._holding -= stale

    # ---- in a step: the drafts verified ----

    def verify(self, seqs: list[Sequence], logits: Tensor, tokens: np.ndarray, spec_rows: dict,
               scheduler_output: SchedulerOutput, sampled: dict, input_batch) -> dict[int | str, list[int]]:
        """The tokens each verifying sequence emits (the scheduler appends them). logits (rows, V): the target's,
        sequence i at row i, the drafts at spec_rows[seq_id]; tokens (rows,): the device sampler's argmax of every
        row a greedy request owns; `sampled`: the step's tokens (a request that failed has none)."""
        requests = input_batch.requests
        verifying = [(row, seq) for row, seq in enumerate(seqs) if seq.seq_id in spec_rows and seq.seq_id in sampled]
        sampling = [(row, seq) for row, seq in verifying if not requests[seq.seq_id].params.is_greedy]
        emitted = self._rejection_sample(logits, sampling, spec_rows, scheduler_output, requests) if sampling else {}
        for row, seq in verifying:
            if seq.seq_id not in emitted:  # greedy: the target's argmax after the last sampled token and each draft
                targets = [int(tokens[row])] + [int(tokens[r]) for r in spec_rows[seq.seq_id]]
                emitted[seq.seq_id] = accept_greedy(scheduler_output.scheduled_spec_decode_tokens[seq.seq_id], targets)
        return {seq_id: tokens_out for seq_id, (tokens_out, _) in emitted.items()}

    def _rejection_sample(self, logits: Tensor, sampling: list[tuple[int, Sequence]], spec_rows: dict,
                          scheduler_output: SchedulerOutput, requests: dict) -> dict:
        """Exact rejection sampling (rejection_sampler.py) for the sampled requests, one graph on the device:
        seq_id -> (emitted tokens, number accepted)."""
        rows, vocab = logits.shape
        # as many verify rows as the logits have (they are a subset of them): one graph per logits bucket
        batch = VerifyBatch(rows, vocab)
        row_index = np.zeros(rows, np.int32)  # which row of the logits each verify row reads
        for row, seq in sampling:
            drafts = scheduler_output.scheduled_spec_decode_tokens[seq.seq_id]  # the budget may have cut some
            first = batch.num_rows_used
            row_index[first:first + len(drafts) + 1] = [row] + spec_rows[seq.seq_id]
            state, probs = requests[seq.seq_id], self._drafts[seq.seq_id].probs
            # NOTE: q goes through the host (one (k, V) copy per request): rows of a device tensor could be
            # gathered on the device instead, at the cost of a graph per layout of the step's requests
            batch.add(drafts, state.params, state.generator, None if probs is None else probs.numpy()[:len(drafts)])
        accepted, tokens = self.runner.rejection_sample(logits, row_index, batch)
        out = {}
        for (first, k), (_, seq) in zip(batch.spans, sampling):
            drafts = scheduler_output.scheduled_spec_decode_tokens[seq.seq_id]
            out[seq.seq_id] = emitted_tokens(drafts, accepted[first:first + k], tokens[first:first + k + 1])
        return out
