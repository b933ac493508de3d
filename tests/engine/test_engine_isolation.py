"""One request's bad parameters, or a failure while sampling it, never fail another request's step.

Bad input is refused at `add_request` with a ValueError that names the field; whatever still goes wrong
inside a step (the host sampler, the detokenizer, a stop string) finishes that request alone with an
error (`finish_reason` "error", `RequestOutput.error`), frees its blocks, and the batch goes on.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_engine import alone, engine, run_all, tiny_dir  # noqa: F401  (module fixtures)
from tinyvllm.sampling_params import SamplingParams

VOCAB = 49152


def no_blocks_held(engine) -> bool:
    bm = engine.scheduler.block_manager
    return (bm.num_free_blocks == bm.num_blocks and not engine.scheduler.requests
            and not engine.output_processor.request_states)


def test_huge_top_k_is_clamped_to_the_vocabulary(engine):
    # the server's first defect: top_k = 2**31 overflowed the int32 per-row parameters and failed the whole step
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = run_all(engine, {"huge-top-k": ([5, 6, 7], SamplingParams(temperature=0.9, top_k=2147483648, seed=1,
                                                                     max_tokens=4, ignore_eos=True)),
                           "neighbour": ([8, 9], greedy)})
    assert len(out["huge-top-k"].outputs[0].token_ids) == 4 and out["huge-top-k"].error is None
    assert out["neighbour"].outputs[0].token_ids == alone(engine, "n", [8, 9], greedy).outputs[0].token_ids
    unlimited = run_all(engine, {"all": ([5, 6, 7], SamplingParams(temperature=0.9, top_k=-1, seed=1, max_tokens=4,
                                                                    ignore_eos=True))})["all"]
    assert out["huge-top-k"].outputs[0].token_ids == unlimited.outputs[0].token_ids  # k >= vocab: no filter
    assert no_blocks_held(engine)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(min_tokens=1, stop_token_ids=[VOCAB], max_tokens=4), "stop_token_ids"),  # the second defect
    (SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    (SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias"),
])
def test_token_ids_outside_the_vocabulary_are_refused(engine, params, field):
    with pytest.raises(ValueError, match=rf"{field} must be token ids in \[0, {VOCAB}\)"):
        engine.add_request("out-of-vocab", [5, 6], params)
    assert "out-of-vocab" not in engine.output_processor.request_states and not engine.has_unfinished_requests()


def test_a_failure_inside_the_step_ends_that_request_alone(engine, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = {f"ok{i}": ([100 + i] * (i + 2), greedy) for i in range(4)}
    requests["bad"] = ([7, 8, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    requests["n2"] = ([3, 4], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    sample_on_host = engine.model_runner.sampler.sample_on_host

    def failing(seq, *args):
        if seq.seq_id == "bad" and seq.num_output_tokens == 3 or seq.seq_id == "n2-1":
            raise RuntimeError("injected")
        return sample_on_host(seq, *args)

    monkeypatch.setattr(engine.model_runner.sampler, "sample_on_host", failing)
    out = run_all(engine, requests)
    monkeypatch.undo()
    assert out["bad"].error and "RuntimeError: injected" in out["bad"].error
    assert out["bad"].outputs[0].finish_reason == "error" and len(out["bad"].outputs[0].token_ids) == 3
    assert out["n2"].error and out["n2"].finished  # one completion failed: the request as a whole has failed
    for i in range(4):
        expected = alone(engine, f"ok{i}", *requests[f"ok{i}"]).outputs[0].token_ids
        assert out[f"ok{i}"].outputs[0].token_ids == expected and out[f"ok{i}"].error is None
    assert no_blocks_held(engine)


# ---- a property: random mixes of valid and invalid parameters in one running batch ----

def request_params():
    """Parameter mixes, valid and not: huge or negative top_k, stop ids and logit bias inside and outside the
    vocabulary, min_tokens, penalties, logprobs."""
    return st.fixed_dictionaries({}, optional={
        "temperature": st.sampled_from([0, 0.7, 1.5, -1.0]),
        "top_k": st.sampled_from([-1, 0, 1, 5, VOCAB, 2**31, 2**40, -7]),
        "top_p": st.sampled_from([1.0, 0.5, 0.0]),
        "min_tokens": st.integers(0, 3),
        "stop_token_ids": st.lists(st.sampled_from([0, 2, 5000, VOCAB - 1, VOCAB, 10**12, -1]), max_size=2),
        "logit_bias": st.dictionaries(st.sampled_from([3, 200, VOCAB, -2]), st.sampled_from([-100.0, 5.0, 1e9]),
                                      max_size=2),
        "repetition_penalty": st.sampled_from([1.0, 1.2, 0.0]),
        "logprobs": st.sampled_from([None, 0, 3, 21]),
        "seed": st.integers(0, 2**64 + 5),
    })


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=st.lists(st.tuples(st.lists(st.integers(10, 40000), min_size=1, max_size=40), request_params()),
                    min_size=2, max_size=6))
def test_valid_requests_finish_as_alone_whatever_runs_beside_them(engine, mix):
    accepted = {}
    for i, (prompt, fields) in enumerate(mix):
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True, **fields)
            engine.add_request(f"mix{i}", prompt, params)
        except ValueError:
            assert f"mix{i}" not in engine.output_processor.request_states  # refused with no trace
            continue
        accepted[f"mix{i}"] = (prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
    assert set(outputs) == set(accepted)
    for request_id, (prompt, params) in accepted.items():
        out = outputs[request_id]
        assert out.error is None and len(out.outputs[0].token_ids) == 5
        if params.is_greedy or params.seed is not None:  # deterministic: the same tokens as alone
            assert out.outputs[0].token_ids == alone(engine, request_id, prompt, params).outputs[0].token_ids
    assert no_blocks_held(engine)
