"""The host (numpy) reference sampler, in vLLM v1's `Sampler.forward` order (docs/phases/01-foundation.md, section 7,
and 01-appendix-tokens-and-sampling.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tinyvllm.sample.noise import draw_keys, exponential_clocks_numpy
from tinyvllm.sampling_params import SamplingParams


def apply_min_tokens(logits: np.ndarray, params: SamplingParams, num_output_tokens: int,
                     eos_token_ids: Iterable[int] = ()) -> np.ndarray:
    """Ban every stop token until `min_tokens` are generated."""
    if num_output_tokens >= params.min_tokens:
        return logits
    banned = sorted(params.all_stop_token_ids(eos_token_ids))
    _check_token_ids(banned, logits.shape[0], "stop_token_ids")
    logits = logits.copy()
    logits[banned] = -np.inf
    return logits


def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Add the OpenAI-style `logit_bias` to the named tokens' logits."""
    if not params.logit_bias:
        return logits
    _check_token_ids(params.logit_bias, logits.shape[0], "logit_bias")
    logits = logits.copy()
    for token_id, bias in params.logit_bias.items():
        logits[token_id] += bias
    return logits


def apply_penalties(logits: np.ndarray, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                    params: SamplingParams) -> np.ndarray:
    """vLLM's penalties: repetition over prompt and output, frequency and presence over the output."""
    if not params.uses_penalties:
        return logits
    vocab_size = logits.shape[0]
    _check_token_ids(prompt_token_ids, vocab_size, "prompt_token_ids")
    _check_token_ids(output_token_ids, vocab_size, "output_token_ids")
    output_counts = np.bincount(np.asarray(output_token_ids, dtype=np.int64), minlength=vocab_size)  # (V,)
    in_output = output_counts > 0  # (V,)
    seen = in_output.copy()
    seen[np.asarray(prompt_token_ids, dtype=np.int64)] = True

    r = params.repetition_penalty
    logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
    return logits - params.frequency_penalty * output_counts - params.presence_penalty * in_output


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    assert temperature > 0, "greedy requests take the argmax before temperature"
    return logits / temperature


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens at least `min_p` times as likely as the most likely one."""
    if min_p <= 0:
        return logits
    probs = softmax(logits)
    return np.where(probs >= min_p * probs.max(), logits, -np.inf)


def apply_top_k(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the `top_k` largest logits, every tie of the k-th too (as vLLM and HF)."""
    vocab_size = logits.shape[0]
    if top_k <= 0 or top_k >= vocab_size:
        return logits
    kth_largest = np.partition(logits, vocab_size - top_k)[vocab_size - top_k]
    return np.where(logits >= kth_largest, logits, -np.inf)


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p` (ties kept together)."""
    if top_p >= 1:
        return logits
    order = np.argsort(-logits, kind="stable")  # (V,) most likely first
    sorted_probs = softmax(logits[order])
    mass_before = np.concatenate(([0.0], np.cumsum(sorted_probs)[:-1]))
    num_needed = int(np.count_nonzero(mass_before < top_p))  # >= 1 because top_p > 0
    threshold = logits[order[num_needed - 1]]
    return np.where(logits >= threshold, logits, -np.inf)


def apply_top_k_top_p_min_p(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """min-p, top-k, then top-p over what they left, renormalised (vLLM v1's order)."""
    logits = apply_min_p(logits, params.min_p)
    logits = apply_top_k(logits, params.top_k)
    return apply_top_p(logits, params.top_p)


def softmax(logits: np.ndarray) -> np.ndarray:
    assert np.isfinite(logits.max()), "every token is masked: nothing left to sample"
    e = np.exp(logits - logits.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def random_sample(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token id from `probs` (V,) by vLLM's exponential race: argmax(p_i / q_i), q_i ~ Exp(1)."""
    q = exponential_clocks_numpy(draw_keys(generator, 1), probs.shape[0])[0]
    return int(np.argmax(probs / q))


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's generator, for all its steps."""
    # numpy seeds are unsigned: a negative seed maps to its two's-complement bits
    return np.random.default_rng(None if seed is None else seed % 2**64)


def logprobs_of(logits: np.ndarray, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `token_id`, the `k` most likely (token id, logprob), best first, ties by id)."""
    logprobs = log_softmax(np.asarray(logits, dtype=np.float64))
    top = np.argsort(-logprobs, kind="stable")[:k]
    return float(logprobs[token_id]), [(int(t), float(logprobs[t])) for t in top]


def full_logprobs(logits: np.ndarray) -> np.ndarray:
    """Every token's log-probability, (V,) float32 (`logprobs=-1`)."""
    x = np.asarray(logits, dtype=np.float32)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


class Sampler:
    """The pipeline above, for one request at one position."""

    def __call__(self, logits: np.ndarray, params: SamplingParams, prompt_token_ids: Sequence[int],
                 output_token_ids: Sequence[int], generator: np.random.Generator | None,
                 eos_token_ids: Iterable[int] = ()) -> int:
        """logits (V,) -> the next token id; `generator` None when greedy."""
        logits = np.asarray(logits, dtype=np.float64)  # float64: rounding never decides a filter boundary here
        logits = apply_min_tokens(logits, params, len(output_token_ids), eos_token_ids)
        logits = apply_logit_bias(logits, params)
        logits = apply_penalties(logits, prompt_token_ids, output_token_ids, params)
        if params.is_greedy:
            return int(np.argmax(logits))  # ties: the lowest token id, like torch.argmax

        assert generator is not None, "a random request needs its generator (make_generator(params.seed))"
        logits = apply_temperature(logits, params.temperature)
        logits = apply_top_k_top_p_min_p(logits, params)
        return random_sample(softmax(logits), generator)


def _check_token_ids(token_ids: Iterable[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} must be token ids in [0, {vocab_size}), got {bad[:5]}")
