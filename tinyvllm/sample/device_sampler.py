"""Batched sampling on the device (Phase 4): a whole batch's next tokens from its logits, one graph.

    logits (S, V) on the device ----> [ /temperature, min-p, top-k, top-p, exponential race ] ----> tokens (S,)
    per-row params (S,): temperature, top_k, top_p, min_p              only S int32s come back to the host
    per-row clocks  (S, V): Exp(1) draws from each request's own generator (host-made, so seeded rows reproduce)

It computes exactly what the host reference (`tinyvllm.sample.sampler`) computes for the same clocks,
for every request without penalties, logit bias, min_tokens or logprobs (those rows take the host
path). Each row has its own parameters, so greedy and sampled requests share one batch:
temperature 0 means argmax.

The filters keep every token whose logit is at or above a threshold (ties are kept together, as on
the host). A sort over 49,152 tokens per row would be the obvious way to find a threshold; instead
each threshold is found by bisection on the value, a handful of cheap reductions over the row:

    top-k: the k-th largest logit t is the largest v with count(logits >= v) >= k
    top-p: the smallest logit t whose strictly-more-likely mass, sum(p[logits > t]), is still < top_p

After the bisection has narrowed [lo, hi] to less than the spacing of float32 values, the threshold is
the smallest logit above lo: an exact element of the row, not an approximation.
"""

from __future__ import annotations

import math

from tinygrad import Tensor, dtypes

BISECTION_STEPS = 32  # halves the value range 32 times: finer than float32 spacing for any logit range we see


def _bisect(lo: Tensor, hi: Tensor, predicate) -> tuple[Tensor, Tensor]:
    """Narrow [lo, hi] (S,1) around the point where `predicate(v)` (monotone: false at lo, true at hi) flips."""
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) * 0.5
        ok = predicate(mid)
        hi, lo = ok.where(mid, hi), ok.where(lo, mid)
    return lo, hi


def _finite_min(logits: Tensor) -> Tensor:
    return logits.isinf().where(math.inf, logits).min(axis=-1, keepdim=True)


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """top_k: (S,) int; >= the number of candidates means "off". Keeps logits >= the k-th largest."""
    k = top_k.reshape(-1, 1).float()
    num_finite = logits.isinf().logical_not().sum(axis=-1, keepdim=True).float()
    # "fewer than k logits are >= v" is false at v <= kth and true above it
    lo, _ = _bisect(_finite_min(logits), logits.max(axis=-1, keepdim=True) + 1.0,
                    lambda v: (logits >= v).sum(axis=-1, keepdim=True).float() < k)
    kth = (logits >= lo).where(logits, math.inf).min(axis=-1, keepdim=True)  # the one element in [lo, hi)
    kth = (k >= num_finite).where(-math.inf, kth)
    return (logits >= kth).where(logits, -math.inf)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """top_p: (S,) in (0, 1]; 1 means "off". Keeps the smallest most-likely set whose mass reaches top_p."""
    probs = logits.softmax(-1)
    p = top_p.reshape(-1, 1)
    # "the mass strictly above v is < top_p" is false below the threshold and true from it on
    lo, _ = _bisect(_finite_min(logits) - 1.0, logits.max(axis=-1, keepdim=True),
                    lambda v: (logits > v).where(probs, 0.0).sum(axis=-1, keepdim=True) < p)
    threshold = (logits > lo).where(logits, math.inf).min(axis=-1, keepdim=True)  # the one element in (lo, hi]
    threshold = (p >= 1.0).where(-math.inf, threshold)
    return (logits >= threshold).where(logits, -math.inf)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """p >= min_p * p_max  <=>  logit - max_logit >= log(min_p); min_p 0 keeps everything."""
    log_min_p = (min_p > 0).where(min_p.maximum(1e-30).log(), -math.inf).reshape(-1, 1)
    return (logits - logits.max(axis=-1, keepdim=True) >= log_min_p).where(logits, -math.inf)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Structured outputs: bitmask (S, ceil(V/32)) int32, bit t % 32 of word t // 32 set when token t is allowed
    (llguidance's layout, see tinyvllm/sample/structured_output.py) -> logits with every other token at -inf.
    Unpacked here, on the device: 4 bytes per 32 tokens go up instead of a (S, V) mask."""
    rows, vocab = logits.shape
    words = bitmask.shape[1]
    shifts = Tensor.arange(32, dtype=dtypes.int32).reshape(1, 1, 32)
    bits = (bitmask.reshape(rows, words, 1).expand(rows, words, 32) >> shifts) & 1  # (S, W, 32)
    allowed = bits.reshape(rows, words * 32)[:, :vocab] != 0
    return allowed.where(logits, -math.inf)


def greedy(logits: Tensor) -> Tensor:
    """logits (S,V) -> the highest-scoring token of every row (S,) int32: a batch where every row is greedy."""
    return logits.argmax(-1).cast(dtypes.int32)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
           clocks: Tensor, use_filters: bool = True) -> Tensor:
    """logits (S,V) float32, params (S,), clocks (S,V) Exp(1) draws -> token ids (S,) int32.

    `use_filters=False` builds the cheaper graph for batches where no row uses min-p, top-k or top-p.
    """
    scaled = processed_logits(logits, temperature, top_k, top_p, min_p, use_filters)
    return (temperature <= 0).where(logits.argmax(-1), exponential_race(scaled, clocks)).cast(dtypes.int32)


def processed_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                     use_filters: bool = True) -> Tensor:
    """logits (S,V) -> what each row draws from: divided by its temperature (a greedy row's 0 by 1), then min-p,
    top-k and top-p (vLLM v1's order, as on the host); filtered tokens are -inf. Its softmax is the request's
    distribution: what the sampler, speculative decoding's rejection sampler and a draft model's q all use."""
    scaled = logits / (temperature <= 0).where(1.0, temperature).reshape(-1, 1)
    if use_filters:
        scaled = apply_top_p(apply_top_k(apply_min_p(scaled, min_p), top_k), top_p)
    return scaled


def exponential_race(scaled: Tensor, clocks: Tensor) -> Tensor:
    """One token per row drawn from softmax(scaled) (S,V), clocks (S,V) Exp(1): argmax(p / c) == argmax(logit -
    log c) is token i with probability p_i; -inf (filtered) tokens never win."""
    return (scaled - clocks.maximum(1e-30).log()).argmax(-1)
