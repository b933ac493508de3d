"""Batched sampling on the device, in one graph, drawing what the host reference (`sample/sampler.py`) draws.

    logits (S, V) -> [ /temperature, min-p, top-k, top-p, exponential race ] -> tokens (S,)

Taught in docs/phases/04-batched-forward.md, section 6.
"""

from __future__ import annotations

import math

from tinygrad import Tensor, dtypes

from tinyvllm.plugins import provided
from tinyvllm.sample import noise

kernel_draw = provided("sampler_kernel")  # Phase 5, else None
BISECTION_STEPS = 32  # finer than float32 spacing for any logit range seen


def _bisect(lo: Tensor, hi: Tensor, predicate) -> tuple[Tensor, Tensor]:
    """Narrow [lo, hi] (S,1) around where monotone `predicate(v)` flips from false to true."""
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) * 0.5
        ok = predicate(mid)
        hi, lo = ok.where(mid, hi), ok.where(lo, mid)
    return lo, hi


def _finite_min(logits: Tensor) -> Tensor:
    return logits.isinf().where(math.inf, logits).min(axis=-1, keepdim=True)


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep logits >= the k-th largest; top_k (S,) >= the number of candidates: off."""
    k = top_k.reshape(-1, 1).float()
    num_finite = logits.isinf().logical_not().sum(axis=-1, keepdim=True).float()
    lo, _ = _bisect(_finite_min(logits), logits.max(axis=-1, keepdim=True) + 1.0,
                    lambda v: (logits >= v).sum(axis=-1, keepdim=True).float() < k)
    kth = (logits >= lo).where(logits, math.inf).min(axis=-1, keepdim=True)
    kth = (k >= num_finite).where(-math.inf, kth)
    return (logits >= kth).where(logits, -math.inf)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p (S,); 1: off."""
    probs = logits.softmax(-1)
    p = top_p.reshape(-1, 1)
    lo, _ = _bisect(_finite_min(logits) - 1.0, logits.max(axis=-1, keepdim=True),
                    lambda v: (logits > v).where(probs, 0.0).sum(axis=-1, keepdim=True) < p)
    threshold = (logits > lo).where(logits, math.inf).min(axis=-1, keepdim=True)
    threshold = (p >= 1.0).where(-math.inf, threshold)
    return (logits >= threshold).where(logits, -math.inf)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """p >= min_p * p_max  <=>  logit - max_logit >= log(min_p); min_p 0 keeps everything."""
    log_min_p = (min_p > 0).where(min_p.maximum(1e-30).log(), -math.inf).reshape(-1, 1)
    return (logits - logits.max(axis=-1, keepdim=True) >= log_min_p).where(logits, -math.inf)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits with token t at -inf where bit t % 32 of bitmask[:, t // 32] (S, ceil(V/32)) int32 is clear."""
    rows, vocab = logits.shape
    words = bitmask.shape[1]
    shifts = Tensor.arange(32, dtype=dtypes.int32).reshape(1, 1, 32)
    bits = (bitmask.reshape(rows, words, 1).expand(rows, words, 32) >> shifts) & 1  # (S, W, 32)
    allowed = bits.reshape(rows, words * 32)[:, :vocab] != 0
    return allowed.where(logits, -math.inf)


def greedy(logits: Tensor) -> Tensor:
    """logits (S,V) -> argmax (S,) int32."""
    return logits.argmax(-1).cast(dtypes.int32)


def draw(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor,
         use_filters: bool = True, portable: bool = False) -> tuple[Tensor, Tensor]:
    """logits (S,V), params (S,), keys (S,2) -> (tokens (S,) int32, thresholds (S,1): the smallest logit kept).
    `use_filters=False` promises no row uses min-p, top-k or top-p."""
    if kernel_draw is not None and (drawn := kernel_draw(logits, temperature, top_k, top_p, min_p, keys,
                                                         portable=portable)) is not None:
        return drawn
    rows = logits.shape[0]
    thresholds = (filter_thresholds(logits, temperature, top_k, top_p, min_p) if use_filters
                  else Tensor.full((rows, 1), -math.inf, device=logits.device))
    race = exponential_race(processed_logits(logits, temperature, thresholds), keys)
    tokens = (temperature <= 0).where(logits.argmax(-1), race).cast(dtypes.int32)
    return tokens, thresholds


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor,
           use_filters: bool = True, portable: bool = False) -> Tensor:
    """logits (S,V) float32, params (S,), keys (S,2) uint32 -> token ids (S,) int32 (see `draw`)."""
    if kernel_draw is not None and (drawn := kernel_draw(logits, temperature, top_k, top_p, min_p, keys,
                                                         thresholds=False, portable=portable)) is not None:
        return drawn[0]
    return draw(logits, temperature, top_k, top_p, min_p, keys, use_filters, portable)[0]


def filter_thresholds(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """The portable graph's thresholds (S,1): the smallest logit the filters keep."""
    scaled = logits / (temperature <= 0).where(1.0, temperature).reshape(-1, 1)
    kept = apply_top_p(apply_top_k(apply_min_p(scaled, min_p), top_k), top_p)
    survives = kept > -math.inf  # (S,V)
    smallest = survives.where(logits, math.inf).min(axis=-1, keepdim=True)
    filtered = survives.sum(axis=-1, keepdim=True) < (logits > -math.inf).sum(axis=-1, keepdim=True)
    return ((temperature.reshape(-1, 1) > 0) & filtered).where(smallest, -math.inf)


def processed_logits(logits: Tensor, temperature: Tensor, thresholds: Tensor | None = None) -> Tensor:
    """logits (S,V) / temperature (greedy: 1), those below the row's threshold (S,1) at -inf."""
    scaled = logits / (temperature <= 0).where(1.0, temperature).reshape(-1, 1)
    return scaled if thresholds is None else (logits >= thresholds).where(scaled, -math.inf)


def exponential_race(scaled: Tensor, keys: Tensor) -> Tensor:
    """One token per row from softmax(scaled) (S,V): argmax(logit - log c), c the Exp(1) clocks of keys (S,2)."""
    return (scaled - noise.exponential_clocks(keys, scaled.shape[1]).log()).argmax(-1)
