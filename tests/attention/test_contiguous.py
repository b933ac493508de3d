"""Phase 1's attention (tinyvllm/attention/contiguous.py): grouped-query attention against numpy's, each K/V head
serving its group of query heads, and the contiguous cache's shape."""

from __future__ import annotations

import numpy as np
from conftest import TINY_CONFIG
from tinygrad import Tensor

from tinyvllm.attention.contiguous import allocate_contiguous_kv_cache, grouped_query_attention


def reference(q, k, v, causal):
    B, T, H, Hd = q.shape
    S, KvH = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for h in range(H):
        kv = h // (H // KvH)  # query head h reads K/V head h // G
        scores = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kv]) / np.sqrt(Hd)
        if causal:  # query t (the last T of S positions) sees keys up to its own position
            scores = np.where(np.arange(S)[None, :] <= np.arange(S - T, S)[:, None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("bts,bsd->btd", weights / weights.sum(-1, keepdims=True), v[:, :, kv])
    return out


def test_grouped_query_attention_matches_numpy():
    rng = np.random.default_rng(0)
    B, T, S, H, KvH, Hd = 2, 3, 5, 4, 2, 8
    q = rng.standard_normal((B, T, H, Hd)).astype(np.float32)
    k, v = rng.standard_normal((2, B, S, KvH, Hd)).astype(np.float32)
    out = grouped_query_attention(Tensor(q), Tensor(k), Tensor(v), None).numpy()
    np.testing.assert_allclose(out, reference(q, k, v, causal=False), rtol=1e-4, atol=1e-5)
    allowed = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]
    mask = Tensor(np.where(allowed, 0.0, -np.inf).astype(np.float32))  # (T, S) broadcasts to (B, KvH, G, T, S)
    out = grouped_query_attention(Tensor(q), Tensor(k), Tensor(v), mask).numpy()
    np.testing.assert_allclose(out, reference(q, k, v, causal=True), rtol=1e-4, atol=1e-5)


def test_the_contiguous_cache_is_one_zeroed_pair_per_layer():
    cache = allocate_contiguous_kv_cache(TINY_CONFIG, max_model_len=32, batch_size=2)
    assert len(cache) == TINY_CONFIG.num_hidden_layers
    k, v = cache[0]
    assert k.shape == v.shape == (2, 32, TINY_CONFIG.num_key_value_heads, TINY_CONFIG.head_dim)
    assert not k.numpy().any() and not v.numpy().any()
