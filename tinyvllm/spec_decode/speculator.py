"""Speculative decoding's part of the model runner: `verify()` a step's drafts, then `propose()` the next step's
(docs/phases/07b-speculative-decoding.md)."""

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
    """May this request get drafts: it decodes one token the device sampler draws."""
    return (seq.num_uncomputed_tokens == 1 and not has_grammar and not params.uses_penalties
            and not params.logit_bias and params.logprobs is None and seq.num_output_tokens >= params.min_tokens)


class Speculator:
    """Built by the model runner from the engine's checked `speculative_config`."""

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
        self._drafts: dict[int | str, Draft] = {}  # for the next step
        self._holding: set[int | str] = set()  # seq_ids the proposer may hold state for

    # ---- after a step: the next step's drafts ----

    def propose(self, running: list[Sequence], input_batch) -> dict[int | str, list[int]]:
        """Each running sequence's drafts for the next step."""
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
        stale = self._holding - {seq.seq_id for seq in running}
        for seq_id in stale:
            self.proposer.free(seq_id)
        self._holding -= stale

    # ---- in a step: the drafts verified ----

    def verify(self, seqs: list[Sequence], logits: Tensor, tokens: np.ndarray, spec_rows: dict,
               scheduler_output: SchedulerOutput, sampled: dict, input_batch) -> dict[int | str, list[int]]:
        """The tokens each verifying sequence emits; logits (rows, V): sequence i at row i, its drafts at
        spec_rows[seq_id]."""
        requests = input_batch.requests
        verifying = [(row, seq) for row, seq in enumerate(seqs) if seq.seq_id in spec_rows and seq.seq_id in sampled]
        sampling = [(row, seq) for row, seq in verifying if not requests[seq.seq_id].params.is_greedy]
        emitted = self._rejection_sample(logits, sampling, spec_rows, scheduler_output, requests) if sampling else {}
        for row, seq in verifying:
            if seq.seq_id not in emitted:  # greedy
                targets = [int(tokens[row])] + [int(tokens[r]) for r in spec_rows[seq.seq_id]]
                emitted[seq.seq_id] = accept_greedy(scheduler_output.scheduled_spec_decode_tokens[seq.seq_id], targets)
        return {seq_id: tokens_out for seq_id, (tokens_out, _) in emitted.items()}

    def _rejection_sample(self, logits: Tensor, sampling: list[tuple[int, Sequence]], spec_rows: dict,
                          scheduler_output: SchedulerOutput, requests: dict) -> dict:
        """seq_id -> (emitted tokens, number accepted)."""
        rows, vocab = logits.shape
        batch = VerifyBatch(rows, vocab)  # as many rows as the logits: one graph per logits bucket
        row_index = np.zeros(rows, np.int32)
        for row, seq in sampling:
            drafts = scheduler_output.scheduled_spec_decode_tokens[seq.seq_id]  # the budget may have cut some
            first = batch.num_rows_used
            row_index[first:first + len(drafts) + 1] = [row] + spec_rows[seq.seq_id]
            state, probs = requests[seq.seq_id], self._drafts[seq.seq_id].probs
            # q goes through the host: gathering it on the device would cost a graph per layout of the requests
            batch.add(drafts, state.params, state.generator, None if probs is None else probs.numpy()[:len(drafts)])
        accepted, tokens = self.runner.rejection_sample(logits, row_index, batch)
        out = {}
        for (first, k), (_, seq) in zip(batch.spans, sampling):
            drafts = scheduler_output.scheduled_spec_decode_tokens[seq.seq_id]
            out[seq.seq_id] = emitted_tokens(drafts, accepted[first:first + k], tokens[first:first + k + 1])
        return out
