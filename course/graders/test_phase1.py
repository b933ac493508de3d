"""Phase 1's graders: rms_norm, apply_rope, grouped_query_attention (course/phase1/). Each checks the function on
inputs small enough to work by hand, against a numpy oracle, and then inside the tiny model: its logits with your
function against the project's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model_logits
from tinygrad import Tensor, dtypes

from tinyvllm.attention import contiguous
from tinyvllm.model import llama, rope

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93]


def model_matches_project(tiny_model, project_code, what: str) -> None:
    model, config = tiny_model
    yours = tiny_model_logits(model, config, PROMPT)
    with project_code():
        expected = tiny_model_logits(model, config, PROMPT)
    err = np.abs(yours - expected).max()
    assert err < 1e-4, f"the tiny model's logits with your {what} differ from the project's by {err:.3g}"


# ---- rms_norm ----

@pytest.mark.task("rms_norm")
def test_rms_norm_of_ones():
    out = llama.rms_norm(Tensor.ones(2, 8), Tensor.full((8,), 2.0), 1e-6).numpy()
    assert out.shape == (2, 8), f"rms_norm of a (2, 8) input should be (2, 8), got {out.shape}"
    assert np.allclose(out, 2.0, atol=1e-5), f"rms_norm of ones with weight 2 should be all 2s, got {out[0]}"


@pytest.mark.task("rms_norm")
def test_rms_norm_matches_numpy():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 5, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
    out = llama.rms_norm(Tensor(x), Tensor(w), 1e-5).numpy()
    err = np.abs(out - expected).max()
    assert err < 1e-5, f"rms_norm differs from x / sqrt(mean(x^2, last axis) + eps) * weight by {err:.3g}"


@pytest.mark.task("rms_norm")
def test_rms_norm_float16_computes_in_float32():
    x = Tensor.full((1, 4), 300.0, dtype=dtypes.float16)  # 300^2 = 90000 > 65504, float16's largest
    out = llama.rms_norm(x, Tensor.ones(4, dtype=dtypes.float16), 1e-6)
    assert out.dtype == dtypes.float16, f"rms_norm of a float16 input should be float16, got {out.dtype}"
    values = out.float().numpy()
    assert np.allclose(values, 1.0, atol=1e-2), (
        f"rms_norm of float16 300s should be 1s, got {values[0]}: square in float32 (x.float()), float16 overflows")


@pytest.mark.task("rms_norm")
def test_rms_norm_in_the_model(tiny_model, learner_code):
    model_matches_project(tiny_model, learner_code, "rms_norm")


# ---- apply_rope ----

def rope_numpy(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """x (T, H, Hd) at positions (T,): rotate_half pairs (i, i + Hd/2) turned by position * theta^(-2i/Hd)."""
    hd = x.shape[-1]
    angles = positions[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None, :]  # (T, Hd/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def cos_sin(positions: list[int], hd: int):
    inv_freq = Tensor((1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32))
    return rope.rope_cos_sin(Tensor([positions]), inv_freq)


@pytest.mark.task("apply_rope")
def test_rope_at_position_zero_is_the_identity():
    x = np.random.default_rng(2).standard_normal((1, 1, 2, 8)).astype(np.float32)
    out = rope.apply_rope(Tensor(x), *cos_sin([0], 8)).numpy()
    assert np.allclose(out, x, atol=1e-6), f"RoPE at position 0 should leave x unchanged (angle 0), got {out} for {x}"


@pytest.mark.task("apply_rope")
def test_rope_pairs_i_with_i_plus_half():
    x = np.zeros((1, 1, 1, 4), dtype=np.float32)
    x[..., 0] = 1.0  # the pair (channel 0, channel 2), at the fastest frequency: angle = position
    out = rope.apply_rope(Tensor(x), *cos_sin([1], 4)).numpy()[0, 0, 0]
    expected = [np.cos(1.0), 0.0, np.sin(1.0), 0.0]
    assert np.allclose(out, expected, atol=1e-5), (
        f"channel 0 = 1 at position 1 should turn into (cos 1, 0, sin 1, 0): channel i pairs with i + head_dim/2 "
        f"(rotate_half), got {out}")


@pytest.mark.task("apply_rope")
def test_rope_matches_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 6, 3, 16)).astype(np.float32)
    positions = [0, 1, 2, 7, 30, 31]
    out = rope.apply_rope(Tensor(x), *cos_sin(positions, 16)).numpy()
    err = np.abs(out - rope_numpy(x[0], np.array(positions, dtype=np.float64))[None]).max()
    assert err < 1e-4, f"apply_rope differs from the rotate_half formula by {err:.3g}"


@pytest.mark.task("apply_rope")
def test_rope_in_the_model(tiny_model, learner_code):
    model_matches_project(tiny_model, learner_code, "apply_rope")


# ---- grouped_query_attention ----

def attention_numpy(q, k, v, causal: bool) -> np.ndarray:
    """The plain recipe: K/V heads repeated G times, one softmax per query head."""
    B, T, H, Hd = q.shape
    G = H // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # (B,S,H,Hd)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(Hd)
    if causal:
        S = k.shape[1]
        scores = scores + np.where(np.arange(S)[None, :] > np.arange(S - T, S)[:, None], -np.inf, 0.0)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v)


def qkv(B, T, S, H, KvH, Hd, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, H, Hd)).astype(np.float32), rng.standard_normal((B, S, KvH, Hd)).astype(
        np.float32), rng.standard_normal((B, S, KvH, Hd)).astype(np.float32))


@pytest.mark.task("grouped_query_attention")
def test_attention_one_key_returns_its_value():
    q, k, v = qkv(1, 1, 1, 2, 1, 4, seed=4)
    out = contiguous.grouped_query_attention(Tensor(q), Tensor(k), Tensor(v), None).numpy()
    assert out.shape == (1, 1, 2, 4), f"q (1, 1, 2, 4) should give an output of the same shape, got {out.shape}"
    assert np.allclose(out, np.repeat(v, 2, axis=2), atol=1e-5), (
        f"with one key the softmax is 1: every query head should get that key's value {v[0, 0, 0]}, got {out[0, 0]}")


@pytest.mark.task("grouped_query_attention")
def test_attention_heads_share_kv_heads_in_groups():
    q, k, v = qkv(2, 1, 5, 4, 2, 8, seed=5)
    out = contiguous.grouped_query_attention(Tensor(q), Tensor(k), Tensor(v), None).numpy()
    err = np.abs(out - attention_numpy(q, k, v, causal=False)).max()
    assert err < 1e-4, (f"4 query heads over 2 K/V heads: heads 0, 1 should read K/V head 0 and heads 2, 3 K/V head "
                        f"1 (h // G); the output differs from that by {err:.3g}")


@pytest.mark.task("grouped_query_attention")
def test_attention_adds_the_mask():
    q, k, v = qkv(1, 3, 3, 4, 2, 8, seed=6)
    mask = Tensor(np.triu(np.full((3, 3), -np.inf, dtype=np.float32), 1))  # (T, S): key s hidden from query t < s
    out = contiguous.grouped_query_attention(Tensor(q), Tensor(k), Tensor(v), mask).numpy()
    err = np.abs(out - attention_numpy(q, k, v, causal=True)).max()
    assert err < 1e-4, f"with a causal mask added to the scores the output differs from the oracle's by {err:.3g}"


@pytest.mark.task("grouped_query_attention")
def test_attention_in_the_model(tiny_model, learner_code):
    model_matches_project(tiny_model, learner_code, "grouped_query_attention")
