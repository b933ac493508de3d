"""Phase 4: the batched device sampler picks exactly what the host reference sampler picks."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from tinyvllm.sample import device_sampler
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


def host_reference(row: np.ndarray, params: SamplingParams, seed: int) -> int:
    x = row.astype(np.float64)
    if params.is_greedy:
        return int(np.argmax(x))
    return random_sample(softmax(apply_top_k_top_p_min_p(x / params.temperature, params)), np.random.default_rng(seed))


@pytest.mark.parametrize("draw", range(5))
def test_mixed_batch_samples_equal_host(logits, draw):
    """Greedy and sampled rows with different parameters in one batch, the same Exp(1) clocks as the host."""
    rng = np.random.default_rng(100 + draw)
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.3, min_p=0.05, top_k=50),
              SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, top_p=0.5, top_k=20, min_p=0.01),
              SamplingParams(temperature=0.5),
              SamplingParams(temperature=1.0, top_k=1)]
    seeds = [int(s) for s in rng.integers(0, 2**31, size=S)]
    clocks = np.stack([np.random.default_rng(s).standard_exponential(V) for s in seeds]).astype(np.float32)
    tokens = device_sampler.sample(
        Tensor(logits), Tensor(np.array([p.temperature for p in params], np.float32)),
        Tensor(np.array([p.top_k if p.top_k > 0 else V for p in params], np.int32)),
        Tensor(np.array([p.top_p for p in params], np.float32)),
        Tensor(np.array([p.min_p for p in params], np.float32)), Tensor(clocks)).numpy()
    for i in range(S):
        assert tokens[i] == host_reference(logits[i], params[i], seeds[i]), i


def test_filters_never_emit_an_excluded_token():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((S, V)) * 2).astype(np.float32)
    top_k = np.array([3] * S, np.int32)
    allowed = [set(np.argsort(-x[i])[:3]) for i in range(S)]
    for _ in range(20):
        clocks = rng.standard_exponential((S, V)).astype(np.float32)
        tokens = device_sampler.sample(Tensor(x), Tensor(np.ones(S, np.float32)), Tensor(top_k),
                                       Tensor(np.ones(S, np.float32)), Tensor(np.zeros(S, np.float32)),
                                       Tensor(clocks)).numpy()
        assert all(int(tokens[i]) in allowed[i] for i in range(S))


def test_greedy_graph_is_the_argmax(logits):
    """The all-greedy batch's graph (no clocks, no race) picks what the full sampler picks at temperature 0."""
    rows = logits.shape[0]
    zeros, ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    full = device_sampler.sample(Tensor(logits), Tensor(zeros), Tensor(np.full(rows, logits.shape[1], np.int32)),
                                 Tensor(ones), Tensor(zeros), Tensor(np.ones(logits.shape, np.float32))).numpy()
    greedy = device_sampler.greedy(Tensor(logits)).numpy()
    assert greedy.dtype == np.int32
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(greedy, full)
