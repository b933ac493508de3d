"""Pearson's chi-square goodness-of-fit test, for the samplers' distribution tests
(tests/sample/test_device_sampler.py, tests/spec_decode/test_rejection_sampler.py): a test fails when its p-value is
below SIGNIFICANCE (a correct sampler fails one such test in 1,000 runs; the draws are seeded, so a run is
reproducible)."""

from __future__ import annotations

import math

import numpy as np

SIGNIFICANCE = 1e-3


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper gamma function Q(df/2, x/2), in closed form."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(h ** (i - 0.5) / math.gamma(i + 0.5)
                                                        for i in range(1, (df + 1) // 2))


def chi2_pvalue(samples: list[int], p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"tokens the target never emits were emitted: {counts}"
    expected = p[p > 0] * len(samples)
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int((p > 0).sum()) - 1)
