"""The draft model proposer (vLLM's `draft_model` method): a cheaper model with the target's tokenizer decodes k
tokens of its own each step, and the target checks them all in its one forward pass.

Here the cheap model is the target itself, quantized: SmolLM2-135M in float32 as the target, the same checkpoint
in its Q4_1 blocks as the draft, ~6x fewer weight bytes per token (tinyvllm/model/quantization.py). They agree on
most tokens, so the target's float32 output comes at close to the quantized model's speed.

One step, for every request that speculates (k = num_speculative_tokens = 3):

    target tokens    t0 .. t9 t10 t11        (t10 t11: emitted by the last verify, not yet seen by the draft)
    draft catches up       feed t10 t11  -> logits -> d0       one forward pass over every request's catch-up
    draft decodes          feed d0       -> logits -> d1       k - 1 batched single-token steps
                           feed d1       -> logits -> d2
    proposed               d0 d1 d2      (d2 is never fed: if it is kept, the next catch-up feeds it)

On the first step a request speculates, its catch-up is the whole prompt (and any output), chunked by
max_num_batched_tokens as the engine's own prefill is.

Its own paged KV cache, under a second BlockManager. The draft runs on ModelRunner like the target (a second
runner over the draft model and a cache of its own; its graphs are captured once per token bucket), on a
"shadow" Sequence per request that holds the tokens the draft has fed and its own block table. Why not the
target's block ids: the target's blocks are shared (prefix caching) and written by requests that never speculate, so a draft cache under the same ids would hold, in a block the target reuses,
K/V that no draft computed; the draft would have to run on every token the target computes, or track which
blocks it wrote. A second block manager keeps the draft independent: its cache survives the target's
preemption, and the target's prefix cache never touches it. Its pool has as many blocks as the
target's, so the draft's cache costs its own bytes per token on top of kv_cache_memory (the same again for a
self-draft of the same architecture); no prefix caching in it (a prompt shared by n completions is fed once per
completion).

Rollback: what the draft has computed is its shadow sequence's tokens. Each step they are compared with the
request's tokens and everything after the first difference is dropped (num_computed_tokens moves back, emptied
blocks are freed): rejected drafts, or a request that was preempted and changed, leave no K/V that is used.

    draft fed       t0 .. t9 t10 t11 d0 d1            the target kept d0, rejected d1, emitted x
    request now     t0 .. t9 t10 t11 d0 x
    kept            t0 .. d0       -> catch-up feeds x

Sampling: a greedy request's drafts are the draft model's argmax (`Draft.probs` None). A request with
temperature > 0 draws its drafts from q, the draft's distribution after the request's temperature, min-p, top-k
and top-p (device_sampler's filters), with the request's own generator (seeded requests reproduce), and gets q
back as `Draft.probs` (k, vocab): exact rejection sampling accepts d_j with min(1, p(d_j) / q(d_j)).
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from tinyvllm.attention.kv_cache import PagedKVCache
from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.input_buffer import InputBuffer
from tinyvllm.jit import Jit
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.loader import load_model
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sample import device_sampler
from tinyvllm.sample.sampling_batch import SamplingRows
from tinyvllm.spec_decode.config import SpeculativeConfig
from tinyvllm.spec_decode.proposer import Draft, DraftRequest, DraftRunner


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """The draft's token ids must mean what the target's mean: same vocabulary (every id's bytes), same added and
    special tokens, same BOS/EOS and stop tokens. A ValueError names both models and the first difference."""
    def fail(what: str, a, b) -> None:
        raise ValueError(f"the draft model {draft_name} does not share the tokenizer of the target {target_name}: "
                         f"{what} differ ({a!r} against {b!r}); speculative decoding needs a draft with the "
                         f"target's tokenizer")

    if target.vocab_size != draft.vocab_size:
        fail("vocabulary sizes", target.vocab_size, draft.vocab_size)
    for token_id in range(target.vocab_size):
        if target.token_bytes(token_id) != draft.token_bytes(token_id):
            fail(f"the bytes of token {token_id}", target.token_bytes(token_id), draft.token_bytes(token_id))
    for what in ("added_tokens", "special_token_ids", "bos_token_id", "eos_token_id", "stop_token_ids",
                 "add_bos_token"):
        if getattr(target, what) != getattr(draft, what):
            fail(what, getattr(target, what), getattr(draft, what))


class DraftModelProposer:
    """The `Proposer` of the draft_model method (see proposer.py), built once by the engine with what it knows
    of the target.

    Args:
        config: a speculative_config with method "draft_model": the draft's checkpoint and its quantization.
        target_model: the target (the draft runs at its dtype, on its device, with as many logits per token).
        target_tokenizer: the target's, checked against the draft's (check_same_tokenizer).
        runner_class: the target's model runner's class (DraftRunner in proposer.py), which runs the draft too:
            the engine hands it in, so that speculative decoding does not import the engine package.
        num_blocks, block_size: the target's KV pool; the draft's own pool is as large.
        max_model_len: the target's; the draft must handle as many positions.
        max_num_batched_tokens, max_num_seqs: the step limits the draft's runner shares (its catch-up is chunked
            by the first).
        portable_attention: the draft's runner keeps the portable paged attention.
        target_name: the target's name, in the errors.
    """

    def __init__(self, config: SpeculativeConfig, target_model: LlamaForCausalLM, target_tokenizer: Tokenizer, *,
                 runner_class: type[DraftRunner], num_blocks: int, block_size: int, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, portable_attention: bool = False,
                 target_name: str = "(the target)"):
        if config.method != "draft_model" or config.model is None:
            raise ValueError(f"DraftModelProposer needs a speculative_config with method 'draft_model' and a "
                             f"'model', got method {config.method!r} and model {config.model!r}")
        self.k = config.num_speculative_tokens
        self.model, self.tokenizer, path = load_model(config.model, target_model.dtype, target_model.device,
                                                      config.quantization)
        self.model_name = path.name
        check_same_tokenizer(target_tokenizer, self.tokenizer, target_name, self.model_name)
        if self.model.config.vocab_size != target_model.config.vocab_size:
            raise ValueError(f"the draft model {self.model_name} has {self.model.config.vocab_size} logits per token, "
                             f"the target {target_name} {target_model.config.vocab_size}: they must be equal")
        if self.model.config.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model {self.model_name} handles {self.model.config.max_position_embeddings} "
                             f"positions, fewer than the engine's max_model_len ({max_model_len}): lower max_model_len")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache = PagedKVCache(self.model.config, num_blocks, block_size, self.model.dtype, self.model.device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.runner = runner_class(self.model, self.kv_cache, max_model_len, max_num_batched_tokens, max_num_seqs,
                                   portable_attention=portable_attention)
        self._seqs: dict[int | str, Sequence] = {}  # request id -> its shadow sequence: the tokens the draft fed
        self._sampler_jits: dict[tuple[int, bool], Jit] = {}  # per (rows, filters used)
        self._sampler_inputs: dict[tuple[int, bool], list[InputBuffer]] = {}

    # ---- the Proposer protocol ----

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = {r.seq.seq_id: [] for r in requests}
        probs: dict[int | str, list[Tensor]] = {r.seq.seq_id: [] for r in requests}
        active = [r for r in requests if r.max_drafts > 0]
        for r in active:
            self._catch_up_plan(r)
        # 1. catch up: every token the draft has not fed, in rounds of at most max_num_batched_tokens
        pending = list(active)
        while pending:  # each round makes progress: its first request always gets a token, or leaves `active`
            budget, scheduled, later = self.max_num_batched_tokens, [], []
            for r in pending:
                shadow = self._seqs[r.seq.seq_id]
                count = min(shadow.num_uncomputed_tokens, budget)
                if count == 0:
                    later.append(r)
                elif self._append_slots(shadow, count, requests):
                    scheduled.append((r, count))
                    budget -= count
                else:
                    active.remove(r)  # no room in the draft's pool: no drafts this step
            caught_up = self._run(scheduled, drafts, probs)
            done = {r.seq.seq_id for r in caught_up}
            pending = [r for r, _ in scheduled if r.seq.seq_id not in done] + later
        # 2. k - 1 single-token steps, each feeding the last draft of every request that wants more
        for j in range(1, self.k):
            scheduled = []
            for r in active:
                if len(drafts[r.seq.seq_id]) != j or r.max_drafts <= j:
                    continue
                shadow = self._seqs[r.seq.seq_id]
                shadow.prompt_token_ids.append(drafts[r.seq.seq_id][-1])
                if not self._append_slots(shadow, 1, requests):
                    shadow.prompt_token_ids.pop()
                    continue
                scheduled.append((r, 1))
            if not scheduled:
                break
            self._run(scheduled, drafts, probs)
        q = {seq_id: Tensor.stack(*rows) for seq_id, rows in probs.items() if rows}  # (num_drafts, vocab) each
        if q:
            Tensor.realize(*q.values())
        return [Draft(drafts[r.seq.seq_id], q.get(r.seq.seq_id)) for r in requests]

    def free(self, seq_id: int | str) -> None:
        shadow = self._seqs.pop(seq_id, None)
        if shadow is not None and shadow.block_table:
            self.block_manager.free(shadow)

    # ---- the draft's own sequences and blocks ----

    def _catch_up_plan(self, r: DraftRequest) -> None:
        """Point the shadow sequence at the request's tokens: K/V after the first token that differs from what the
        draft fed are dropped (rejected drafts, or tokens changed since) and will be fed again."""
        tokens = r.seq.all_token_ids
        shadow = self._seqs.get(r.seq.seq_id)
        if shadow is None:
            self._seqs[r.seq.seq_id] = Sequence(r.seq.seq_id, tokens)
            return
        fed = shadow.prompt_token_ids[:shadow.num_computed_tokens]
        n = min(len(fed), len(tokens) - 1)  # the last token is always fed (again, if need be): its logits give d0
        keep = n
        if fed[:n] != tokens[:n]:  # a rollback (rejected drafts), or tokens that changed: find the first difference
            keep = int(np.argmin(np.asarray(fed[:n]) == np.asarray(tokens[:n])))
        if keep < shadow.num_computed_tokens:
            shadow.num_computed_tokens = keep
            if shadow.block_table:
                self.block_manager.free_slots_after(shadow, keep)
        shadow.prompt_token_ids = list(tokens)

    def _append_slots(self, shadow: Sequence, count: int, requests: list[DraftRequest]) -> bool:
        """Room for `count` more tokens of `shadow`; when the pool is short, the draft K/V of sequences that are not
        speculating this step go first (finished or preempted ones whose free() has not come yet)."""
        if self.block_manager.append_slots(shadow, count) is not None:
            return True
        wanted = {r.seq.seq_id for r in requests}
        for seq_id in [s for s in self._seqs if s not in wanted]:
            self.free(seq_id)
        return self.block_manager.append_slots(shadow, count) is not None

    def _run(self, scheduled: list[tuple[DraftRequest, int]], drafts: dict, probs: dict) -> list[DraftRequest]:
        """One forward pass of the draft over `scheduled` (request, tokens to feed), then one draft token for each
        request whose fed tokens reached its last: returns those requests."""
        if not scheduled:
            return []
        shadows = [self._seqs[r.seq.seq_id] for r, _ in scheduled]
        output = SchedulerOutput(shadows, {s.seq_id: count for s, (_, count) in zip(shadows, scheduled)}, [])
        step = self.runner.compute_logits(output)
        for shadow, (_, count) in zip(shadows, scheduled):
            shadow.num_computed_tokens += count
        by_id = {r.seq.seq_id: r for r, _ in scheduled}
        caught_up = [by_id[s.seq_id] for s in step.sampled_seqs]
        if not caught_up:
            return []
        tokens, q = self._sample(step.logits, caught_up)
        for row, r in enumerate(caught_up):
            drafts[r.seq.seq_id].append(int(tokens[row]))
            if q is not None and not r.params.is_greedy:
                probs[r.seq.seq_id].append(q[row])
        return caught_up

    # ---- sampling the drafts ----

    def _sample(self, logits: Tensor, requests: list[DraftRequest]) -> tuple[np.ndarray, Tensor | None]:
        """Token ids (rows,) for the first len(requests) rows of `logits` (rows, vocab), and q (rows, vocab) in a
        buffer of its own when any of them samples (None when all are greedy: their q is one-hot)."""
        rows, vocab = logits.shape
        if all(r.params.is_greedy for r in requests):
            return self.runner.sample(logits, None, None, None, None, None, False), None
        batch = SamplingRows(rows, vocab)
        for row, r in enumerate(requests):
            if not r.params.is_greedy:
                batch.fill(row, r.params, r.generator)  # the request's own draws: seeded requests repeat
        arrays = (*batch.device_params, batch.keys)
        key = (rows, batch.use_filters)
        if key not in self._sampler_jits:
            self._sampler_jits[key] = Jit(self._sampler_graph(batch.use_filters))
            self._sampler_inputs[key] = [InputBuffer(a.shape, a.dtype, self.model.device) for a in arrays]
        inputs = [buf.write(a) for buf, a in zip(self._sampler_inputs[key], arrays)]
        tokens, q = self._sampler_jits[key](logits, *inputs)
        # the graph's output buffer is written again by its next call: q leaves in a copy of its own
        return tokens.numpy(), q.clone().realize()

    @staticmethod
    def _sampler_graph(use_filters: bool):
        def run(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                keys: Tensor) -> tuple[Tensor, Tensor]:
            """logits (S,V), params (S,), keys (S,2) -> tokens (S,) int32 and q (S,V) float32."""
            tokens, thresholds = device_sampler.draw(logits, temperature, top_k, top_p, min_p, keys, use_filters)
            # (S,V): the distribution the tokens were drawn from
            q = device_sampler.processed_logits(logits, temperature, thresholds if use_filters else None).softmax(-1)
            return tokens.realize(), q.realize()
        return run
