"""Continuous batching: each step, decide which sequences compute how many of their tokens.

    NOTE(woosuk) on the scheduling algorithm, from vLLM v1's `scheduler.py`:
    "There's no 'decoding phase' nor 'prefill phase' in the scheduler. Each request just has the
    num_computed_tokens and num_tokens_with_spec. [...] At each step, the scheduler tries to assign
    tokens to the requests so that each request's num_computed_tokens can catch up its
    num_tokens_with_spec. This is general enough to cover chunked prefills, prefix caching,
    speculative decoding, and the 'jump decoding' optimization in the future."

A step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

    running (oldest first)   each gets its next chunk: 1 token for a decode, the rest of a prompt
                             otherwise, as far as the budget goes. Out of blocks? preempt the newest
                             running sequence (free its blocks, recompute it later) and retry.
    waiting (head first)     admitted while the budget, the cap and free blocks allow; a prompt
                             longer than what is left of the budget is split (chunked prefill).

With `policy="priority"` (vLLM's `scheduling_policy`), the waiting queue is ordered by each request's
`priority` (lower first), then arrival, and the sequence preempted when blocks run out is the one of
lowest priority, not the newest.

With prefix caching (`enable_prefix_caching`, tinyvllm/core/prefix_cache.py) a newly admitted sequence
starts with `num_computed_tokens` after its longest cached prefix: only the rest is scheduled. After each
step the blocks it filled are offered to the cache.

Sharing a prompt (n > 1, vLLM's `fork`): the completions of one prompt after the first are added with
`share_prompt_with` (the first): they wait, holding nothing, until the step that computes the last token of
its prompt; in that step they fork from it (share its blocks), are scheduled with 0 tokens and sample from
its logits row. The prompt is computed once and held once; each completion's first write into the shared,
partly filled last block gets it a copy (copy-on-write, `SchedulerOutput.blocks_to_copy`).

    add_seq -> WAITING --schedule--> RUNNING --update_from_output--> FINISHED_* (blocks freed)
                  ^                     |
                  +-----PREEMPTED-------+   (back at the head of the waiting queue)

A request's width counts at admission (vLLM v0's `get_max_num_running_seqs`): a sequence that will fork
reserves a seat for each sequence it forks, so a step never holds more than `max_num_seqs` sequences.
The n - 1 completions waiting to fork from a prompt, and the beams a beam search will fork from its first
one (`add_seq(num_forks=k - 1)`), are admitted with it or not at all, with a spare free block each for its
first copy-on-write:

    max_num_seqs 4, running a b c     waiting: beam search k=4 (1 sequence, 3 forks to come)
    admitted alone it would fork to 4 beams beside a b c: 7 rows in a 4-row step. It needs 1 + 3 seats,
    so it waits until a b c have finished; then it runs, and forks, alone.

Because running sequences are served first, a long prompt being prefilled in chunks takes only
what the decodes leave of the budget: the others keep producing a token every step. Running
sequences keep admission order, so the one part-way through its prompt is always the newest.
The scheduler owns the BlockManager; the model runner never sees the queues. Stop strings need
text, so the engine checks them and calls `finish_seq`; stop tokens and lengths are checked here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tinyvllm.core.block_manager import BlockManager
from tinyvllm.core.sequence import Sequence, SequenceStatus


POLICIES = ("fcfs", "priority")  # vLLM's scheduling_policy values


def _rank(seq: Sequence) -> tuple[int, float]:
    """Lower is served first: the request's priority (vLLM: lower value, earlier handling), then its arrival."""
    return seq.priority, seq.arrival_time


@dataclass
class SchedulerOutput:
    """What one step computes: for each scheduled sequence, its tokens at positions
    num_computed_tokens .. num_computed_tokens + num_scheduled_tokens[seq_id] - 1."""

    scheduled_seqs: list[Sequence]  # batch order: running ones first, then newly admitted, then forked
    num_scheduled_tokens: dict[int | str, int]  # seq_id -> tokens computed this step (1 for a decode)
    preempted_seqs: list[Sequence]  # sent back to the waiting queue by this step
    # copy-on-write: (src, dst) blocks the step copies on the device before its forward pass (vLLM's name)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # forked this step (0 tokens scheduled): seq_id -> seq_id of the sequence whose logits row it samples from
    forked_from: dict[int | str, int | str] = field(default_factory=dict)
    # speculative decoding: seq_id -> the draft tokens it verifies this step, counted in its num_scheduled_tokens
    # after its last sampled token (vLLM v1's name)
    scheduled_spec_decode_tokens: dict[int | str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def samples(self, seq: Sequence) -> bool:
        """Whether the step computes `seq`'s newest token (a decode, a prompt's last chunk; any draft tokens it
        verifies come after it), so that its next token is sampled from the logits there. A chunk that ends
        mid-prompt samples nothing. Asked before the step's tokens are counted as computed: by the model runner,
        which computes the logits of these rows only, and by `Scheduler.update_from_output`."""
        num_drafts = len(self.scheduled_spec_decode_tokens.get(seq.seq_id, ()))
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.seq_id] - num_drafts == seq.num_tokens


class Scheduler:
    """Owns the waiting and running queues and the BlockManager; `schedule()` then `update_from_output()`
    once per step. The KV pool size (`num_blocks`) is computed once elsewhere and passed in.

    Args:
        num_blocks: KV blocks in the pool (the BlockManager's).
        block_size: tokens per block.
        max_model_len: the longest sequence; it must fit in the pool.
        max_num_seqs: the most sequences in one step (and seats: running requests, with the forks they reserve).
        max_num_batched_tokens: the token budget of one step (>= max_num_seqs: every decode gets its token).
        eos_token_ids: the model's stop tokens (a request may ignore them: ignore_eos).
        policy: "fcfs" (arrival order) or "priority" (each request's priority, lower first; preempts the lowest).
        enable_prefix_caching: reuse full blocks of prompts seen before (core/block_manager.py).
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, eos_token_ids: Iterable[int] = (), policy: str = "fcfs",
                 enable_prefix_caching: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}), or running decodes could not all get their token each step")
        if not 2 <= max_model_len <= num_blocks * block_size:
            raise ValueError(f"max_model_len ({max_model_len}) must be >= 2 and fit in the KV cache "
                             f"({num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens), "
                             "or a long sequence could never run")
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = tuple(eos_token_ids)  # the model's; a request may ignore them (ignore_eos)
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.waiting_for_fork: dict[int | str, list[Sequence]] = {}  # seq_id -> those to fork from its prompt
        self.num_forks: dict[int | str, int] = {}  # seq_id -> sequences it will fork itself (a first beam)
        self.num_preemptions = 0  # since the start (vLLM's num_preemptions_total)

    def add_seq(self, seq: Sequence, share_prompt_with: Sequence | None = None, num_forks: int = 0) -> None:
        """Queue a new sequence. `share_prompt_with`: an unfinished sequence with the same prompt and no output
        yet (n > 1): `seq` waits to fork from it when its prompt is computed, instead of computing it again.
        `num_forks`: how many sequences `seq` will fork once it runs (a beam search's first beam: width - 1);
        it is admitted only with a seat and a spare block for each."""
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {seq.num_prompt_tokens} tokens: max_model_len ({self.max_model_len}) "
                             "leaves no room for output")
        if not 0 <= num_forks < self.max_num_seqs:
            raise ValueError(f"a request of width {num_forks + 1} can never run: a step holds at most max_num_seqs "
                             f"({self.max_num_seqs}) sequences")
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, f"add_seq: {seq} is not new"
        if num_forks:
            self.num_forks[seq.seq_id] = num_forks
        forks = [] if share_prompt_with is None else self.waiting_for_fork.get(share_prompt_with.seq_id, [])
        if share_prompt_with is None or len(forks) + 2 > self.max_num_seqs:  # wider than a step: the rest compute
            self._enqueue(seq)                                                # their own prompt
            return
        assert share_prompt_with.prompt_token_ids == seq.prompt_token_ids and not share_prompt_with.is_finished
        self.waiting_for_fork.setdefault(share_prompt_with.seq_id, []).append(seq)

    def num_reserved_seats(self, seq: Sequence) -> int:
        """Seats `seq` holds, itself and the sequences it will fork: what its admission needs."""
        return 1 + len(self.waiting_for_fork.get(seq.seq_id, ())) + self.num_forks.get(seq.seq_id, 0)

    @property
    def num_seats_in_use(self) -> int:
        """Running sequences and the forks they reserved; never more than max_num_seqs."""
        return sum(self.num_reserved_seats(seq) for seq in self.running)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """fcfs: at the back (a preempted sequence: at the front). priority: in (priority, arrival) order."""
        if self.policy == "priority":
            index = next((i for i, other in enumerate(self.waiting) if _rank(seq) < _rank(other)), len(self.waiting))
            self.waiting.insert(index, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _choose_victim(self) -> Sequence:
        """Whom to preempt when blocks run out. fcfs: the newest running sequence (it has the least work to
        lose). priority: the one of lowest priority (highest value), the newest among equals (vLLM v1's rule)."""
        if self.policy == "priority":
            return max(self.running, key=_rank)
        return self.running[-1]

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_fork)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        num_scheduled_tokens: dict[int | str, int] = {}
        preempted: list[Sequence] = []
        spec_tokens: dict[int | str, list[int]] = {}

        # 1. running sequences, oldest first: each one's next chunk (one token for a decode, plus its draft
        # tokens when it speculates: num_tokens_with_spec)
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new_tokens = min(self._num_tokens_with_spec(seq) - seq.num_computed_tokens, token_budget)
            if num_new_tokens == 0:  # all computed, no token to sample yet (a beam waiting for the others)
                i += 1
                continue
            while self.block_manager.append_slots(seq, num_new_tokens) is None:
                victim = self._choose_victim()
                if victim in scheduled:  # priority order may pick one already given tokens this step: take them back
                    scheduled.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.seq_id)
                    spec_tokens.pop(victim.seq_id, None)
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
            if num_new_tokens > seq.num_uncomputed_tokens:  # the budget may cut the drafts short
                spec_tokens[seq.seq_id] = seq.spec_token_ids[:num_new_tokens - seq.num_uncomputed_tokens]
            token_budget -= num_new_tokens
            i += 1

        # 2. waiting sequences, first come first served; none while this step had to preempt. A sequence that
        # will fork is admitted with seats for its forks and a spare block each (their first copy-on-write).
        seats_in_use = self.num_seats_in_use if self.waiting else 0  # (a sum over the running: only when needed)
        while self.waiting and not preempted and token_budget > 0:
            seq = self.waiting[0]
            seats = self.num_reserved_seats(seq)
            if seats_in_use + seats > self.max_num_seqs:
                break  # the head waits for seats; no skipping ahead, or a wide request could wait forever
            if seats > 1 and not self.block_manager.can_allocate(seq, num_spare=seats - 1):
                break
            if self.block_manager.allocate(seq) is None:
                break  # the head waits for blocks, for the same reason
            seats_in_use += seats
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:  # first admission: how much of the prompt the prefix cache had
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            # the rest of its tokens (after a cached prefix, if any), or a prefix of them: chunked prefill
            num_new_tokens = min(seq.num_uncomputed_tokens, token_budget)
            scheduled.append(seq)
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            token_budget -= num_new_tokens

        # 3. n > 1: a prompt this step finishes computing is shared by the completions waiting for it
        forked_from = {}
        for seq in list(scheduled) if self.waiting_for_fork else ():
            if seq.seq_id in self.waiting_for_fork and seq.num_output_tokens == 0 and (
                    seq.num_computed_tokens + num_scheduled_tokens[seq.seq_id] == seq.num_tokens):
                for child in self.waiting_for_fork.pop(seq.seq_id):  # their seats were reserved at admission
                    self.fork_seq(seq, child, num_computed_tokens=seq.num_tokens)
                    scheduled.append(child)
                    num_scheduled_tokens[child.seq_id] = 0
                    forked_from[child.seq_id] = seq.seq_id

        assert len(scheduled) <= self.max_num_seqs, f"{len(scheduled)} sequences in a step of {self.max_num_seqs}"
        return SchedulerOutput(scheduled, num_scheduled_tokens, preempted, self.block_manager.take_blocks_to_copy(),
                               forked_from, spec_tokens)

    @staticmethod
    def _num_tokens_with_spec(seq: Sequence) -> int:
        """Its tokens plus its draft tokens, when it has drafts and only its last sampled token left to compute."""
        return seq.num_tokens + (len(seq.spec_token_ids) if seq.num_uncomputed_tokens == 1 else 0)

    def fork_seq(self, parent: Sequence, child: Sequence, num_computed_tokens: int | None = None) -> None:
        """Run `child`, whose tokens start with all of `parent`'s, on `parent`'s blocks (shared, copy-on-write):
        its first `num_computed_tokens` (default: as many as `parent` has computed) need no computing. A parent
        that holds no blocks (waiting, preempted) gives nothing to share: the child waits to compute them itself."""
        assert child.all_token_ids[:parent.num_tokens] == parent.all_token_ids and not child.block_table
        if parent.status != SequenceStatus.RUNNING:
            child.status = SequenceStatus.WAITING
            self._enqueue(child, front=True)
            return
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        child.num_cached_tokens = max(parent.num_cached_tokens, 0)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def replace_seqs(self, forks: list[tuple[Sequence, Sequence]], replaced: list[Sequence]) -> None:
        """One beam search step: fork each (parent, child), then finish the `replaced` sequences (the old beams).
        The children take the seats the old beams held (and a first beam's reserved forks); children beyond
        the free seats (their parents were preempted, so held no seat) wait and compute their tokens themselves,
        as a preempted sequence does."""
        for parent, child in forks:  # fork first: the parents' blocks stay held while shared
            self.fork_seq(parent, child)
        for seq in replaced:
            self.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        excess = self.num_seats_in_use - self.max_num_seqs
        for _, child in reversed(forks):
            if excess > 0 and child.status == SequenceStatus.RUNNING:
                self.running.remove(child)
                self._preempt(child)
                excess -= 1

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop its K/V; its tokens, prompt and output, are recomputed when readmitted."""
        self.block_manager.free(seq)
        self.num_preemptions += 1
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        self._enqueue(seq, front=True)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[int | str, int | list[int]]) -> list[Sequence]:
        """Advance each scheduled sequence by the tokens it computed; those that caught up get their sampled
        token, and may finish (their blocks are freed). Returns the sequences that got a new token.
        A sequence that verified draft tokens gets a list: the tokens it emits (see `_accept_spec_tokens`)."""
        new_token_seqs = []
        for seq in scheduler_output.scheduled_seqs:
            if seq.is_finished:
                continue  # aborted while the step ran
            if seq.seq_id in scheduler_output.scheduled_spec_decode_tokens:
                if seq.seq_id in sampled_token_ids:
                    self._accept_spec_tokens(seq, scheduler_output, sampled_token_ids[seq.seq_id])
                    new_token_seqs.append(seq)
                else:  # its request failed this step: only its last sampled token counts as computed
                    seq.num_computed_tokens = seq.num_tokens
                    self.block_manager.free_slots_after(seq, seq.num_computed_tokens)
                continue
            samples = scheduler_output.samples(seq)
            seq.num_computed_tokens += scheduler_output.num_scheduled_tokens[seq.seq_id]
            self.block_manager.cache_full_blocks(seq, scheduler_output.num_scheduled_tokens[seq.seq_id])
            if not samples:
                continue  # a chunk that ended mid-prompt: its sample, if any, means nothing
            if seq.seq_id not in sampled_token_ids:
                continue  # no token for it (a beam: the beam search chooses its next token from its logprobs)
            seq.append_token_id(sampled_token_ids[seq.seq_id])
            new_token_seqs.append(seq)
            status = self._check_stop(seq)
            if status is not None:
                self._finish(seq, status)
        return new_token_seqs

    def _accept_spec_tokens(self, seq: Sequence, scheduler_output: SchedulerOutput, emitted: list[int]) -> None:
        """The step computed seq's last sampled token and its drafts d0..d(s-1); `emitted` is what the target
        accepts: d0..d(a-1) and one token of its own (1 <= len(emitted) <= s + 1). Tokens are appended one at a
        time with the stop checks of plain decoding, so a stop token or max_tokens cuts the run where plain
        decoding would have stopped. The K/V of the rejected drafts are rolled back: num_computed_tokens moves
        back to cover only tokens that are kept, and blocks holding nothing but rejected slots are freed.

            block_size 4; tokens t0..t5 computed up to t4; t5 sampled last step; drafts d0 d1 d2 d3
            this step computes:  t5 d0 d1 d2 d3     (positions 5..9, blocks [A B C])
            target accepts d0 d1, emits d0 d1 x:    tokens t0..t5 d0 d1 x, num_computed_tokens 8
            block C (positions 8..11) holds only rejected slots (d2 d3): freed. x is computed next step.
        """
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens[seq.seq_id])
        assert 1 <= len(emitted) <= num_drafts + 1, f"{len(emitted)} tokens emitted from {num_drafts} drafts"
        num_computed_before = seq.num_computed_tokens
        seq.num_computed_tokens = seq.num_tokens  # the last sampled token; the drafts count once they are kept
        for j, token in enumerate(emitted):
            if j > 0:
                seq.num_computed_tokens += 1  # the token emitted before this one was a draft: its K/V are good
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

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens and (
                seq.last_token_id in params.all_stop_token_ids(self.eos_token_ids)):
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    # ---- finishing from outside a step ----

    def finish_seq(self, seq_id: int | str, status: SequenceStatus) -> Sequence | None:
        """Finish a sequence now, wherever it is, and free its blocks: an abort, or a stop string the
        engine found in the text. Returns it, or None if no unfinished sequence has this id."""
        assert status.is_finished, f"finish_seq needs a finished status, got {status.name}"
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self._finish(seq, status)
                return seq
        for source_id, children in self.waiting_for_fork.items():
            for seq in children:
                if seq.seq_id == seq_id:
                    children.remove(seq)
                    if not children:
                        del self.waiting_for_fork[source_id]
                    seq.status = status
                    return seq
        return None

    def abort(self, seq_id: int | str) -> Sequence | None:
        return self.finish_seq(seq_id, SequenceStatus.FINISHED_ABORTED)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.num_forks.pop(seq.seq_id, None)
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)  # waiting or preempted: holds no blocks
        seq.status = status
        for child in self.waiting_for_fork.pop(seq.seq_id, []):  # its prompt will not be shared: each computes it
            self._enqueue(child)
