"""Sampling: SamplingParams validation, the numpy reference sampler, stop strings.

HF transformers' logits processors are the outside oracle for penalties and the top-k / top-p / min-p
masks; everything else is checked against hand-computed numbers or exact properties.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.sample import (
    Sampler,
    StopStringChecker,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p_min_p,
    apply_top_p,
    logprobs_of,
    make_generator,
    softmax,
)
from tinyvllm.sampling_params import SamplingParams, SamplingType

sampler = Sampler()


def draw(logits, params, n, prompt=(), output=(), eos=()):
    """n tokens sampled independently at the same position, with the request's own generator."""
    g = make_generator(params.seed)
    return np.array([sampler(logits, params, list(prompt), list(output), g, eos) for _ in range(n)])


def kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", math.nan), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.01),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", math.inf), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("seed", "42"),
    ("seed", 2**64), ("max_tokens", 0), ("max_tokens", 2.0), ("min_tokens", -1), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("ignore_eos", "yes"), ("include_stop_str_in_output", 1),
    ("skip_special_tokens", None), ("logprobs", 2.5), ("logprobs", -2), ("prompt_logprobs", -3),
    ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", [1, 2]),
])
def test_invalid_value_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    shown = [value, *value.keys(), *value.values()] if isinstance(value, dict) else [value]
    assert any(repr(v) in str(err.value) for v in shown), f"the message shows the bad value: {err.value}"


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_valid_edges_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.stop_token_ids) == (1, 1.0, 1.0, -1, 16,
                                                                                                [], [])
    for kwargs in [dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=1.0),
                   dict(presence_penalty=-2, frequency_penalty=2), dict(logprobs=0), dict(logprobs=20),
                   dict(max_tokens=None), dict(seed=-1), dict(seed=2**64 - 1), dict(logit_bias={0: -100, 7: 100})]:
        SamplingParams(**kwargs)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


def test_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0
    assert dataclasses.replace(p, temperature=0.0).is_greedy


def test_sampling_type_and_stop_ids():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).is_greedy  # below SAMPLING_EPS
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    p = SamplingParams(stop_token_ids=[5, 6])
    assert p.all_stop_token_ids([2]) == {2, 5, 6}
    assert dataclasses.replace(p, ignore_eos=True).all_stop_token_ids([2]) == {5, 6}


# ---------------------------------------------------------------- penalties, bias, min_tokens


def test_worked_example_from_the_module_docstring():
    p = SamplingParams(temperature=0.5, repetition_penalty=1.25, frequency_penalty=0.2, presence_penalty=0.2,
                       min_p=0.1, top_k=3, top_p=0.8)
    logits = np.array([2.0, 1.5, 1.0, 0.0, -1.0])
    penalized = apply_penalties(logits, [2], [0, 0], p)
    np.testing.assert_allclose(penalized, [1.0, 1.5, 0.8, 0.0, -1.0], atol=1e-12)
    filtered = apply_top_k_top_p_min_p(apply_temperature(penalized, p.temperature), p)
    np.testing.assert_allclose(softmax(filtered), [1 / (1 + math.e), math.e / (1 + math.e), 0, 0, 0], atol=1e-12)


def test_each_penalty_by_hand():
    logits = np.array([3.0, -2.0, 0.0, 1.0, -1.0])
    prompt, output = [0, 1], [2, 3, 3]  # token 4 never seen
    rep = apply_penalties(logits, prompt, output, SamplingParams(repetition_penalty=2.0))
    np.testing.assert_allclose(rep, [1.5, -4.0, 0.0, 0.5, -1.0])  # positive / 2, negative * 2, zero stays
    freq = apply_penalties(logits, prompt, output, SamplingParams(frequency_penalty=0.5))
    np.testing.assert_allclose(freq, [3.0, -2.0, -0.5, 0.0, -1.0])  # output counts only: token 3 twice
    pres = apply_penalties(logits, prompt, output, SamplingParams(presence_penalty=-0.5))
    np.testing.assert_allclose(pres, [3.0, -2.0, 0.5, 1.5, -1.0])  # negative presence encourages
    both = apply_penalties(logits, prompt, output, SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                                                  presence_penalty=0.25))
    np.testing.assert_allclose(both, [1.5, -4.0, -0.75, -0.75, -1.0])  # repetition first, then subtract
    assert apply_penalties(logits, prompt, output, SamplingParams()) is logits  # all off: untouched


def test_penalties_apply_to_greedy():
    logits = np.array([2.0, 1.9, 0.0])
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, greedy, [], [0], None) == 0
    assert sampler(logits, dataclasses.replace(greedy, frequency_penalty=0.2), [], [0], None) == 1
    assert sampler(logits, dataclasses.replace(greedy, repetition_penalty=1.1), [0], [], None) == 1


def test_logit_bias():
    logits = np.zeros(4)
    out = apply_logit_bias(logits, SamplingParams(logit_bias={1: 2.5, 3: -100}))
    np.testing.assert_array_equal(out, [0, 2.5, 0, -100])
    assert (logits == 0).all(), "inputs are never modified in place"
    assert sampler(logits, SamplingParams(temperature=0, logit_bias={2: 0.1}), [], [], None) == 2
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(logits, SamplingParams(logit_bias={4: 1.0}))


def test_min_tokens_bans_stop_tokens_until_reached():
    eos, stop_id = 0, 3
    logits = np.array([10.0, 1.0, 2.0, 9.0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop_id])
    assert sampler(logits, p, [], [1], None, eos_token_ids=[eos]) == 2  # eos and the stop id banned
    assert sampler(logits, p, [], [1, 1], None, eos_token_ids=[eos]) == eos  # min_tokens reached
    ignore = dataclasses.replace(p, ignore_eos=True)
    assert sampler(logits, ignore, [], [1], None, eos_token_ids=[eos]) == eos  # eos is not a stop token then
    banned = apply_min_tokens(logits, p, 0, [eos])
    assert kept(banned) == {1, 2}
    random = dataclasses.replace(p, temperature=1.0, seed=0)
    assert set(draw(logits, random, 500, output=[1], eos=[eos]).tolist()) <= {1, 2}


@pytest.mark.oracle
def test_repetition_penalty_matches_hf():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(0)
    for penalty in (0.5, 0.9, 1.3, 2.0):
        logits = rng.normal(size=200) * 3
        prompt = rng.integers(0, 200, size=30).tolist()
        output = rng.integers(0, 200, size=20).tolist()
        ours = apply_penalties(logits, prompt, output, SamplingParams(repetition_penalty=penalty))
        input_ids = torch.tensor([prompt + output])
        theirs = hf.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, torch.tensor(logits[None]))[0].numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- filters


def test_top_k_exact_masks_and_ties():
    logits = np.array([0.5, 3.0, 1.0, 2.0, -1.0])
    assert kept(apply_top_k(logits, 2)) == {1, 3}
    assert kept(apply_top_k(logits, 1)) == {1}
    assert kept(apply_top_k(logits, 5)) == kept(apply_top_k(logits, 0)) == kept(apply_top_k(logits, -1)) == set(
        range(5))
    ties = np.array([1.0, 2.0, 2.0, 0.0, 2.0])
    assert kept(apply_top_k(ties, 1)) == {1, 2, 4}  # every token equal to the k-th largest survives
    assert kept(apply_top_k(ties, 4)) == {0, 1, 2, 4}


def test_top_p_exact_masks():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_p(logits, 0.4)) == {0}
    assert kept(apply_top_p(logits, 0.75)) == {0, 1}
    assert kept(apply_top_p(logits, 0.85)) == {0, 1, 2}
    assert kept(apply_top_p(logits, 0.99)) == {0, 1, 2, 3}
    assert kept(apply_top_p(logits, 1e-9)) == {0}  # always at least the most likely token
    ties = np.log([0.3, 0.3, 0.3, 0.1])
    assert kept(apply_top_p(ties, 0.2)) == {0, 1, 2}  # equal probabilities go together


def test_min_p_exact_masks():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_min_p(logits, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert kept(apply_min_p(logits, 0.5)) == {0, 1}  # threshold 0.25
    assert kept(apply_min_p(logits, 1.0)) == {0}


@pytest.mark.parametrize("kwargs, allowed", [
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.75), {0, 1}),
    (dict(min_p=0.5), {0, 1}),
    (dict(top_k=3, top_p=0.6), {0, 1}),  # top-p measured on the top-3 renormalised: 0.5 / 0.95 < 0.6
])
def test_filters_never_emit_an_excluded_token(kwargs, allowed):
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    tokens = draw(logits, SamplingParams(seed=1, **kwargs), 3000)
    assert set(tokens.tolist()) == allowed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=1, max_size=40), st.integers(1, 45), st.floats(0.01, 1.0))
def test_filter_properties(values, top_k, top_p):
    logits = np.array(values)
    k = apply_top_k(logits, top_k)
    assert len(kept(k)) >= min(top_k, len(values))
    assert np.argmax(logits) in kept(k)
    if kept(k) != set(range(len(values))):
        assert logits[list(kept(k))].min() > logits[np.isinf(k)].max()  # kept are exactly the largest

    p = apply_top_p(logits, top_p)
    probs, keep = softmax(logits), sorted(kept(p))
    assert np.argmax(logits) in keep
    assert probs[keep].sum() >= top_p - 1e-9  # enough mass
    least = logits[keep].min()
    assert probs[logits > least].sum() < top_p + 1e-9  # and no more than needed
    assert (np.isinf(p) == (logits < least)).all()  # a value threshold: ties are kept together


@pytest.mark.oracle
def test_filter_masks_match_hf():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(1)
    for trial in range(50):
        logits = rng.normal(size=300) * rng.uniform(0.5, 4)
        top_k, top_p, min_p = int(rng.integers(1, 300)), float(rng.uniform(0.05, 0.99)), float(rng.uniform(0, 0.3))

        def hf_chain(*procs):
            scores = torch.tensor(logits[None])
            for proc in procs:
                scores = proc(None, scores)
            return scores[0].numpy()

        assert kept(apply_top_k(logits, top_k)) == kept(hf_chain(hf.TopKLogitsWarper(top_k)))
        assert kept(apply_top_p(logits, top_p)) == kept(hf_chain(hf.TopPLogitsWarper(top_p)))
        assert kept(apply_min_p(logits, min_p)) == kept(hf_chain(hf.MinPLogitsWarper(min_p)))
        ours = apply_top_k_top_p_min_p(logits, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p))
        theirs = hf_chain(hf.MinPLogitsWarper(min_p), hf.TopKLogitsWarper(top_k), hf.TopPLogitsWarper(top_p))
        assert kept(ours) == kept(theirs), trial


# ---------------------------------------------------------------- sampling


def test_seeded_runs_reproduce_and_seeds_differ():
    rng = np.random.default_rng(0)
    steps = rng.normal(size=(40, 1000))  # logits of 40 positions

    def generate(params):
        g, out = make_generator(params.seed), []
        for logits in steps:
            out.append(sampler(logits, params, [1, 2, 3], out, g))
        return out

    p = SamplingParams(temperature=1.2, top_p=0.95, frequency_penalty=0.3, seed=1234)
    assert generate(p) == generate(p)
    assert generate(p) != generate(dataclasses.replace(p, seed=1235))
    assert generate(dataclasses.replace(p, seed=-5)) == generate(dataclasses.replace(p, seed=-5))


def test_greedy_is_argmax_and_the_low_temperature_limit():
    rng = np.random.default_rng(2)
    for _ in range(20):
        logits = rng.permutation(np.arange(100) * 0.1)  # distinct, gaps >= 0.1
        assert sampler(logits, SamplingParams(temperature=0), [], [], None) == np.argmax(logits)
        # at T = 1e-3 a gap of 0.1 is a factor exp(100): the argmax always wins
        assert (draw(logits, SamplingParams(temperature=1e-3, seed=0), 50) == np.argmax(logits)).all()
    assert sampler(np.array([1.0, 3.0, 3.0]), SamplingParams(temperature=0), [], [], None) == 1  # lowest id


@pytest.mark.parametrize("temperature, kwargs", [(1.0, {}), (0.6, {}), (1.7, {}), (0.8, dict(top_k=4, min_p=0.05))])
def test_empirical_distribution_matches_softmax(temperature, kwargs):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    params = SamplingParams(temperature=temperature, seed=7, **kwargs)
    n = 20_000
    freq = np.bincount(draw(logits, params, n), minlength=len(logits)) / n
    expected = softmax(apply_top_k_top_p_min_p(apply_temperature(logits, temperature), params))
    # one standard deviation of a frequency is at most sqrt(0.25 / n) = 0.0035: allow 4
    np.testing.assert_allclose(freq, expected, atol=0.014)
    assert (freq[expected == 0] == 0).all()


def test_sampler_leaves_inputs_untouched():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    before = logits.copy()
    sampler(logits, SamplingParams(repetition_penalty=1.5, logit_bias={0: 1.0}, seed=0), [2], [1], make_generator(0))
    np.testing.assert_array_equal(logits, before)


def test_logprobs_of_raw_logits():
    logits = np.array([1.0, 3.0, 2.0, 3.0])
    logprob, top = logprobs_of(logits, 2, 3)
    log_z = math.log(sum(math.exp(x) for x in logits))
    assert logprob == pytest.approx(2.0 - log_z)
    assert [t for t, _ in top] == [1, 3, 2]  # best first, ties by token id
    assert top[0][1] == pytest.approx(3.0 - log_z)
    assert logprobs_of(logits, 0, 0)[1] == []


# ---------------------------------------------------------------- stop strings


def reference_stop(text: str, stop: list[str], include: bool) -> str:
    """Character at a time: the output where the first stop string ends (earliest start if two end together)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[:end] if include else text[:end - len(s)]
    return text


def stream(chunks: list[str], stop: list[str], include: bool = False) -> tuple[list[str], bool, str]:
    checker = StopStringChecker(stop, include)
    emitted, stopped = [], False
    for chunk in chunks:
        text, stopped = checker.feed(chunk)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(checker.flush())
    return emitted, stopped, checker.stop_str


def test_stop_string_across_chunks():
    emitted, stopped, which = stream(["Hello wor", "ld! more"], ["world"])
    assert emitted == ["Hello ", ""] and stopped and which == "world"
    emitted, stopped, _ = stream(["42</", "ans", "wer>\n", "ignored"], ["</answer>"])
    assert emitted == ["42", "", ""] and stopped
    emitted, _, _ = stream(["42</", "ans", "wer>\n"], ["</answer>"], include=True)
    assert "".join(emitted) == "42</answer>"


def test_stop_at_the_very_start_and_overlapping_stops():
    assert stream(["STOP", "x"], ["STOP"]) == ([""], True, "STOP")
    emitted, _, which = stream(["a", "b", "c", "d"], ["abcd", "bc"])
    assert "".join(emitted) == "a" and which == "bc"  # "bc" is complete first
    emitted, _, which = stream(["xabc"], ["abc", "bc"])
    assert "".join(emitted) == "x" and which == "abc"  # both end together: cut the longer
    emitted, _, _ = stream(list("aaab"), ["aab"])
    assert "".join(emitted) == "a"


def test_hold_back_then_release():
    checker = StopStringChecker(["<|end|>"], include_in_output=False)
    assert checker.feed("x <|en") == ("x ", False)  # "<|en" could still become the stop string
    assert checker.feed("try") == ("<|entry", False)  # it didn't: release it
    assert checker.feed(" <") == (" ", False)
    assert checker.flush() == "<"  # the stream ended: the held tail was text after all
    assert StopStringChecker([]).feed("anything") == ("anything", False)


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab<>", max_size=30), stop=st.lists(st.text("ab<>", min_size=1, max_size=4), min_size=1,
                                                          max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_stop_stream_equals_char_at_a_time(text, stop, cuts, include):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopStringChecker(stop, include)
    seen, emitted = "", ""
    for chunk in chunks:
        piece, stopped = checker.feed(chunk)
        seen, emitted = seen + chunk, emitted + piece
        # Never show what a continuation could still turn into a stop string: whatever comes next
        # (here: the rest of any stop string), the final output starts with what was emitted so far.
        for s in stop:
            for i in range(len(s)):
                assert reference_stop(seen + s[i:], stop, include).startswith(emitted)
        if stopped:
            break
    else:
        emitted += checker.flush()
    assert emitted == reference_stop(text, stop, include)
