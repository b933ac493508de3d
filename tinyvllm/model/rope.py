"""Rotary position embeddings (RoPE), HF's rotate_half pairing, Llama 3's frequency scaling; angles computed in the
graph (docs/phases/01-foundation.md; by hand in 01-appendix-weights-and-layers.md)."""

from __future__ import annotations

import math

import numpy as np
from tinygrad import Tensor

from tinyvllm.model.config import ModelConfig


def rope_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """inv_freq: (head_dim/2,) float32, scaled as the config asks."""
    hd = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = None if local else config.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor  # position p rotates like p / factor
    elif rs is not None:  # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        blended = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / rs.factor,
                            np.where(wavelen < high_wavelen, inv_freq, blended))
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions: (..., T) int -> cos, sin: (..., T, 1, head_dim/2), ready to broadcast over heads."""
    angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, head_dim/2)
    return angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (..., T, n_heads, head_dim), rotated by rotate_half pairs."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)
