"""Phase 4: the batched device sampler (its kernel and the portable graph) picks exactly what the host reference
sampler picks with the same key; its random numbers are the host's too."""

from __future__ import annotations

import numpy as np
import pytest
from chi2 import SIGNIFICANCE, chi2_pvalue
from tinygrad import Tensor

from tinyvllm.sample import device_sampler, noise
from tinyvllm.sample.sampler import (apply_min_p, apply_top_k, apply_top_k_top_p_min_p, apply_top_p, random_sample,
                                     softmax)
from tinyvllm.sampling_params import SamplingParams

S, V = 8, 1000


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    x[1, :50] = x[1, 0]  # a 50-way tie
    x[2, 10:] = -np.inf  # an already-masked row: only 10 candidates
    return x


def masked(x):
    return np.isinf(x) & (x < 0)


@pytest.mark.parametrize("top_k", [[1, 5, 50, 999, 1000, 3, 10, 2000]])
def test_top_k_mask_equals_host(logits, top_k):
    out = device_sampler.apply_top_k(Tensor(logits), Tensor(np.array(top_k, np.int32))).numpy()
    for i in range(S):
        assert np.array_equal(masked(out[i]), masked(apply_top_k(logits[i].astype(np.float64), top_k[i]))), i


@pytest.mark.parametrize("top_p", [[1.0, 0.9, 0.5, 0.1, 0.99, 0.7, 0.01, 0.3]])
def test_top_p_mask_equals_host(logits, top_p):
    out = device_sampler.apply_top_p(Tensor(logits), Tensor(np.array(top_p, np.float32))).numpy()
    for i in range(S):
        assert np.array_equal(masked(out[i]), masked(apply_top_p(logits[i].astype(np.float64), top_p[i]))), i


def test_min_p_mask_equals_host(logits):
    min_p = [0, 0.1, 0, 0.05, 0, 0.2, 0.9, 0.01]
    out = device_sampler.apply_min_p(Tensor(logits), Tensor(np.array(min_p, np.float32))).numpy()
    for i in range(S):
        assert np.array_equal(masked(out[i]), masked(apply_min_p(logits[i].astype(np.float64), min_p[i]))), i


def host_reference(row: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    x = row.astype(np.float64)
    if params.is_greedy:
        return int(np.argmax(x))
    return random_sample(softmax(apply_top_k_top_p_min_p(x / params.temperature, params)), generator)


MIXED = [SamplingParams(temperature=0),
         SamplingParams(temperature=0.7, top_k=5),
         SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=1.3, min_p=0.05, top_k=50),
         SamplingParams(temperature=1.0),
         SamplingParams(temperature=2.0, top_p=0.5, top_k=20, min_p=0.01),
         SamplingParams(temperature=0.5, min_p=0.1),
         SamplingParams(temperature=1.0, top_k=1)]


def param_tensors(params: list[SamplingParams], vocab: int) -> list[Tensor]:
    return [Tensor(np.array([p.temperature for p in params], np.float32)),
            Tensor(np.array([p.top_k if p.top_k > 0 else vocab for p in params], np.int32)),
            Tensor(np.array([p.top_p for p in params], np.float32)),
            Tensor(np.array([p.min_p for p in params], np.float32))]


PATHS = [pytest.param(False, id="kernel", marks=pytest.mark.phase5), pytest.param(True, id="portable")]


@pytest.mark.parametrize("portable", PATHS)
def test_mixed_batch_samples_equal_host(logits, portable):
    """Greedy and sampled rows with different parameters in one batch: each row's key (drawn from its generator)
    gives the token the host reference draws from a generator in the same state; the thresholds are the smallest
    logit the host's filters keep."""
    if not portable:
        from tinyvllm.sample import sampler_kernel  # Phase 5

        assert sampler_kernel.uses_kernel(Tensor(logits))
    for draw in range(4):
        seeds = [1000 * draw + i for i in range(S)]
        keys = np.concatenate([noise.draw_keys(np.random.default_rng(s), 1) for s in seeds])
        tokens, thresholds = device_sampler.draw(Tensor(logits), *param_tensors(MIXED, V), Tensor(keys),
                                                 portable=portable)
        tokens, thresholds = tokens.numpy(), thresholds.numpy()[:, 0]
        for i, params in enumerate(MIXED):
            assert tokens[i] == host_reference(logits[i], params, np.random.default_rng(seeds[i])), (draw, i)
            if params.is_greedy or (params.top_k <= 0 and params.min_p == 0 and params.top_p == 1):
                assert thresholds[i] == -np.inf, i
            else:
                kept = np.isfinite(apply_top_k_top_p_min_p(logits[i].astype(np.float64) / params.temperature, params))
                assert thresholds[i] == logits[i][kept].min(), (draw, i)


@pytest.mark.parametrize("portable", PATHS)
def test_filters_never_emit_an_excluded_token(portable):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    top_k = np.array([3] * S, np.int32)
    allowed = [set(np.argsort(-x[i])[:3]) for i in range(S)]
    for _ in range(10):
        tokens = device_sampler.sample(Tensor(x), Tensor(np.ones(S, np.float32)), Tensor(top_k),
                                       Tensor(np.ones(S, np.float32)), Tensor(np.zeros(S, np.float32)),
                                       Tensor(noise.draw_keys(rng, S)), portable=portable).numpy()
        assert all(int(tokens[i]) in allowed[i] for i in range(S))


@pytest.mark.phase5
def test_kernel_at_the_model_vocab_and_an_odd_one():
    """The kernel's vector loops at the model's vocabulary (49,152) and at one that is no multiple of 8, on
    LM-like rows (a few large logits, a long tail): top-p alone over the whole vocabulary (its pruning bound
    and heap, and the tokens-only check of the race's winner), top-k, min-p, and the pure-temperature race,
    against the host's masks and draws."""
    params = [SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=0.8, top_k=40, top_p=0.95,
              min_p=0.05), SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=0.9),
              SamplingParams(temperature=1.5, top_p=0.99), SamplingParams(temperature=0.6, min_p=0.2),
              SamplingParams(temperature=1.0, top_p=0.3), SamplingParams(temperature=0.9, top_p=0.6, min_p=0.1)]
    rng = np.random.default_rng(3)
    for vocab in (49152, 1003):
        x = (rng.standard_normal((len(params), vocab)) * 2).astype(np.float32)
        x[:, rng.integers(0, vocab, 30)] += rng.uniform(4, 10, 30).astype(np.float32)
        seeds = list(range(len(params)))
        keys = np.concatenate([noise.draw_keys(np.random.default_rng(s), 1) for s in seeds])
        tokens, thresholds = device_sampler.draw(Tensor(x), *param_tensors(params, vocab), Tensor(keys))
        tokens, thresholds = tokens.numpy(), thresholds.numpy()[:, 0]
        # tokens only: a top-p row may check its race's winner against the nucleus instead of finding the threshold
        only = device_sampler.sample(Tensor(x), *param_tensors(params, vocab), Tensor(keys)).numpy()
        np.testing.assert_array_equal(only, tokens)
        for i, p in enumerate(params):
            assert tokens[i] == host_reference(x[i], p, np.random.default_rng(seeds[i])), (vocab, i)
            kept = np.isfinite(apply_top_k_top_p_min_p(x[i].astype(np.float64) / p.temperature, p))
            assert thresholds[i] == (-np.inf if kept.all() else x[i][kept].min()), (vocab, i)


@pytest.mark.phase5
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05),
                                    SamplingParams(temperature=1.3)], ids=["llama.cpp chain", "temperature"])
def test_kernel_draws_follow_the_filtered_softmax(params):
    """2,000 rows of the same logits, each with its own key: the kernel's tokens follow the host's filtered
    softmax (Pearson's chi-square at the rejection sampler's significance) and never leave its support."""
    rows, vocab = 2000, 8
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.7, -3.0], np.float32)
    p = softmax(apply_top_k_top_p_min_p(logits.astype(np.float64) / params.temperature, params))
    keys = noise.draw_keys(np.random.default_rng(11), rows)
    tokens = device_sampler.sample(Tensor(np.tile(logits, (rows, 1))),
                                   *param_tensors([params] * rows, vocab), Tensor(keys)).numpy()
    assert set(tokens.tolist()) <= set(np.flatnonzero(p > 0).tolist())
    assert chi2_pvalue(tokens.tolist(), p) > SIGNIFICANCE


def test_noise_is_the_same_on_host_and_device_and_uniform():
    keys = noise.draw_keys(np.random.default_rng(5), 4)
    host = noise.uniforms_numpy(keys, 5000)  # (4, 5000)
    np.testing.assert_array_equal(noise.uniforms(Tensor(keys), 5000).numpy(), host)
    assert 0 < host.min() and host.max() < 1
    # 20 equal bins per row: chi-square with 19 degrees of freedom
    counts = np.stack([np.bincount((row * 20).astype(int), minlength=20) for row in host])
    stat = ((counts - 250.0) ** 2 / 250.0).sum(axis=1)
    assert (stat < 43.8).all(), stat  # the 0.001 quantile of chi-square(19)
    # neighbouring tokens and different keys are uncorrelated
    assert abs(np.corrcoef(host[0, :-1], host[0, 1:])[0, 1]) < 0.06
    assert abs(np.corrcoef(host[0], host[1])[0, 1]) < 0.06


def test_greedy_graph_is_the_argmax(logits):
    """The all-greedy batch's graph (no keys, no race) picks what the full sampler picks at temperature 0."""
    rows = logits.shape[0]
    zeros, ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    keys = np.zeros((rows, 2), np.uint32)
    greedy = device_sampler.greedy(Tensor(logits)).numpy()
    assert greedy.dtype == np.int32
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
    for portable in (False, True):
        full = device_sampler.sample(Tensor(logits), Tensor(zeros), Tensor(np.full(rows, logits.shape[1], np.int32)),
                                     Tensor(ones), Tensor(zeros), Tensor(keys), portable=portable).numpy()
        np.testing.assert_array_equal(greedy, full)


@pytest.mark.phase5
def test_unfiltered_graph_draws_what_the_kernel_draws(logits):
    """`use_filters=False` (no row uses min-p, top-k or top-p): the portable graph's one-pass race and the kernel's
    race with skipping draw the same tokens, greedy rows the argmax."""
    temperature = np.array([0, 0.5, 1.0, 1.7, 0.8, 0, 1.2, 3.0], np.float32)
    off = [Tensor(np.full(S, V, np.int32)), Tensor(np.ones(S, np.float32)), Tensor(np.zeros(S, np.float32))]
    for seed in range(3):
        keys = Tensor(noise.draw_keys(np.random.default_rng(seed), S))
        graph = device_sampler.sample(Tensor(logits), Tensor(temperature), *off, keys, use_filters=False,
                                      portable=True).numpy()
        kernel = device_sampler.sample(Tensor(logits), Tensor(temperature), *off, keys, use_filters=False).numpy()
        np.testing.assert_array_equal(graph, kernel)
