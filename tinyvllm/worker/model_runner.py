"""One forward pass over everything a step scheduled: decode tokens and prefill chunks, flattened (Phase 4).

    input_ids     [ a5 | b9 | c0 c1 c2 c3 c4 | pad pad pad ]        (1, N)  N = 8, the bucket
    positions     [ 5  | 9  | 0  1  2  3  4  | 0   0   0   ]        (1, N)
    slot_mapping  [ sa5| sb9| sc0 ...    sc4 | null null null ]     (N,)   padding writes the null block
    block_tables  one row per token: its sequence's blocks           (N, max_blocks_per_seq)
    logits_indices[ 0, 1, 6, 0 ]  the last token of each sequence    (S,)   only these rows reach lm_head

Taught in docs/phases/04-batched-forward.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tinygrad import Tensor, UOp, dtypes

from tinyvllm.attention.paged import attention_metadata as portable_attention_metadata
from tinyvllm.attention.kv_cache import (
    PagedKVCache,
    activation_bytes,
    kv_cache_budget,
    num_blocks_for_memory,
    resolve_kv_cache_dtype,
)
from tinyvllm.core.block_manager import slot_mapping as get_slot_mapping
from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.core.scheduler import SchedulerOutput
from tinyvllm.core.sequence import Sequence
from tinyvllm.device_memory import ReadBack
from tinyvllm.input_buffer import InputBuffer
from tinyvllm.jit import Eager, Jit
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.sample.sampling_batch import StepSampler, fail
from tinyvllm.plugins import provided
from tinyvllm.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.tokenizer import Tokenizer


persisted_graph = provided("persisted_graph", lambda *args: None)  # Phase 6: graphs kept on disk
attention_metadata = provided("attention_metadata", portable_attention_metadata)  # Phase 5: the paged kernels
device_sampler = provided("device_sampler")  # Phase 4: the batch sampled on the device; before it, on the host


@dataclass
class ForwardOutput:
    """What one forward pass computed. logits (R, V) on the device: row i is sampled_seqs[i]'s next token, then the
    drafts' rows (spec_logits_rows), then padding."""

    sampled_seqs: list[Sequence]
    logits: Tensor | None  # None when no sequence caught up
    # seq_id -> the rows of `logits` at its drafts' positions
    spec_logits_rows: dict[int | str, list[int]] = field(default_factory=dict)
    # seq_id in `hidden_for` -> its tokens' final hidden states, (count, D) on the host
    hidden_states: dict[int | str, np.ndarray] = field(default_factory=dict)


def size_kv_cache(config: EngineConfig, model: LlamaForCausalLM) -> tuple[int, int]:
    """(number of KV blocks, max_model_len): the blocks the budget (given, or the memory left) holds, and the
    context length asked for, else the model's, at most what the blocks hold."""
    cc, sc, arch = config.cache_config, config.scheduler_config, model.kv_cache_config
    num_blocks = cc.num_gpu_blocks_override
    if not num_blocks:
        logits_rows = min(sc.max_num_batched_tokens, sc.max_num_seqs * (1 + config.num_speculative_tokens))
        budget = kv_cache_budget(cc.kv_cache_memory, cc.gpu_memory_utilization, model.device,
                                 activation_bytes(arch, sc.max_num_batched_tokens, logits_rows))
        num_blocks = num_blocks_for_memory(arch, cc.block_size, budget,
                                           resolve_kv_cache_dtype(cc.cache_dtype, model.dtype))
    max_model_len = config.max_model_len or min(arch.max_position_embeddings, num_blocks * cc.block_size)
    if not 2 <= max_model_len <= arch.max_position_embeddings:
        raise ValueError(f"max_model_len must be in [2, {arch.max_position_embeddings}], got {max_model_len}")
    return num_blocks, max_model_len


def buckets_up_to(limit: int) -> list[int]:
    """1, 2, 4, ... and `limit` itself."""
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


class ModelRunner:
    """Runs a step (`execute_model`): the model over its scheduled tokens, one captured graph per shape bucket,
    and the sampling on the device. `portable_attention`: no kernels."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, portable_attention: bool = False,
                 eos_token_ids: Iterable[int] = (), enforce_eager: bool = False):
        self.model, self.kv_cache = model, kv_cache
        self.capture = Eager if enforce_eager else Jit  # how each step's function is run: a captured graph, or not
        self.max_model_len = max_model_len
        self.block_size = kv_cache.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.token_buckets = buckets_up_to(max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.portable_attention = portable_attention
        self.v_num_blocks = UOp.variable("num_blocks", 1, self.max_blocks_per_seq)
        self._jits: dict[tuple[int, int], Jit] = {}  # per (token bucket, rows of logits)
        self._sampler_jits: dict[tuple, Jit] = {}  # per (rows, filters used / "greedy", masked)
        self._token_inputs: dict[int, tuple[InputBuffer, ...]] = {}
        self._logits_indices: dict[int, InputBuffer] = {}
        self._sampler_inputs: dict[tuple, list[InputBuffer]] = {}
        self._sampler_outputs: dict[tuple, ReadBack] = {}
        self._bound_num_blocks: dict[int, UOp] = {}
        self._normed: Tensor | None = None  # the last hidden-state step's final hidden states (N, D)
        self._token_rows: dict[int | str, tuple[int, int]] = {}  # seq_id -> (first row, rows) in _normed
        self.input_batch = InputBatch(max_num_seqs, model.config.vocab_size)
        self.sampler = StepSampler(self.input_batch, eos_token_ids, on_device=device_sampler is not None)
        self.speculator = None  # Phase 7b, when configured
        self.step_timer = None  # a StepTimer while profiling
        self.encoder = None  # Phase 10, with a vision tower
        self._mm_buffers: dict[int, tuple[InputBuffer, ...]] = {}
        self.mm_prefix_lm = False  # do an image's tokens attend to each other both ways (Gemma 3)?
        if getattr(model, "vision_tower", None) is not None:
            from tinyvllm.worker.encoder_runner import EncoderRunner

            self.encoder = EncoderRunner(model.vision_tower)
            self.mm_prefix_lm = model.vision_tower.is_mm_prefix_lm

    @classmethod
    def from_config(cls, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer,
                    model_name: str = "(the target)") -> ModelRunner:
        """The runner of an engine, its KV cache sized and allocated."""
        num_blocks, max_model_len = size_kv_cache(config, model)
        cc, sc = config.cache_config, config.scheduler_config
        kv_cache = PagedKVCache(model.kv_cache_config, num_blocks, cc.block_size,
                                resolve_kv_cache_dtype(cc.cache_dtype, model.dtype), model.kv_cache_devices)
        portable = config.device_config.portable_attention
        runner = cls(model, kv_cache, max_model_len, sc.max_num_batched_tokens, sc.max_num_seqs, portable,
                     tokenizer.stop_token_ids, config.model_config.enforce_eager)
        if config.speculative_config is not None:  # Phase 7b: imported where a config asks for it
            from tinyvllm.spec_decode.speculator import Speculator

            runner.speculator = Speculator(config.speculative_config, runner, model, tokenizer,
                                           max_model_len=max_model_len, num_blocks=num_blocks,
                                           block_size=cc.block_size, max_num_batched_tokens=sc.max_num_batched_tokens,
                                           max_num_seqs=sc.max_num_seqs, portable_attention=portable,
                                           model_name=model_name)
            # one sequence verifying all k drafts runs k + 1 tokens: a shape of its own, not the next power of two
            runner.add_token_bucket(1 + config.speculative_config.num_speculative_tokens)
        return runner

    # ---- one step ----

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The tokens each request emits. A request whose sampling fails is in `failed`; if the whole step fails,
        every generator is put back as it was."""
        self.input_batch.update(scheduler_output)
        if self.encoder is not None:
            self.encoder.free(scheduler_output.free_encoder_mm_hashes)
        output = ModelRunnerOutput()
        if not scheduler_output.scheduled_seqs:
            return output
        rng_states = self.input_batch.generator_states(scheduler_output.scheduled_seqs)
        try:
            self._execute(scheduler_output, output)
        except BaseException:
            self.input_batch.restore_generators(rng_states)
            raise
        return output

    def _execute(self, scheduler_output: SchedulerOutput, out: ModelRunnerOutput) -> None:
        requests = self.input_batch.requests
        hidden_for = frozenset(seq.seq_id for seq in scheduler_output.scheduled_seqs
                               if requests[seq.seq_id].needs_hidden_states)
        forward = self.compute_logits(scheduler_output, hidden_for)
        if hidden_for:
            self._take_hidden_states(forward, out)
        seqs, logits, spec_rows = forward.sampled_seqs, forward.logits, forward.spec_logits_rows
        if not seqs:
            return
        batch = self.sampler.prepare(seqs, *logits.shape, verifying=spec_rows, failed=out.failed)
        self.lap("bookkeeping")
        tokens = None if len(batch.on_host) == len(seqs) else self.sample(  # None: every row is the host's
            logits, *batch.device_params, batch.keys, batch.use_filters, batch.bitmask)
        self.lap("forward")  # the device sampler's token ids are the forward pass's end
        sampled = self.sampler.finish(seqs, batch, tokens, logits, out.failed, out.logprobs)
        emitted = self.speculator.verify(seqs, logits, tokens, spec_rows, scheduler_output, sampled,
                                         self.input_batch) if spec_rows else {}
        for seq_id, token in sampled.items():
            if seq_id not in out.pooler_output:  # a pooling request samples nothing
                out.sampled_token_ids[seq_id] = emitted.get(seq_id, [token])

    def _take_hidden_states(self, forward: ForwardOutput, out: ModelRunnerOutput) -> None:
        """Each request that needs every position takes its rows of the final hidden states; a pooling request
        whose prompt is all computed gets its pooled vector and no token."""
        from tinyvllm.worker.hidden_states import pooled, record_hidden_states

        for seq_id, hidden in forward.hidden_states.items():
            state = self.input_batch.requests[seq_id]
            try:
                prompt_logprobs = record_hidden_states(state, hidden, lambda: self.position_logits(seq_id))
                if prompt_logprobs:
                    out.prompt_logprobs[seq_id] = prompt_logprobs
                if state.seq.pooling_params is not None and state.seq in forward.sampled_seqs:
                    out.pooler_output[seq_id] = pooled(state)
            except Exception as e:  # this request alone ends
                fail(out.failed, state.seq, e)

    def propose_draft_token_ids(self, running: list[Sequence]) -> dict[int | str, list[int]]:
        """The drafts each running request verifies next step."""
        return self.speculator.propose(running, self.input_batch)

    def _hidden(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                num_blocks: int | UOp, *mm: Tensor) -> Tensor:
        """Hidden states (1,N,D), before the final norm; mm: a step's image rows (`_image_inputs`), and for a prefix
        LM each row's context length."""
        tp = self.model.tp  # every device reads the step's inputs
        ends = tp.replicate(mm[2]) if len(mm) > 2 else None
        metadata = attention_metadata(tp.replicate(slot_mapping), tp.replicate(block_tables), tp.replicate(positions),
                                      num_blocks, portable=self.portable_attention, context_lens=ends)
        return self.model(input_ids, positions, self.kv_cache.kv_caches, metadata, *mm[:2])  # (1,N,D)

    def _forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                 logits_indices: Tensor, num_blocks: int | UOp, *mm: Tensor) -> Tensor:
        hidden = self._hidden(input_ids, positions, slot_mapping, block_tables, num_blocks, *mm)  # (1,N,D)
        return self.model.compute_logits(hidden[0][logits_indices.to(hidden.device)]).realize()  # (S,V)

    def _forward_hidden(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                        num_blocks: int | UOp, *mm: Tensor) -> Tensor:
        hidden = self._hidden(input_ids, positions, slot_mapping, block_tables, num_blocks, *mm)  # (1,N,D)
        return self.model.final_norm(hidden[0]).realize()  # (N,D)

    def _rows_logits(self, normed: Tensor, rows: Tensor) -> Tensor:
        """normed (N,D), rows (R,) -> logits (R,V), one graph per (N, R)."""
        key = ("rows", normed.shape[0], rows.shape[0])
        if key not in self._jits:
            self._jits[key] = self.capture(
                lambda h, r: self.model.logits_of_normed(h[r.to(h.device)]).realize())
        return self._jits[key](normed, rows)

    def position_logits(self, seq_id: int | str) -> np.ndarray:
        """(count, V) float32: the logits at every position `seq_id` (in `hidden_for`) computed in the last step."""
        start, count = self._token_rows[seq_id]
        rows = np.zeros(self.bucket_for(count), np.int32)
        rows[:count] = np.arange(start, start + count)
        return self._rows_logits(self._normed, Tensor(rows, device=self.model.device)).numpy()[:count]

    def _inputs(self, n: int) -> tuple[InputBuffer, ...]:
        """An n-token bucket's inputs, allocated once, refilled every step: input_ids (1,n), positions (1,n),
        slot_mapping (n,), block_tables (n, max_blocks)."""
        if n not in self._token_inputs:
            dev = self.model.device
            self._token_inputs[n] = (InputBuffer((1, n), np.int32, dev), InputBuffer((1, n), np.int32, dev),
                                     InputBuffer((n,), np.int32, dev),
                                     InputBuffer((n, self.max_blocks_per_seq), np.int32, dev))
        return self._token_inputs[n]

    def _rows_input(self, num_rows: int) -> InputBuffer:
        """logits_indices (num_rows,), allocated once per bucket of rows."""
        if num_rows not in self._logits_indices:
            self._logits_indices[num_rows] = InputBuffer((num_rows,), np.int32, self.model.device)
        return self._logits_indices[num_rows]

    @property
    def num_graphs(self) -> int:
        """The step and sampler graphs captured (or loaded) so far."""
        return len(self._jits) + len(self._sampler_jits)

    def add_token_bucket(self, num_tokens: int) -> None:
        """Steps of exactly `num_tokens` tokens get a graph of their own instead of padding to the next bucket: every
        padded row costs a row of each matmul (vLLM likewise sizes its captured graphs for 1 + k tokens)."""
        if num_tokens <= self.token_buckets[-1] and num_tokens not in self.token_buckets:
            self.token_buckets = sorted([*self.token_buckets, num_tokens])

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.token_buckets if b >= num_tokens)

    def compute_logits(self, scheduler_output: SchedulerOutput,
                       hidden_for: frozenset = frozenset()) -> ForwardOutput:
        """The forward pass of the step; `hidden_for`: the seq_ids that need every position (pooling, prompt
        logprobs)."""
        seqs = scheduler_output.scheduled_seqs
        n = self.bucket_for(scheduler_output.total_num_scheduled_tokens)
        bs = self.block_size

        input_ids, positions, slot_mapping, block_tables = self._inputs(n)
        block_tables.np[...] = self.kv_cache.null_block
        token_ids: list[int] = []  # the step's tokens, flattened
        token_positions: list[int] = []
        slots: list[int] = []
        sampled_seqs, num_blocks, i = [], 1, 0
        sampled_at: list[int] = []  # the flat row of each sampled sequence's newest token
        token_rows: dict[int | str, tuple[int, int]] = {}
        spec_positions: dict[int | str, list[int]] = {}
        image_chunks = []  # (seq, start, count, first flat row)
        for seq in seqs:
            start, count = seq.num_computed_tokens, scheduler_output.num_scheduled_tokens[seq.seq_id]
            if seq.mm_features:
                image_chunks.append((seq, start, count, i))
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            samples = scheduler_output.samples(seq)
            token_ids += seq.token_ids_in(start, start + count - len(drafts)) + drafts
            token_positions += range(start, start + count)
            slots += get_slot_mapping(seq.block_table, bs, start, start + count)
            block_tables.np[i:i + count, :len(seq.block_table)] = seq.block_table
            num_blocks = max(num_blocks, -(-(start + count) // bs))
            if seq.seq_id in hidden_for:
                token_rows[seq.seq_id] = (i, count)
            i += count
            if samples:
                sampled_at.append(i - len(drafts) - 1)
                sampled_seqs.append(seq)
            if drafts:
                spec_positions[seq.seq_id] = list(range(i - len(drafts), i))
        input_ids.np[0, :i], positions.np[0, :i], slot_mapping.np[:i] = token_ids, token_positions, slots
        if i < n:  # padding: token 0 at position 0, its K/V written to the null slot, reading only the null block
            input_ids.np[0, i:], positions.np[0, i:], slot_mapping.np[i:] = 0, 0, self.kv_cache.null_slot
        # lm_head, the largest matmul, runs on the sampled and drafts' rows only, padded to a bucket of rows
        num_spec_rows = sum(len(where) for where in spec_positions.values())
        num_rows = min(n, self.bucket_for(max(1, len(sampled_seqs) + num_spec_rows)))
        logits_indices = self._rows_input(num_rows)
        logits_indices.np[...] = 0
        logits_indices.np[:len(sampled_at)] = sampled_at
        spec_rows, first = {}, len(sampled_seqs)
        for seq_id, where in spec_positions.items():
            logits_indices.np[first:first + len(where)] = where
            spec_rows[seq_id] = list(range(first, first + len(where)))
            first += len(where)
        inputs = (input_ids.copy_to_device(), positions.copy_to_device(), slot_mapping.copy_to_device(),
                  block_tables.copy_to_device(), logits_indices.copy_to_device(), self._bind_num_blocks(num_blocks))
        mm = self._image_inputs(n, image_chunks, positions.np[0]) if image_chunks else ()
        self.lap("prepare_inputs")
        tag = ("mm",) if mm else ()  # steps with images: graphs of their own
        if token_rows:
            if ("hidden", n, *tag) not in self._jits:
                self._jits["hidden", n, *tag] = self.capture(self._forward_hidden)
            self._normed = self._jits["hidden", n, *tag](*inputs[:4], inputs[5], *mm)
            logits = self._rows_logits(self._normed, inputs[4])
            host = self._normed.numpy()
            hidden_states = {seq_id: host[start:start + count] for seq_id, (start, count) in token_rows.items()}
            self._token_rows = token_rows
        else:
            if (n, num_rows, *tag) not in self._jits:
                persist = None if mm else self._persisted("forward", n, num_rows)
                self._jits[n, num_rows, *tag] = self.capture(self._forward, persist=persist)
            logits = self._jits[n, num_rows, *tag](*inputs, *mm)
            hidden_states, self._token_rows = {}, {}
        self.lap("forward")
        return ForwardOutput(sampled_seqs, logits if sampled_seqs else None, spec_rows, hidden_states)

    def _image_inputs(self, n: int, image_chunks: list, positions: np.ndarray) -> tuple[Tensor, ...]:
        """(mm_embeds (1,n,D), mm_mask (1,n,1)) when the step computes image positions, else (); a prefix LM's
        also context_lens (n,): an image token sees its whole image, any other row up to itself."""
        if n not in self._mm_buffers:
            dev, dim = self.model.device, self.model.config.hidden_size
            self._mm_buffers[n] = (InputBuffer((1, n, dim), np.float32, dev), InputBuffer((1, n, 1), np.int32, dev),
                                   *[InputBuffer((n,), np.int32, dev)] * self.mm_prefix_lm)
        embeds, mask, *ends = self._mm_buffers[n]
        if not self.encoder.gather(image_chunks, embeds.np[0], mask.np[0, :, 0]):
            return ()
        if not ends:
            return embeds.copy_to_device(), mask.copy_to_device()
        (ends,) = ends
        ends.np[...] = positions + 1
        for seq, start, count, row in image_chunks:
            for f in seq.mm_features:
                first, last = max(start, f.offset), min(start + count, f.offset + f.length)
                if first < last:
                    ends.np[row + first - start:row + last - start] = f.offset + f.length
        return embeds.copy_to_device(), mask.copy_to_device(), ends.copy_to_device()

    def _persisted(self, *name):
        """Where graph `name` is kept on disk, keyed by everything this runner bakes into its graphs."""
        settings = {"block_size": self.block_size, "max_blocks_per_seq": self.max_blocks_per_seq,
                    "max_num_seqs": self.max_num_seqs, "portable_attention": self.portable_attention}
        return persisted_graph(self.model, self.kv_cache, settings, *name)

    def _bind_num_blocks(self, num_blocks: int) -> UOp:
        if num_blocks not in self._bound_num_blocks:
            self._bound_num_blocks[num_blocks] = self.v_num_blocks.bind(num_blocks)
        return self._bound_num_blocks[num_blocks]

    def lap(self, phase: str | None) -> None:
        """Profiling: the time since the last lap belongs to `phase` (None: a step starts)."""
        if self.step_timer is None:
            return
        if phase is None:
            self.step_timer.start()
        else:
            self.step_timer.lap(phase)

    def sample(self, logits: Tensor, temperature: np.ndarray | None, top_k: np.ndarray | None,
               top_p: np.ndarray | None, min_p: np.ndarray | None, keys: np.ndarray | None, use_filters: bool,
               bitmask: np.ndarray | None = None) -> np.ndarray:
        """The token ids (rows,), each row of `logits` sampled on the device. keys (rows, 2) uint32, None: all
        greedy; bitmask (rows, ceil(vocab/32)) int32."""
        rows = logits.shape[0]
        masked = bitmask is not None
        inputs = [] if keys is None else [temperature, top_k, top_p, min_p, keys]
        inputs += [bitmask] if masked else []
        key = (rows, "greedy" if keys is None else use_filters, masked)
        if key not in self._sampler_jits:
            self._sampler_jits[key] = self.capture(self._sampler_graph(keys is None, use_filters, masked),
                                                 persist=self._persisted("sample", *key))
        if key not in self._sampler_inputs:
            self._sampler_inputs[key] = [InputBuffer(a.shape, a.dtype, self.model.device) for a in inputs]
        buffers = [buf.write(a) for buf, a in zip(self._sampler_inputs[key], inputs)]
        return self._read_back(key, self._sampler_jits[key](logits, *buffers))

    def _read_back(self, key: tuple, out: Tensor) -> np.ndarray:
        """Sampler graph `key`'s output on the host; no wait after a CPU graph's C replay (done when it returns)."""
        if key not in self._sampler_outputs:
            self._sampler_outputs[key] = ReadBack()
        return self._sampler_outputs[key](out, wait=not self._sampler_jits[key].ran_in_c)

    @staticmethod
    def _sampler_graph(greedy: bool, use_filters: bool, masked: bool):
        def run(logits: Tensor, *inputs: Tensor) -> Tensor:
            if masked:
                logits, inputs = device_sampler.apply_token_bitmask(logits, inputs[-1]), inputs[:-1]
            if greedy:
                return device_sampler.greedy(logits).realize()
            return device_sampler.sample(logits, *inputs, use_filters=use_filters).realize()
        return run

    def rejection_sample(self, logits: Tensor, row_index: np.ndarray, batch) -> tuple[np.ndarray, np.ndarray]:
        """Rejection sampling on the device. row_index (R,) int32: the row of `logits` each verify row reads;
        batch: a VerifyBatch. Returns accepted (R,) bool and tokens (R,) int32."""
        has_q = batch.draft_probs is not None
        key = ("rejection", logits.shape[0], batch.use_filters, has_q)
        if key not in self._sampler_jits:
            self._sampler_jits[key] = self.capture(self._rejection_graph(batch.use_filters, has_q))
        inputs = [row_index, *batch.inputs()]
        if key not in self._sampler_inputs:
            self._sampler_inputs[key] = [InputBuffer(a.shape, a.dtype, self.model.device) for a in inputs]
        buffers = [buf.write(a) for buf, a in zip(self._sampler_inputs[key], inputs)]
        out = self._read_back(key, self._sampler_jits[key](logits, *buffers))
        return out[0] != 0, out[1]  # (R,), (R,)

    @staticmethod
    def _rejection_graph(use_filters: bool, has_q: bool):
        from tinyvllm.spec_decode import rejection_sampler

        def run(logits: Tensor, row_index: Tensor, *inputs: Tensor) -> Tensor:
            accepted, tokens = rejection_sampler.rejection_sample(
                logits[row_index], *inputs[:7], draft_probs=inputs[7] if has_q else None, use_filters=use_filters)
            return accepted.cast(dtypes.int32).stack(tokens).realize()  # (2, R)
        return run
