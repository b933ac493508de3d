"""The draft model proposer (vLLM's `draft_model`): a cheaper model with the target's tokenizer decodes k tokens each
step on its own KV cache and BlockManager, through a shadow Sequence per request rolled back to the request's
tokens (docs/phases/07b-speculative-decoding.md, section 5)."""

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
    """ValueError unless the draft's token ids mean what the target's do (bytes, added, special, BOS/EOS, stops)."""
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
    """The draft_model `Proposer`; its KV pool is as large as the target's."""

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
        self._seqs: dict[int | str, Sequence] = {}  # request id -> shadow sequence
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
        while pending:  # each round's first request gets a token or leaves `active`
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
        """Point the shadow at the request's tokens, dropping K/V from the first token that differs."""
        tokens = r.seq.all_token_ids
        shadow = self._seqs.get(r.seq.seq_id)
        if shadow is None:
            self._seqs[r.seq.seq_id] = Sequence(r.seq.seq_id, tokens)
            return
        fed = shadow.prompt_token_ids[:shadow.num_computed_tokens]
        n = min(len(fed), len(tokens) - 1)  # the last token is always fed: its logits give d0
        keep = n
        if fed[:n] != tokens[:n]:  # rejected drafts: keep up to the first difference
            keep = int(np.argmin(np.asarray(fed[:n]) == np.asarray(tokens[:n])))
        if keep < shadow.num_computed_tokens:
            shadow.num_computed_tokens = keep
            if shadow.block_table:
                self.block_manager.free_slots_after(shadow, keep)
        shadow.prompt_token_ids = list(tokens)

    def _append_slots(self, shadow: Sequence, count: int, requests: list[DraftRequest]) -> bool:
        """Room for `count` more tokens; when short, first free the shadows not speculating this step."""
        if self.block_manager.append_slots(shadow, count) is not None:
            return True
        wanted = {r.seq.seq_id for r in requests}
        for seq_id in [s for s in self._seqs if s not in wanted]:
            self.free(seq_id)
        return self.block_manager.append_slots(shadow, count) is not None

    def _run(self, scheduled: list[tuple[DraftRequest, int]], drafts: dict, probs: dict) -> list[DraftRequest]:
        """One draft forward pass over `scheduled` (request, count); returns the requests that got a draft token."""
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
        """(tokens (rows,), q (rows, vocab) in its own buffer, or None when all are greedy)."""
        rows, vocab = logits.shape
        if all(r.params.is_greedy for r in requests):
            return self.runner.sample(logits, None, None, None, None, None, False), None
        batch = SamplingRows(rows, vocab)
        for row, r in enumerate(requests):
            if not r.params.is_greedy:
                batch.fill(row, r.params, r.generator)
        arrays = (*batch.device_params, batch.keys)
        key = (rows, batch.use_filters)
        if key not in self._sampler_jits:
            self._sampler_jits[key] = Jit(self._sampler_graph(batch.use_filters))
            self._sampler_inputs[key] = [InputBuffer(a.shape, a.dtype, self.model.device) for a in arrays]
        inputs = [buf.write(a) for buf, a in zip(self._sampler_inputs[key], arrays)]
        tokens, q = self._sampler_jits[key](logits, *inputs)
        return tokens.numpy(), q.clone().realize()  # the graph's next call overwrites its output

    @staticmethod
    def _sampler_graph(use_filters: bool):
        def run(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                keys: Tensor) -> tuple[Tensor, Tensor]:
            """logits (S,V), params (S,), keys (S,2) -> tokens (S,) int32 and q (S,V) float32."""
            tokens, thresholds = device_sampler.draw(logits, temperature, top_k, top_p, min_p, keys, use_filters)
            q = device_sampler.processed_logits(logits, temperature, thresholds if use_filters else None).softmax(-1)
            return tokens.realize(), q.realize()
        return run
