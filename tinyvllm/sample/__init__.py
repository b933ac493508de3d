"""Sampling: from a position's logits to the next token, and stop strings for streamed text."""

from tinyvllm.sample.sampler import (
    Sampler,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p_min_p,
    apply_top_p,
    log_softmax,
    logprobs_of,
    make_generator,
    random_sample,
    softmax,
)
from tinyvllm.sample.stop import StopStringChecker

__all__ = [
    "Sampler",
    "StopStringChecker",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_top_p_min_p",
    "apply_top_p",
    "log_softmax",
    "logprobs_of",
    "make_generator",
    "random_sample",
    "softmax",
]
