"""Wide requests never push a step past max_num_seqs: beams and n > 1 are ordinary requests to the engine core.

The defect this guards against: a beam search (or a large n) arriving while the batch was nearly full was admitted
as one sequence, then forked into k inside the scheduler; the step held more sequences than the model runner has
rows, the runner indexed past max_num_seqs (IndexError) and the server ended every running request. Now n > 1 and
the beams of a beam search are separate requests above the core (engine/parent_request.py, engine/beam_search.py),
admitted one seat each; and a step that fails as a whole is retried in parts, so only the requests that make it
fail end.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyvllm.engine.beam_search import BeamSearchParams
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams

MAX_NUM_SEQS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, max_model_len=128, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=16,
                       kv_cache_memory="4MiB", enable_prefix_caching=False)
    schedule = engine.scheduler.schedule
    engine.widest_step = 0

    def counting():  # the widest step any test ran
        out = schedule()
        engine.widest_step = max(engine.widest_step, len(out.scheduled_seqs), len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = counting
    return engine


def run(engine, requests: dict, arrivals: dict | None = None) -> dict:
    """requests: {id: (prompt, params)}, each added at step arrivals[id] (default 0); every output by id."""
    arrivals = arrivals or {}
    outputs, step = {}, 0
    while len(outputs) < len(requests):
        for rid, request in requests.items():
            if arrivals.get(rid, 0) == step:
                engine.add_request(rid, *request)
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
        step += 1
        assert step < 500, "the engine stopped making progress"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished_requests()  # no block left taken
    return outputs


_alone: dict = {}


def alone(engine, prompt: list[int], params) -> list[list[int]]:
    key = (tuple(prompt), repr(params))
    if key not in _alone:
        _alone[key] = [c.token_ids for c in run(engine, {"alone": (prompt, params)})["alone"].outputs]
    return _alone[key]


def tokens(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("wide", [BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True),
                                  SamplingParams(n=4, temperature=0, max_tokens=4, ignore_eos=True)],
                         ids=["beam-4", "n-4"])
def test_a_wide_request_into_a_nearly_full_batch(engine, wide):
    # the reported shape: max_num_seqs - 1 running, then a request 4 wide arrives (it used to make 7 rows of 4)
    requests = {f"r{i}": ([10 + i, 11, 12], GREEDY) for i in range(MAX_NUM_SEQS - 1)}
    requests["wide"] = ([5, 6, 7], wide)
    engine.widest_step = 0
    out = run(engine, requests, arrivals={"wide": 1})
    assert engine.widest_step <= MAX_NUM_SEQS
    assert all(o.error is None for o in out.values())
    for i in range(MAX_NUM_SEQS - 1):
        assert tokens(out[f"r{i}"]) == alone(engine, [10 + i, 11, 12], GREEDY)
    assert tokens(out["wide"]) == alone(engine, [5, 6, 7], wide)


def test_requests_wider_than_a_step_run_in_turns(engine):
    engine.widest_step = 0
    wide = BeamSearchParams(beam_width=5, max_tokens=3, ignore_eos=True)
    out = run(engine, {"beams": ([5, 6], wide),
                       "n": ([5, 6], SamplingParams(n=6, temperature=0, max_tokens=3, ignore_eos=True))})
    assert len(out["beams"].outputs) == 5 and len(out["n"].outputs) == 6 and engine.widest_step <= MAX_NUM_SEQS
    assert tokens(out["beams"]) == alone(engine, [5, 6], wide)


def test_a_failed_step_ends_only_the_request_that_caused_it(engine, monkeypatch):
    execute_model = engine.model_runner.execute_model

    def failing(scheduler_output, *args, **kwargs):  # a request that breaks the forward pass of any batch it is in
        if any(seq.seq_id == "bad" and seq.num_output_tokens == 2 for seq in scheduler_output.scheduled_seqs):
            raise IndexError("injected: index 4 is out of bounds for axis 0 with size 4")
        return execute_model(scheduler_output, *args, **kwargs)

    monkeypatch.setattr(engine.model_runner, "execute_model", failing)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)
    requests = {"ok": ([20, 21], GREEDY), "seeded": ([22, 23], sampled), "bad": ([24, 25], GREEDY),
                "beam": ([26, 27], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))}
    out = run(engine, requests)
    monkeypatch.undo()
    assert out["bad"].error and "IndexError: injected" in out["bad"].error
    assert out["bad"].outputs[0].finish_reason == "error"
    for rid in ("ok", "seeded", "beam"):  # the step was retried without "bad": the others never noticed
        assert out[rid].error is None and tokens(out[rid]) == alone(engine, *requests[rid])


def request_mix():
    kinds = st.sampled_from(["greedy", "n", "beam"])
    return st.lists(st.tuples(kinds, st.integers(1, 4), st.integers(0, 3), st.integers(1, 6)), min_size=3,
                    max_size=6)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(mix=request_mix())
def test_forks_mixed_into_full_batches(engine, mix):
    """Property: any mix of plain, n-wide and beam requests arriving at any step runs with no step wider than
    max_num_seqs, every request completes without error, and each gets the tokens it gets alone."""
    requests, arrivals = {}, {}
    for i, (kind, width, arrival, length) in enumerate(mix):
        prompt = [30 + i + j for j in range(length)]
        if kind == "beam":
            params = BeamSearchParams(beam_width=width, max_tokens=3, ignore_eos=True)
        else:
            params = SamplingParams(n=width if kind == "n" else 1, temperature=0, max_tokens=3, ignore_eos=True)
        requests[f"{kind}{i}"], arrivals[f"{kind}{i}"] = (prompt, params), arrival
    engine.widest_step = 0
    out = run(engine, requests, arrivals)
    assert engine.widest_step <= MAX_NUM_SEQS
    for rid, request in requests.items():
        assert out[rid].error is None and tokens(out[rid]) == alone(engine, *request)
