"""Scheduler: continuous batching against a fake model, with no device.

The fake model keeps a fake paged KV cache that stores each token id in the slot the slot mapping
gives it, then "attends" by reading the sequence's tokens back through its block table. Its next
token is a hash of what it read. So a slot overwritten by another sequence, a token computed twice
or skipped, or a block freed too early changes the output, and every test compares against the
same hash run on each prompt alone, without the scheduler.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.core.scheduler import Scheduler, SchedulerOutput
from tinyvllm.core.sequence import Sequence, SequenceStatus
from tinyvllm.sampling_params import SamplingParams

VOCAB = 40
EOS = 0


def next_token(tokens: list[int]) -> int:
    h = len(tokens)
    for t in tokens:
        h = (h * 1_000_003 + t) % 2**61
    return h % VOCAB


def sampled(tokens: dict) -> ModelRunnerOutput:
    """What a model runner returns for `tokens` (seq_id -> the token it sampled)."""
    return ModelRunnerOutput(sampled_token_ids={seq_id: [token] for seq_id, token in tokens.items()})


def new_token_ids(outputs) -> list:
    """The ids of the sequences an update_from_output gave a token."""
    return [out.request_id for out in outputs if out.new_token_ids]


def generate_alone(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list[int], str]:
    """The oracle: plain autoregressive loop, no blocks, no scheduler."""
    tokens, out = list(prompt), []
    stop_ids = params.all_stop_token_ids([EOS])
    while True:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if len(out) >= params.min_tokens and out[-1] in stop_ids:
            return out, "stop"
        if (params.max_tokens is not None and len(out) >= params.max_tokens) or len(tokens) >= max_model_len:
            return out, "length"


class FakePagedModel:
    def __init__(self, scheduler: Scheduler):
        self.bm = scheduler.block_manager
        self.kv = [None] * (self.bm.num_blocks * self.bm.block_size)  # one "K/V" per slot: the token id

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for seq in out.scheduled_seqs:  # write every scheduled token's K/V first, as one forward pass would
            start, n = seq.num_computed_tokens, out.num_scheduled_tokens[seq.seq_id]
            tokens = seq.all_token_ids
            for pos, slot in zip(range(start, start + n), self.bm.get_slot_mapping(seq, start, start + n)):
                self.kv[slot] = tokens[pos]
        tokens = {}
        for seq in out.scheduled_seqs:  # then attend over the context through the block table
            context_len = seq.num_computed_tokens + out.num_scheduled_tokens[seq.seq_id]
            context = [self.kv[slot] for slot in self.bm.get_slot_mapping(seq, 0, context_len)]
            assert context == seq.all_token_ids[:context_len], f"K/V of {seq} corrupted"
            tokens[seq.seq_id] = next_token(context)
        return sampled(tokens)


def run(scheduler: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 20_000,
        model: FakePagedModel | None = None) -> list[SchedulerOutput]:
    """Engine loop: add the sequences due at each step, then schedule -> run -> update. Pass `model` to keep
    one KV cache across runs (prefix caching reads what earlier runs wrote)."""
    model, outputs, step = model or FakePagedModel(scheduler), [], 0
    while scheduler.has_unfinished_seqs() or any(s >= step for s in arrivals):
        for seq in arrivals.get(step, []):
            scheduler.add_seq(seq)
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(out.scheduled_seqs) <= scheduler.max_num_seqs and len(scheduler.running) <= scheduler.max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        assert len({s.seq_id for s in out.scheduled_seqs}) == len(out.scheduled_seqs)
        scheduler.update_from_output(out, model.run(out))
        outputs.append(out)
        step += 1
        assert step < max_steps, "no progress"
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_cnt == 0 for b in bm.blocks), "blocks leaked"
    return outputs


def check_same_as_alone(seqs: list[Sequence], max_model_len: int) -> None:
    for seq in seqs:
        tokens, reason = generate_alone(seq.prompt_token_ids, seq.sampling_params, max_model_len)
        assert seq.output_token_ids == tokens, f"{seq} differs from running alone"
        assert seq.status.finish_reason == reason and seq.block_table == []


@settings(max_examples=100, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), max_num_seqs=st.integers(1, 6),
       extra_budget=st.integers(0, 40), num_seqs=st.integers(1, 10), spare_blocks=st.integers(0, 12))
def test_every_sequence_gets_what_it_gets_alone(data, block_size, max_num_seqs, extra_budget, num_seqs,
                                                spare_blocks):
    max_model_len = 48
    num_blocks = -(-max_model_len // block_size) + spare_blocks  # tiny pools force preemption
    scheduler = Scheduler(num_blocks, block_size, max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_seqs + extra_budget, eos_token_ids=[EOS])
    arrivals: dict[int, list[Sequence]] = {}
    seqs = []
    for i in range(num_seqs):
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len - 1))
        params = SamplingParams(max_tokens=data.draw(st.sampled_from([None, 1, 5, 30])),
                                ignore_eos=data.draw(st.booleans()),
                                stop_token_ids=data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)))
        seq = Sequence(i, prompt, params)
        arrivals.setdefault(data.draw(st.integers(0, 10)), []).append(seq)
        seqs.append(seq)
    run(scheduler, arrivals)
    check_same_as_alone(seqs, max_model_len)


def test_preemption_under_a_tiny_pool_still_completes_everything():
    # the pool holds one sequence of max_model_len tokens: eight long ones must take turns
    scheduler = Scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=16)
    seqs = [Sequence(i, [(7 * i + j) % VOCAB for j in range(3 + 2 * i)], SamplingParams(max_tokens=None,
                                                                                     ignore_eos=True))
            for i in range(8)]
    outputs = run(scheduler, {0: seqs})
    assert sum(len(out.preempted_seqs) for out in outputs) > 0
    check_same_as_alone(seqs, max_model_len=32)
    assert all(seq.num_tokens == 32 for seq in seqs)


def test_decodes_never_starve_while_a_long_prompt_is_chunked():
    scheduler = Scheduler(num_blocks=200, block_size=16, max_model_len=3000, max_num_seqs=8,
                          max_num_batched_tokens=64)
    short = [Sequence(i, [i + 1] * 5, SamplingParams(max_tokens=200, ignore_eos=True)) for i in range(4)]
    long = Sequence(99, [3] * 2000, SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = run(scheduler, {0: short, 3: [long]})
    prefill_steps = [out for out in outputs if out.num_scheduled_tokens.get(long.seq_id, 0) > 1]
    assert len(prefill_steps) == -(-2000 // 60)  # 60 = budget 64 minus the 4 decodes
    for out in prefill_steps:
        assert all(out.num_scheduled_tokens[s.seq_id] == 1 for s in short)  # every decode got its token
        assert out.total_num_scheduled_tokens <= 64
    check_same_as_alone(short + [long], max_model_len=3000)


def test_a_chunk_that_ends_mid_prompt_samples_nothing():
    scheduler = Scheduler(num_blocks=10, block_size=4, max_model_len=20, max_num_seqs=2, max_num_batched_tokens=4)
    seq = Sequence(0, list(range(10)), SamplingParams(max_tokens=2))
    scheduler.add_seq(seq)
    for computed in (4, 8):
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {0: 4}
        assert new_token_ids(scheduler.update_from_output(out, sampled({0: 123}))) == []  # ignored
        assert seq.num_computed_tokens == computed and seq.output_token_ids == [] and seq.is_prefill
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {0: 2}
    assert new_token_ids(scheduler.update_from_output(out, sampled({0: 7}))) == [0] and seq.output_token_ids == [7]


def test_abort_frees_blocks_immediately():
    scheduler = Scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=1, max_num_batched_tokens=8)
    running, waiting = Sequence(0, [1] * 9), Sequence(1, [2] * 3)
    scheduler.add_seq(running)
    scheduler.add_seq(waiting)
    out = scheduler.schedule()
    assert out.scheduled_seqs == [running] and scheduler.block_manager.num_free_blocks == 5
    assert scheduler.abort(0) is running  # mid-step: the step's result for it is then ignored
    assert scheduler.block_manager.num_free_blocks == 8 and running.status.finish_reason == "abort"
    assert scheduler.update_from_output(out, sampled({0: 5})) == [] and running.num_computed_tokens == 0
    assert scheduler.abort(1) is waiting and waiting.status == SequenceStatus.FINISHED_ABORTED
    assert scheduler.abort(1) is None and scheduler.abort(42) is None
    assert not scheduler.has_unfinished_seqs() and scheduler.schedule().scheduled_seqs == []


def test_stop_conditions():
    def finish(params: SamplingParams, tokens: list[int], max_model_len: int = 64) -> Sequence:
        scheduler = Scheduler(16, 4, max_model_len, max_num_seqs=1, max_num_batched_tokens=8, eos_token_ids=[EOS])
        seq = Sequence(0, [1, 2], params)
        scheduler.add_seq(seq)
        for token in tokens:
            scheduler.update_from_output(scheduler.schedule(), sampled({0: token}))
        assert not scheduler.has_unfinished_seqs() and scheduler.block_manager.num_free_blocks == 16
        return seq

    assert finish(SamplingParams(), [5, EOS]).status == SequenceStatus.FINISHED_STOPPED
    seq = finish(SamplingParams(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS])
    assert seq.status.finish_reason == "length" and seq.output_token_ids == [EOS] * 3
    assert finish(SamplingParams(stop_token_ids=[9]), [5, 9]).status.finish_reason == "stop"
    seq = finish(SamplingParams(min_tokens=2, max_tokens=3), [EOS, 4, 5])  # eos too early: not a stop
    assert seq.status.finish_reason == "length"
    seq = finish(SamplingParams(max_tokens=None), [5, 6, 7], max_model_len=5)
    assert seq.status.finish_reason == "length" and seq.num_tokens == 5


def test_bad_configuration_and_prompts_are_value_errors():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(8, 4, 32, max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="fit in the KV cache"):
        Scheduler(8, 4, 33)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(8, 4, 32, max_num_seqs=0)
    scheduler = Scheduler(8, 4, 32)
    with pytest.raises(ValueError, match="no room for output"):
        scheduler.add_seq(Sequence(0, [1] * 32))


def test_preemption_frees_the_newest_and_puts_it_at_the_head_of_the_queue():
    scheduler = Scheduler(num_blocks=4, block_size=2, max_model_len=8, max_num_seqs=2, max_num_batched_tokens=8)
    a, b, c = Sequence(0, [1] * 4), Sequence(1, [2] * 4), Sequence(2, [3])
    for seq in (a, b, c):
        scheduler.add_seq(seq)
    out = scheduler.schedule()  # a and b fill the pool; c waits (max_num_seqs)
    assert out.scheduled_seqs == [a, b] and scheduler.block_manager.num_free_blocks == 0
    scheduler.update_from_output(out, sampled({0: 5, 1: 6}))
    out = scheduler.schedule()  # a's sampled token starts a new block: b, the newest, makes room
    assert out.preempted_seqs == [b] and out.scheduled_seqs == [a]  # and nothing is admitted this step
    assert scheduler.num_preemptions == 1  # vLLM's num_preemptions_total, on /metrics
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)  # per request: vLLM's request_num_preemptions
    assert list(scheduler.waiting) == [b, c]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_table == []
    assert b.output_token_ids == [6] and b.is_prefill  # its 5 tokens are recomputed when it is readmitted


# ---- the priority policy (vLLM's scheduling_policy="priority": lower value, earlier handling) ----

def test_priority_orders_admission_and_chooses_whom_to_preempt():
    scheduler = Scheduler(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=64,
                          policy="priority")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    low = Sequence("low", [1, 2, 3, 4, 5, 6, 7], params, arrival_time=0.0, priority=5)
    scheduler.add_seq(low)
    out = scheduler.schedule()  # low runs alone: 2 blocks
    scheduler.update_from_output(out, sampled({"low": 9}))
    late = [Sequence(f"q{p}", [p] * 7, params, arrival_time=1.0 + p, priority=p) for p in (3, 1, 2)]
    for seq in late:
        scheduler.add_seq(seq)
    assert [s.seq_id for s in scheduler.waiting] == ["q1", "q2", "q3"]  # by priority, not by arrival
    preempted = []
    for _ in range(40):
        out = scheduler.schedule()
        preempted += [s.seq_id for s in out.preempted_seqs]
        scheduler.update_from_output(out, sampled({s.seq_id: 9 for s in out.scheduled_seqs}))
        if not scheduler.has_unfinished_seqs():
            break
    assert preempted and all(p in ("low", "q3", "q2") for p in preempted)
    assert "q1" not in preempted  # the highest priority is never the one to give its blocks up
    assert preempted[0] == "low"  # the lowest priority goes first, although it arrived first


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3), st.integers(0, 8)), min_size=2, max_size=10))
def test_priority_scheduling_gives_every_sequence_its_alone_output(specs):
    scheduler = Scheduler(num_blocks=12, block_size=4, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=16,
                          eos_token_ids=[EOS], policy="priority")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    arrivals: dict[int, list[Sequence]] = {}
    for i, (length, priority, step) in enumerate(specs):
        seq = Sequence(i, [(i * 7 + j) % VOCAB + 1 for j in range(length)], params, priority=priority)
        arrivals.setdefault(step, []).append(seq)
    run(scheduler, arrivals)
    for seqs in arrivals.values():
        for seq in seqs:
            assert seq.output_token_ids == generate_alone(seq.prompt_token_ids, params, 40)[0]


# ---- prefix caching: the fake model reads every context back through the block table, so a cached block
# ---- holding the wrong tokens, or one evicted while in use, changes the output

@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(0, 12)), min_size=2, max_size=12),
       st.sampled_from([1, 2, 4]), st.integers(6, 20))
def test_prefix_caching_gives_every_sequence_its_alone_output(specs, block_size, num_blocks):
    prefixes = [[(7 * p + j) % (VOCAB - 1) + 1 for j in range(9)] for p in range(3)]  # shared system prompts
    max_model_len = min(num_blocks * block_size, 40)
    scheduler = Scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                          max_num_seqs=4, max_num_batched_tokens=8, eos_token_ids=[EOS], enable_prefix_caching=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    arrivals: dict[int, list[Sequence]] = {}
    for i, (prefix, suffix_len, step) in enumerate(specs):
        prompt = (prefixes[prefix] + [(i * 5 + j) % (VOCAB - 1) + 1 for j in range(suffix_len)])[:max_model_len - 1]
        arrivals.setdefault(step, []).append(Sequence(i, prompt, params))
    run(scheduler, arrivals)
    for seqs in arrivals.values():
        for seq in seqs:
            expected = generate_alone(seq.prompt_token_ids, params, max_model_len)[0]
            assert seq.output_token_ids == expected
            assert 0 <= seq.num_cached_tokens < seq.num_prompt_tokens


def test_a_cached_prefix_is_found_and_evicted_least_recently_used_first():
    scheduler = Scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64,
                          enable_prefix_caching=True)
    bm, model = scheduler.block_manager, FakePagedModel(scheduler)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    first = Sequence("a", list(range(1, 11)), params)  # 10 tokens: blocks [1..4] [5..8] full, [9 10] not
    run(scheduler, {0: [first]}, model=model)
    assert len(bm.cached_blocks) == 2 and bm.num_free_blocks == 8  # freed, but its two full blocks stay cached
    again = Sequence("b", list(range(1, 11)) + [42], params)
    run(scheduler, {0: [again]}, model=model)
    assert again.num_cached_tokens == 8  # two blocks hit; only 3 tokens computed
    exact = Sequence("c", list(range(1, 9)), params)  # ends on a block boundary: its last token is recomputed
    run(scheduler, {0: [exact]}, model=model)
    assert exact.num_cached_tokens == 4
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11 + 8, 0 + 8 + 4)
    # the free queue, least recently freed first, is now [5 6 7 2 3 1 4 0]: [1..4] lives in block 0 (freed last),
    # [5..8] in block 1. Six new blocks take 5 6 7 2 3 1: block 1 is evicted, its hash with it; block 0 stays.
    h0, h1 = first.block_hashes(4)[:2]
    assert [b.block_id for b in bm.free_block_queue] == [5, 6, 7, 2, 3, 1, 4, 0]
    run(scheduler, {0: [Sequence(f"o{i}", [50 + i] * 12, params) for i in range(2)]}, model=model)
    assert bm.cached_blocks[h0] is bm.blocks[0] and h1 not in bm.cached_blocks
    fresh = Sequence("d", list(range(1, 11)), params)
    assert bm.cached_prefix(fresh) == [bm.blocks[0]]
    run(scheduler, {0: [fresh]}, model=model)  # the fake model checks the context it reads back
    assert fresh.num_cached_tokens == 4


def test_prefix_caching_off_caches_nothing():
    scheduler = Scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    run(scheduler, {0: [Sequence("a", list(range(1, 11)), params)]})
    again = Sequence("b", list(range(1, 11)), params)
    run(scheduler, {0: [again]})
    assert again.num_cached_tokens == 0 and not scheduler.block_manager.cached_blocks
