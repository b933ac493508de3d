"""Continuous batching: each step, decide which sequences compute how many of their tokens: no prefill or decode
phase, each sequence's num_computed_tokens catches up with its num_tokens_with_spec.

Taught in docs/phases/03-continuous-batching.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")  # vLLM's scheduling_policy values


def check_scheduler_limits(max_num_seqs: int, max_num_batched_tokens: int, policy: str) -> None:
    """ValueError unless the step limits are valid."""
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                         f"({max_num_seqs}), or running decodes could not all get their token each step")


def _rank(seq: Sequence) -> tuple[int, float]:
    """Lower is served first."""
    return seq.priority, seq.arrival_time


@dataclass
class SchedulerOutput:
    """What one step computes: each scheduled sequence's next num_scheduled_tokens[seq_id] tokens."""

    scheduled_seqs: list[Sequence]  # batch order: running ones first, then newly admitted
    num_scheduled_tokens: dict[int | str, int]  # seq_id -> tokens computed this step (1 for a decode)
    preempted_seqs: list[Sequence] = field(default_factory=list)
    # seq_id -> the drafts it verifies, after its last sampled token
    scheduled_spec_decode_tokens: dict[int | str, list[int]] = field(default_factory=dict)
    # finished since the last step
    finished_req_ids: set[int | str] = field(default_factory=set)
    # seq_id -> its images this step encodes (Phase 10)
    scheduled_encoder_inputs: dict[int | str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def samples(self, seq: Sequence) -> bool:
        """Whether the step computes `seq`'s newest token, so samples the next. Asked before the step's tokens count
        as computed."""
        num_drafts = len(self.scheduled_spec_decode_tokens.get(seq.seq_id, ()))
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.seq_id] - num_drafts == seq.num_tokens


class Scheduler:
    """Owns the waiting and running queues and the BlockManager; `schedule()` then `update_from_output()` once per
    step. `policy`: "fcfs" or "priority" (lower first; preempts the lowest)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, eos_token_ids: Iterable[int] = (), policy: str = "fcfs",
                 enable_prefix_caching: bool = False, encoder_cache_size: int = 0,
                 disable_chunked_mm_input: bool = False):
        check_scheduler_limits(max_num_seqs, max_num_batched_tokens, policy)
        if not 2 <= max_model_len <= num_blocks * block_size:
            raise ValueError(f"max_model_len ({max_model_len}) must be >= 2 and fit in the KV cache "
                             f"({num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens), "
                             "or a long sequence could never run")
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.policy = policy
        self.requests: dict[int | str, Sequence] = {}  # every unfinished sequence
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.finished_req_ids: set[int | str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.encoder_cache_manager = None  # Phase 10, with a vision tower
        if encoder_cache_size:
            from tinyvllm.core.encoder_cache import EncoderCacheManager

            self.encoder_cache_manager = EncoderCacheManager(encoder_cache_size)
        self._encoder_budget = 0  # embeddings still encodable this step
        self.disable_chunked_mm_input = disable_chunked_mm_input  # an image's tokens all in one step
        self._encoder_inputs: dict[int | str, list[int]] = {}  # this step's images to encode, by sequence
        self.spec_decoding_stats = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_emitted_tokens": 0,
                                    "num_verify_steps": 0}

    def add_seq(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {seq.num_prompt_tokens} tokens: max_model_len ({self.max_model_len}) "
                             "leaves no room for output")
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, f"add_seq: {seq} is not new"
        assert seq.seq_id not in self.requests, f"add_seq: {seq.seq_id!r} is already here"
        self.requests[seq.seq_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            index = next((i for i, other in enumerate(self.waiting) if _rank(seq) < _rank(other)), len(self.waiting))
            self.waiting.insert(index, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _choose_victim(self) -> Sequence:
        """fcfs: the newest running sequence (least work to lose); priority: the lowest, the newest among equals."""
        if self.policy == "priority":
            return max(self.running, key=_rank)
        return self.running[-1]

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        num_scheduled_tokens: dict[int | str, int] = {}
        preempted: list[Sequence] = []
        spec_tokens: dict[int | str, list[int]] = {}
        self._encoder_inputs = encoder_inputs = {}
        self._encoder_budget = self.encoder_cache_manager.cache_size if self.encoder_cache_manager else 0

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new_tokens = min(self._num_tokens_with_spec(seq) - seq.num_computed_tokens, token_budget)
            num_new_tokens, images = self._schedule_encoder_inputs(seq, num_new_tokens)
            if num_new_tokens == 0:
                i += 1
                continue
            while self.block_manager.append_slots(seq, num_new_tokens) is None:
                victim = self._choose_victim()
                if victim in scheduled:  # priority order may pick one scheduled already
                    scheduled.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.seq_id)
                    spec_tokens.pop(victim.seq_id, None)
                    encoder_inputs.pop(victim.seq_id, None)
                    i -= 1
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue  # it preempted itself: the next one now stands at index i
            scheduled.append(seq)
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            self._allocate_encoder_inputs(seq, images)
            if num_new_tokens > seq.num_uncomputed_tokens:
                spec_tokens[seq.seq_id] = seq.spec_token_ids[:num_new_tokens - seq.num_uncomputed_tokens]
            token_budget -= num_new_tokens
            i += 1

        # 2. waiting sequences; none while this step had to preempt
        if not preempted:
            token_budget = self._admit_waiting(token_budget, scheduled, num_scheduled_tokens)

        assert len(scheduled) <= self.max_num_seqs, f"{len(scheduled)} sequences in a step of {self.max_num_seqs}"
        finished, self.finished_req_ids = self.finished_req_ids, set()
        freed = self.encoder_cache_manager.get_freed_mm_hashes() if self.encoder_cache_manager else []
        return SchedulerOutput(scheduled, num_scheduled_tokens, preempted, spec_tokens, finished, encoder_inputs, freed)

    def _admit_waiting(self, token_budget: int, scheduled: list[Sequence], num_scheduled_tokens: dict[int | str, int]
                       ) -> int:
        """Admit sequences from the head of the waiting queue while budget, seats and blocks last; returns the budget
        left."""
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.block_manager.allocate(seq) is None:
                break  # the head waits for blocks; no skipping ahead, or a long prompt could wait forever
            num_new_tokens, images = self._schedule_encoder_inputs(seq, min(seq.num_uncomputed_tokens, token_budget))
            if num_new_tokens == 0:  # no room for its next image yet
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._start_running(seq)
            scheduled.append(seq)
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            self._allocate_encoder_inputs(seq, images)
            token_budget -= num_new_tokens
        return token_budget

    def _schedule_encoder_inputs(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(tokens it may compute, images to encode): cut before an image without room (vLLM's
        `_try_schedule_encoder_inputs`). An image the chunk hits later is not room for an earlier miss: the miss
        fits beside it, or the chunk ends before it (it is encoded again in a later step). With
        `disable_chunked_mm_input`, a chunk that cannot finish an image ends before it."""
        manager, start = self.encoder_cache_manager, seq.num_computed_tokens
        images, held, pending = [], set(), 0
        chunk = [(i, f) for i, f in enumerate(seq.mm_features) if f.overlaps(start, start + num_new_tokens)]
        for n, (index, feature) in enumerate(chunk):
            if self.disable_chunked_mm_input and feature.offset + feature.length > start + num_new_tokens:
                return max(0, feature.offset - start), images  # the chunk would end inside it: before it
            if feature.mm_hash in held or manager.check_and_update_cache(seq.seq_id, feature):
                held.add(feature.mm_hash)  # encoded once for the request, or cached: held from here
                continue
            if not manager.can_allocate(feature, self._encoder_budget, pending):
                return max(0, feature.offset - start), images
            later = [f for _, f in chunk[n + 1:] if f.mm_hash in manager.cached]
            evicts_later = later and not manager.can_allocate(feature, self._encoder_budget, pending,
                                                               {f.mm_hash for f in later})
            self._encoder_budget -= feature.num_embeds
            pending += feature.num_embeds
            images.append(index)
            held.add(feature.mm_hash)
            if evicts_later:  # the chunk ends before the first of them
                return later[0].offset - start, images
        return num_new_tokens, images

    def _allocate_encoder_inputs(self, seq: Sequence, images: list[int]) -> None:
        for index in images:
            self.encoder_cache_manager.allocate(seq.seq_id, seq.mm_features[index])
        if images:
            self._encoder_inputs[seq.seq_id] = images

    def _free_encoder_inputs(self, seq: Sequence, everything: bool = False) -> None:
        """Release the encoder outputs `seq` has computed past (all: `everything`)."""
        for feature in seq.mm_features:
            if everything or feature.offset + feature.length <= seq.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(seq.seq_id, feature)

    def _start_running(self, seq: Sequence) -> None:
        if seq.num_cached_tokens < 0:  # first admission
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _num_tokens_with_spec(seq: Sequence) -> int:
        """Its tokens plus its drafts, when it has drafts and only its last sampled token left to compute."""
        return seq.num_tokens + (len(seq.spec_token_ids) if seq.num_uncomputed_tokens == 1 else 0)

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop its K/V; its prompt and output are recomputed when readmitted."""
        self.block_manager.free(seq)
        self._free_encoder_inputs(seq, everything=True)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        self._enqueue(seq, front=True)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance each scheduled sequence by the tokens it computed; returns an EngineCoreOutput per sequence that
        got a token, finished, or got prompt logprobs."""
        outputs = []
        for seq in scheduler_output.scheduled_seqs:
            seq_id = seq.seq_id
            if seq.is_finished:
                continue  # aborted while the step ran
            if seq_id in model_output.failed:  # it alone ends
                outputs.append(self._fail(seq, model_output.failed[seq_id]))
                continue
            num_tokens_before = seq.num_tokens
            if seq_id in scheduler_output.scheduled_spec_decode_tokens:
                self._accept_spec_tokens(seq, scheduler_output, model_output.sampled_token_ids[seq_id])
            else:
                samples = scheduler_output.samples(seq)
                seq.num_computed_tokens += scheduler_output.num_scheduled_tokens[seq_id]
                self.block_manager.cache_full_blocks(seq, scheduler_output.num_scheduled_tokens[seq_id])
                self._free_encoder_inputs(seq)
                if seq_id in model_output.pooler_output:
                    self._finish(seq, SequenceStatus.FINISHED_STOPPED)
                elif samples and seq_id in model_output.sampled_token_ids:
                    (token,) = model_output.sampled_token_ids[seq_id]
                    seq.append_token_id(token)
                    status = self._check_stop(seq)
                    if status is not None:
                        self._finish(seq, status)
            new_token_ids = seq.output_token_ids[num_tokens_before - seq.num_prompt_tokens:]
            prompt_logprobs = model_output.prompt_logprobs.get(seq_id)
            if new_token_ids or seq.is_finished or prompt_logprobs:
                outputs.append(EngineCoreOutput(
                    seq_id, new_token_ids, model_output.logprobs.get(seq_id), prompt_logprobs,
                    model_output.pooler_output.get(seq_id), seq.status.finish_reason, seq.stop_reason,
                    num_cached_tokens=max(seq.num_cached_tokens, 0), first_scheduled_time=seq.first_scheduled_time,
                    num_preemptions=seq.num_preemptions))
        if not scheduler_output.scheduled_seqs:
            outputs += self._fail_stuck_head(scheduler_output)
        return outputs

    def _accept_spec_tokens(self, seq: Sequence, scheduler_output: SchedulerOutput, emitted: list[int]) -> None:
        """Append the `emitted` tokens with decoding's stop checks, then roll back: num_computed_tokens covers only
        the kept tokens; blocks holding only rejected slots are freed."""
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens[seq.seq_id])
        assert 1 <= len(emitted) <= num_drafts + 1, f"{len(emitted)} tokens emitted from {num_drafts} drafts"
        stats = self.spec_decoding_stats
        stats["num_draft_tokens"] += num_drafts
        stats["num_accepted_tokens"] += len(emitted) - 1
        stats["num_emitted_tokens"] += len(emitted)
        stats["num_verify_steps"] += 1
        num_computed_before = seq.num_computed_tokens
        seq.num_computed_tokens = seq.num_tokens  # the last sampled token; a draft counts once kept
        for j, token in enumerate(emitted):
            if j > 0:
                seq.num_computed_tokens += 1  # the token before this one was an accepted draft
            seq.append_token_id(token)
            status = self._check_stop(seq)
            if status is not None:
                self._finish(seq, status)
                break
        seq.spec_token_ids = []
        if seq.is_finished:
            return
        self.block_manager.free_slots_after(seq, seq.num_computed_tokens)
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens - num_computed_before)

    def update_draft_token_ids(self, draft_token_ids: dict[int | str, list[int]]) -> None:
        """The drafts each running sequence verifies next step."""
        for seq in self.running:
            seq.spec_token_ids = list(draft_token_ids.get(seq.seq_id, ()))

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens and (
                seq.last_token_id in params.all_stop_token_ids(self.eos_token_ids)):
            if seq.last_token_id in params.stop_token_ids:
                seq.stop_reason = seq.last_token_id
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _fail(self, seq: Sequence, error: str) -> EngineCoreOutput:
        self._finish(seq, SequenceStatus.FINISHED_ERROR)
        return EngineCoreOutput(seq.seq_id, finish_reason=seq.status.finish_reason, error=error,
                                num_cached_tokens=max(seq.num_cached_tokens, 0))

    def _fail_stuck_head(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Nothing scheduled, running or preempted: no block will come free, so the waiting head ends with an
        error."""
        if scheduler_output.preempted_seqs or self.running or not self.waiting:
            return []
        seq, bm = self.waiting[0], self.block_manager
        return [self._fail(seq, f"the engine failed while running this request: RuntimeError: out of KV cache "
                                f"blocks: the request needs {seq.num_blocks(bm.block_size)} blocks, "
                                f"{bm.num_free_blocks} of the {bm.num_blocks} are free and no running request "
                                f"will give any back")]

    # ---- finishing from outside a step ----

    def finish_requests(self, seq_ids: Iterable[int | str], status: SequenceStatus) -> None:
        """Finish these sequences now and free their blocks; ids no longer here are skipped."""
        for seq_id in seq_ids:
            self.finish_seq(seq_id, status)

    def finish_seq(self, seq_id: int | str, status: SequenceStatus) -> Sequence | None:
        """Finish one sequence now; returns it, or None if no unfinished sequence has this id."""
        assert status.is_finished, f"finish_seq needs a finished status, got {status.name}"
        seq = self.requests.get(seq_id)
        if seq is not None:
            self._finish(seq, status)
        return seq

    def abort(self, seq_id: int | str) -> Sequence | None:
        return self.finish_seq(seq_id, SequenceStatus.FINISHED_ABORTED)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)  # waiting or preempted: holds no blocks
        self._free_encoder_inputs(seq, everything=True)
        seq.status = status
        del self.requests[seq.seq_id]
        self.finished_req_ids.add(seq.seq_id)
