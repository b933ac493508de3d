"""The host (numpy) reference sampler: from one position's logits to one token id.

This is the readable specification of sampling. The batched on-device sampler of a later phase does
the same steps on many requests at once and is tested against this file. The steps run in the order
vLLM v1's `Sampler.forward` runs them (vllm/v1/sample/sampler.py):

    logits (V,) raw model output ---------------------------> logprobs_of()   vLLM v1 reports raw logprobs
      |  apply_min_tokens    stop ids -> -inf until min_tokens     \
      |  apply_logit_bias    + bias[token]                          |  these can change the argmax,
      |  apply_penalties     repetition, frequency, presence        /  so greedy requests get them too
      |--- greedy? (temperature < 1e-5) ---> argmax ---------------> token
      |  apply_temperature   / temperature
      |  apply_min_p         \
      |  apply_top_k          |  filters: dropped tokens -> -inf
      |  apply_top_p         /
      |  softmax -> probs
      |  random_sample       argmax(probs / q), q ~ Exp(1) hashed from a key the request's generator draws
      v
    token id

Worked numbers, V = 5, prompt = [2], output so far = [0, 0]:

    raw logits                    [ 2.0,  1.5,  1.0,  0.0, -1.0]
    repetition_penalty = 1.25     [ 1.6,  1.5,  0.8,  0.0, -1.0]   0 and 2 were seen: positive logits / 1.25
    frequency_penalty = 0.2       [ 1.2,  1.5,  0.8,  0.0, -1.0]   token 0 is twice in the output: - 0.2 * 2
    presence_penalty = 0.2        [ 1.0,  1.5,  0.8,  0.0, -1.0]   token 0 is in the output:       - 0.2
        (a greedy request stops here and takes token 1)
    temperature = 0.5             [ 2.0,  3.0,  1.6,  0.0, -2.0]
        probs                     [.220, .598, .148, .030, .004]
    min_p = 0.1                   [ 2.0,  3.0,  1.6, -inf, -inf]   keep p >= 0.1 * .598
    top_k = 3                     unchanged: three tokens are left
    top_p = 0.8                   [ 2.0,  3.0, -inf, -inf, -inf]   renormalised [.228, .619, .153]; by rank the
                                                                    mass before token 2 is .847 >= 0.8: dropped
        probs                     [.269, .731,  0,    0,    0  ]   -> token 1 three times in four

All three filters come down to "keep the logits >= a threshold": top-k's threshold is the k-th largest
logit, top-p's the logit of the last token its mass needs, min-p's `max + log(min_p)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tinyvllm.sample.noise import draw_keys, exponential_clocks_numpy
from tinyvllm.sampling_params import SamplingParams


def apply_min_tokens(logits: np.ndarray, params: SamplingParams, num_output_tokens: int,
                     eos_token_ids: Iterable[int] = ()) -> np.ndarray:
    """Ban every stop token (eos unless ignore_eos, and stop_token_ids) until `min_tokens` are generated."""
    if num_output_tokens >= params.min_tokens:
        return logits
    banned = sorted(params.all_stop_token_ids(eos_token_ids))
    _check_token_ids(banned, logits.shape[0], "stop_token_ids")
    logits = logits.copy()
    logits[banned] = -np.inf
    return logits


def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Add the OpenAI-style `logit_bias` to the named tokens' logits (+100 all but forces, -100 all but bans)."""
    if not params.logit_bias:
        return logits
    _check_token_ids(params.logit_bias, logits.shape[0], "logit_bias")
    logits = logits.copy()
    for token_id, bias in params.logit_bias.items():
        logits[token_id] += bias
    return logits


def apply_penalties(logits: np.ndarray, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                    params: SamplingParams) -> np.ndarray:
    """Discourage tokens already seen, with vLLM's definitions (vllm/model_executor/layers/utils.py).

    repetition (HF's CTRL-paper penalty): over prompt AND output tokens. Dividing a positive logit and
        multiplying a negative one both move it towards "less likely"; 1 is off, < 1 encourages.
    frequency (OpenAI): over output tokens only, `- frequency_penalty * count`.
    presence (OpenAI):  over output tokens only, `- presence_penalty * [count > 0]`.
    """
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
    # T < 1 sharpens the distribution, T > 1 flattens it; greedy requests never get here.
    assert temperature > 0, "greedy requests take the argmax before temperature"
    return logits / temperature


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keep tokens at least `min_p` times as likely as the most likely one (always keeps the argmax)."""
    if min_p <= 0:
        return logits
    probs = softmax(logits)
    return np.where(probs >= min_p * probs.max(), logits, -np.inf)


def apply_top_k(logits: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the `top_k` largest logits.

    Ties: every token equal to the k-th largest logit is kept, so more than k may survive. This is
    what vLLM (`logits < kth_value` is masked) and HF's TopKLogitsWarper do, and it makes the result
    depend on values only, never on the order a sort happens to put equal values in.
    """
    vocab_size = logits.shape[0]
    if top_k <= 0 or top_k >= vocab_size:
        return logits
    kth_largest = np.partition(logits, vocab_size - top_k)[vocab_size - top_k]
    return np.where(logits >= kth_largest, logits, -np.inf)


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p` ("nucleus").

    A token is kept when the mass of the tokens ranked above it is still < top_p, so the most likely
    token always survives. Ties are kept together, as in apply_top_k: once the last token the mass
    needs is known, every token with a logit equal to it is kept too.
    """
    if top_p >= 1:
        return logits
    order = np.argsort(-logits, kind="stable")  # (V,) token ids, most likely first
    sorted_probs = softmax(logits[order])  # (V,)
    mass_before = np.concatenate(([0.0], np.cumsum(sorted_probs)[:-1]))  # (V,) nondecreasing
    num_needed = int(np.count_nonzero(mass_before < top_p))  # >= 1 because top_p > 0
    threshold = logits[order[num_needed - 1]]
    return np.where(logits >= threshold, logits, -np.inf)


def apply_top_k_top_p_min_p(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The three filters, in vLLM v1's order: min-p (a logits processor that runs first), then top-k, then top-p.

    Min-p and top-k commute with anything, but top-p does not: it measures mass on the distribution
    the earlier filters left, renormalised (as HF does when TopP follows TopK).
    """
    logits = apply_min_p(logits, params.min_p)
    logits = apply_top_k(logits, params.top_k)
    return apply_top_p(logits, params.top_p)


def softmax(logits: np.ndarray) -> np.ndarray:
    # Subtracting the max keeps exp() from overflowing; -inf logits become exactly 0.
    assert np.isfinite(logits.max()), "every token is masked: nothing left to sample"
    e = np.exp(logits - logits.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def random_sample(probs: np.ndarray, generator: np.random.Generator) -> int:
    """Draw one token id from `probs` (V,) with an exponential race, the way vLLM's GPU sampler does.

    Each token i gets a clock q_i ~ Exp(1); q_i / p_i is exponential with rate p_i, and the smallest
    of independent exponentials is token i's with probability p_i / sum(p). So argmax(p / q) is an
    exact sample: no cumulative sum, no search, one pass over the vocab, easy to batch on a device.
    A masked token has p = 0 and can never win.

    The clocks are the device sampler's: the generator draws one 64-bit key, and q_i is hashed from
    (key, i) (tinyvllm/sample/noise.py), so the host and the device draw the same token for the same key.
    A clock is never 0 (u < 1 always), so a masked token is never 0/0.
    """
    q = exponential_clocks_numpy(draw_keys(generator, 1), probs.shape[0])[0]  # (V,)
    return int(np.argmax(probs / q))


def make_generator(seed: int | None) -> np.random.Generator:
    """One generator per request, made once and used for all its steps: a seeded request reproduces exactly."""
    # numpy seeds are unsigned; a negative 64-bit seed maps to its two's-complement bits.
    return np.random.default_rng(None if seed is None else seed % 2**64)


def logprobs_of(logits: np.ndarray, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token_id` and the `k` most likely (token id, logprob), best first, ties by id.

    Pass the RAW logits, as vLLM v1 does by default (`logprobs_mode="raw_logprobs"`): the model's
    own distribution, before penalties, bias, temperature or filters, so a token the filters removed
    still has its true logprob rather than -inf.
    """
    logprobs = log_softmax(np.asarray(logits, dtype=np.float64))  # (V,)
    top = np.argsort(-logprobs, kind="stable")[:k]
    return float(logprobs[token_id]), [(int(t), float(logprobs[t])) for t in top]


def full_logprobs(logits: np.ndarray) -> np.ndarray:
    """Every token's log-probability, (V,) float32 (`logprobs=-1`, vLLM's "all of the vocabulary": beam search)."""
    x = np.asarray(logits, dtype=np.float32)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


class Sampler:
    """Runs the pipeline above for one request at one position. Stateless: the generator is the request's."""

    def __call__(self, logits: np.ndarray, params: SamplingParams, prompt_token_ids: Sequence[int],
                 output_token_ids: Sequence[int], generator: np.random.Generator | None,
                 eos_token_ids: Iterable[int] = ()) -> int:
        """Choose the next token. logits: (V,) raw model output for the last position.

        `eos_token_ids` are the model's end-of-sequence ids: `min_tokens` bans them (unless
        `ignore_eos`) together with `params.stop_token_ids`. `generator` may be None for greedy requests.
        """
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
