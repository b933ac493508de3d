"""Rotary position embeddings (tinyvllm/model/rope.py) against numpy: the frequencies, Llama 3.1's scaling, and
the rotation (a rotation keeps each pair's length; position 0 is none; q.k depends on the distance only)."""

from __future__ import annotations

import dataclasses

import numpy as np
from conftest import TINY_CONFIG
from tinygrad import Tensor

from tinyvllm.model.config import RopeScaling
from tinyvllm.model.rope import apply_rope, rope_cos_sin, rope_frequencies


def test_the_frequencies_are_theta_to_the_minus_2i_over_d():
    hd = TINY_CONFIG.head_dim
    expected = 1.0 / TINY_CONFIG.rope_theta ** (np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(rope_frequencies(TINY_CONFIG), expected, rtol=1e-6)


def test_llama3_scaling_slows_the_long_wavelengths_only():
    scaled = dataclasses.replace(TINY_CONFIG, rope_scaling=RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    plain, slow = rope_frequencies(TINY_CONFIG), rope_frequencies(scaled)
    assert slow[0] == plain[0]  # the shortest wavelength is kept
    np.testing.assert_allclose(slow[-1], plain[-1] / 8.0, rtol=1e-6)  # the longest is slowed by the factor
    assert np.all(slow <= plain)


def _rotated(x: np.ndarray, positions: list[int]) -> np.ndarray:
    inv_freq = Tensor(rope_frequencies(TINY_CONFIG))
    cos, sin = rope_cos_sin(Tensor(np.array([positions], dtype=np.int32)), inv_freq)
    return apply_rope(Tensor(x), cos, sin).numpy()


def test_the_rotation_keeps_lengths_and_depends_on_distance_only():
    rng = np.random.default_rng(0)
    hd, half = TINY_CONFIG.head_dim, TINY_CONFIG.head_dim // 2
    q, k = rng.standard_normal((2, 1, 1, 1, hd)).astype(np.float32)
    np.testing.assert_allclose(_rotated(q, [0]), q, atol=1e-6)  # position 0: no rotation
    rq = _rotated(q, [5])[0, 0, 0]
    pair_lengths = np.hypot(rq[:half], rq[half:])
    np.testing.assert_allclose(pair_lengths, np.hypot(q[0, 0, 0, :half], q[0, 0, 0, half:]), rtol=1e-5)
    dots = [float(_rotated(q, [p + 3])[0, 0, 0] @ _rotated(k, [p])[0, 0, 0]) for p in (0, 7, 40)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4, atol=1e-5)
