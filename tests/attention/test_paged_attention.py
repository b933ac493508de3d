"""Phase 2: paged attention equals the contiguous cache, on random tensors (the engine on the paged cache, on the real
model: tests/engine/test_paged_engine.py, Phase 3)."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_cache import PagedKVCache, num_blocks_for_memory, parse_memory
from tinyvllm.attention.paged import paged_attention, reshape_and_cache
from tinyvllm.model.config import ModelConfig


def reference_attention(q, keys, values, positions):
    """numpy: q (T,H,Hd) at positions (T,), keys/values (S,KvH,Hd) at positions 0..S-1, causal, GQA."""
    T, H, Hd = q.shape
    G = H // keys.shape[1]
    out = np.zeros_like(q)
    for t in range(T):
        for h in range(H):
            k, v = keys[: positions[t] + 1, h // G], values[: positions[t] + 1, h // G]
            s = k @ q[t, h] / np.sqrt(Hd)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v
    return out


def test_reshape_and_cache_writes_only_the_given_slots():
    rng = np.random.default_rng(0)
    cache = Tensor.zeros(6, 4, 2, 3).contiguous().realize()  # 24 slots
    slots = np.array([5, 0, 23, 12], dtype=np.int32)
    new = rng.standard_normal((4, 2, 3)).astype(np.float32)
    out = reshape_and_cache(Tensor(new), cache, Tensor(slots)).numpy().reshape(24, 2, 3)
    expected = np.zeros((24, 2, 3), np.float32)
    expected[slots] = new
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_paged_attention_matches_reference(block_size, n_heads, n_kv_heads):
    """A batch of sequences of different lengths, scattered over the pool, ending in partial blocks."""
    rng = np.random.default_rng(block_size * 10 + n_heads)
    head_dim, lengths = 16, [1, block_size + 3, 3 * block_size - 1, 2 * block_size]
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_cache = Tensor.zeros(num_blocks, block_size, n_kv_heads, head_dim).contiguous().realize()
    v_cache = Tensor.zeros(num_blocks, block_size, n_kv_heads, head_dim).contiguous().realize()
    free = list(rng.permutation(num_blocks))
    tables, slots, keys, values = [], [], [], []
    for n in lengths:
        table = [int(free.pop()) for _ in range(-(-n // block_size))]
        tables.append(table + [0] * (max_blocks - len(table)))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
        keys.append(rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32))
        values.append(rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32))
    slot_mapping = Tensor(np.array(slots, dtype=np.int32))
    k_cache = reshape_and_cache(Tensor(np.concatenate(keys)), k_cache, slot_mapping).realize()
    v_cache = reshape_and_cache(Tensor(np.concatenate(values)), v_cache, slot_mapping).realize()
    # one decode query per sequence, at its last position
    q = rng.standard_normal((len(lengths), 1, n_heads, head_dim)).astype(np.float32)
    positions = np.array([[n - 1] for n in lengths], dtype=np.int32)
    out = paged_attention(Tensor(q), k_cache, v_cache, Tensor(np.array(tables, dtype=np.int32)), max_blocks,
                          Tensor(positions)).numpy()
    for b, n in enumerate(lengths):
        ref = reference_attention(q[b], keys[b], values[b], positions[b])
        np.testing.assert_allclose(out[b], ref, atol=1e-5, rtol=1e-5)


def test_paged_prefill_chunk_is_causal():
    """Several queries of one sequence in one step: each sees only the keys up to its own position."""
    rng = np.random.default_rng(1)
    bs, n, H, KvH, Hd = 4, 10, 4, 2, 8
    k_cache = Tensor.zeros(5, bs, KvH, Hd).contiguous().realize()
    v_cache = Tensor.zeros(5, bs, KvH, Hd).contiguous().realize()
    table = [3, 0, 4]
    slots = Tensor(np.array([table[p // bs] * bs + p % bs for p in range(n)], dtype=np.int32))
    k, v = (rng.standard_normal((n, KvH, Hd)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, n, H, Hd)).astype(np.float32)
    k_cache = reshape_and_cache(Tensor(k), k_cache, slots)
    v_cache = reshape_and_cache(Tensor(v), v_cache, slots)
    out = paged_attention(Tensor(q), k_cache, v_cache, Tensor(np.array([table], dtype=np.int32)), 3,
                          Tensor(np.arange(n, dtype=np.int32).reshape(1, n))).numpy()
    np.testing.assert_allclose(out[0], reference_attention(q[0], k, v, np.arange(n)), atol=1e-5, rtol=1e-5)


def test_kv_cache_sizing():
    cfg = ModelConfig(vocab_size=10, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=8192, tie_word_embeddings=True)
    assert parse_memory("512MiB") == 512 * 2**20 and parse_memory("1.5GB") == 1_500_000_000
    per_block = 2 * 30 * 16 * 3 * 64 * 4  # K and V, layers, block_size, kv heads, head_dim, float32
    assert num_blocks_for_memory(cfg, 16, "512MiB") == 512 * 2**20 // per_block - 1  # the null block is in the budget
    assert (num_blocks_for_memory(cfg, 16, "512MiB") + 1) * per_block <= 512 * 2**20
    assert num_blocks_for_memory(cfg, 16, 2 * per_block) == 1
    with pytest.raises(ValueError, match="less than two blocks"):
        num_blocks_for_memory(cfg, 16, 2 * per_block - 1)
    with pytest.raises(ValueError, match="512MiB"):
        parse_memory("lots")
    cache = PagedKVCache(ModelConfig(**{**cfg.__dict__, "num_hidden_layers": 2}), num_blocks=3, block_size=4)
    assert cache.kv_caches[0][0].shape == (4, 4, 3, 64) and cache.null_slot == 12
