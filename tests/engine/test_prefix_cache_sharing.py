"""n > 1 shares its prompt through the prefix cache (Phase 7a): its full blocks computed once and held once, and
every completion is the one it would be alone, with its seed.

On a tiny random model (seconds): the step profile counts the prompt tokens each step computes, the block manager
counts the blocks held; the completions are compared with the same requests run one at a time with n = 1 and
seed + i, under preemption (a small pool), a cap on running sequences, prefix caching off (each completion then
computes the prompt), and an abort of the completion that computes the prompt first.
"""

from __future__ import annotations

import pytest

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams

PROMPT = [(7 * i) % 500 + 3 for i in range(37)]  # 37 tokens, block_size 16: two full blocks and a partial one


def make_engine(tiny_model_dir, **kw) -> LLMEngine:
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="16MiB")
    return LLMEngine(tiny_model_dir, **{**args, **kw})


def run(engine: LLMEngine, requests: dict, profile: list | None = None) -> dict:
    """requests: {id: (prompt, params)}, all added at once; returns {id: token ids of each completion}. `profile`
    gets, per step, (prompt tokens computed, blocks in use)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = {}
    bm = engine.scheduler.block_manager
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule
        scheduled = []

        def schedule():  # the step profile: what the scheduler hands the model runner
            result = out()
            scheduled.append(result)
            return result

        engine.scheduler.schedule = schedule
        try:
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = [c.token_ids for c in o.outputs]
        finally:
            del engine.scheduler.schedule
        if profile is not None:
            (so,) = scheduled
            prompt_tokens = sum(max(0, min(s.num_prompt_tokens, s.num_computed_tokens)
                                    - (s.num_computed_tokens - so.num_scheduled_tokens[s.seq_id]))
                                for s in so.scheduled_seqs)
            profile.append((prompt_tokens, bm.num_blocks - bm.num_free_blocks))
    return outputs


def alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Completion i of an n-completion request, run by itself: n = 1 and seed + i."""
    out = []
    for i in range(params.n):
        one = SamplingParams(**{**params.__dict__, "n": 1, "seed": None if params.seed is None else params.seed + i})
        out += run(engine, {f"alone-{i}": (prompt, one)})[f"alone-{i}"]
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def test_the_prompt_is_computed_once_and_held_once(engine):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    profile = []
    together = run(engine, {"n4": (PROMPT, params)}, profile)["n4"]
    assert together == alone(engine, PROMPT, params)
    assert len({tuple(t) for t in together}) > 1  # the seeds differ, so do the completions
    prompt_tokens, blocks = zip(*profile)
    # the first completion computes the prompt; the other three read its two full blocks from the cache and
    # compute only the 5 tokens of the partial block: 37 + 3 x 5, not 4 x 37
    assert prompt_tokens[0] == len(PROMPT) and sum(prompt_tokens) == len(PROMPT) + 3 * 5
    assert blocks[0] == 3 and max(blocks) == 2 + 4  # the full blocks held once, a partial block each


@pytest.mark.parametrize("kw", [dict(num_gpu_blocks_override=9, max_model_len=144),  # 2 + 4 partial > 9: preempts
                                dict(max_num_seqs=2),  # two completions at a time
                                dict(enable_prefix_caching=False),  # each completion computes the prompt
                                dict(kv_cache_dtype="int8")])
def test_every_completion_is_the_one_it_is_alone(tiny_model_dir, kw):
    engine = make_engine(tiny_model_dir, **kw)
    sampled = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=3, max_tokens=20, ignore_eos=True)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    other = PROMPT[:20]
    together = run(engine, {"s": (PROMPT, sampled), "g": (other, greedy)})
    assert together["s"] == alone(engine, PROMPT, sampled)
    assert together["g"] == alone(engine, other, greedy) and together["g"][0] == together["g"][1]


def test_aborting_the_completion_that_computes_the_prompt(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.abort_request("a")  # all three, while two of them wait for the first one's prompt
    assert not engine.has_unfinished_requests() and not engine.parent_requests.parents
    # only the first completion, before its prompt is computed: the other two compute it themselves
    engine.add_request("b", PROMPT, params)
    engine.abort_request("b-0")
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == "b"), last)
    assert [c.token_ids for c in last.outputs[1:]] == alone(engine, PROMPT, params)[1:]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
