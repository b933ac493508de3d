"""The exponential race's clocks: a counter-based hash of (key, token id), the same bits in every backend.

    request's generator --integers--> key (2,) uint32 --(host: 8 bytes)--> device:
        h = mix(mix(i ^ key[0]) + key[1])        for token i: two rounds of a 32-bit integer hash
        u = ((h >> 8) + 0.5) / 2**24             a float32 in (0, 1), never 0 or 1
        clock = -log(u)                          Exp(1)
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor, dtypes

MIX_MUL_1, MIX_MUL_2 = 0x7FEB352D, 0x846CA68B  # lowbias32's (also in kernels/*/sampler.*)
UNIFORM_BITS = 24  # a float32's significant bits: u is exact


def draw_keys(generator: np.random.Generator, n: int) -> np.ndarray:
    """n keys (n, 2) uint32 from a request's generator."""
    return generator.integers(0, 2**32, size=(n, 2), dtype=np.uint32)


def _mix(x):
    """lowbias32 on numpy or tinygrad uint32s (products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * MIX_MUL_1
    x = x ^ (x >> 15)
    x = x * MIX_MUL_2
    return x ^ (x >> 16)


def uniforms_numpy(keys: np.ndarray, vocab: int) -> np.ndarray:
    """keys (S, 2) uint32 -> u (S, vocab) float32 in (0, 1), as the device computes it."""
    keys = np.asarray(keys, np.uint32).reshape(-1, 2)
    i = np.arange(vocab, dtype=np.uint32).reshape(1, vocab)
    with np.errstate(over="ignore"):
        h = _mix(_mix(i ^ keys[:, :1]) + keys[:, 1:])  # (S, V) uint32
    return (((h >> (32 - UNIFORM_BITS)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-UNIFORM_BITS))


def exponential_clocks_numpy(keys: np.ndarray, vocab: int) -> np.ndarray:
    """keys (S, 2) -> Exp(1) clocks (S, vocab) float64."""
    return -np.log(uniforms_numpy(keys, vocab).astype(np.float64))


def uniforms(keys: Tensor, vocab: int) -> Tensor:
    """keys (S, 2) uint32 tensor -> u (S, vocab) float32 in (0, 1), in the graph."""
    i = Tensor.arange(vocab, dtype=dtypes.uint32).to(keys.device).reshape(1, vocab)
    h = _mix(_mix(i ^ keys[:, 0:1]) + keys[:, 1:2])  # (S, V) uint32
    return ((h >> (32 - UNIFORM_BITS)).cast(dtypes.float32) + 0.5) * 2.0**-UNIFORM_BITS


def exponential_clocks(keys: Tensor, vocab: int) -> Tensor:
    """keys (S, 2) uint32 -> Exp(1) clocks (S, vocab) float32 in the graph."""
    return -uniforms(keys, vocab).log()
