"""The contiguous KV cache, `k_cache[layer]: (B, max_model_len, n_kv_heads, head_dim)`; position p is row p.

Taught in docs/phases/01-foundation.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType

from tinyvllm.device_memory import zeros
from tinyvllm.model.config import ModelConfig


def allocate_contiguous_kv_cache(config: ModelConfig, max_model_len: int, batch_size: int = 1,
                                 dtype: DType = dtypes.float32,
                                 device: str | None = None) -> list[tuple[Tensor, Tensor]]:
    """One (k_cache, v_cache) pair per layer, each (B, max_model_len, n_kv_heads, head_dim), zero-filled."""
    shape = (batch_size, max_model_len, config.num_key_value_heads, config.head_dim)
    return [(zeros(shape, dtype, device), zeros(shape, dtype, device))
            for _ in range(config.num_hidden_layers)]


def grouped_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention, each of the KvH K/V heads serving G = H / KvH query heads (not copied G times)."""
    B, T, H, Hd = q.shape
    KvH = k.shape[2]
    G = H // KvH
    qg = q.reshape(B, T, KvH, G, Hd).permute(0, 2, 3, 1, 4)  # (B,KvH,G,T,Hd)
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # (B,KvH,1,Hd,S)
    vt = v.permute(0, 2, 1, 3).unsqueeze(2)  # (B,KvH,1,S,Hd)
    scores = (qg @ kt) * (1.0 / Hd**0.5)  # (B,KvH,G,T,S)
    if mask is not None:
        scores = scores + mask
    probs = scores.float().softmax(-1).cast(q.dtype)
    out = probs @ vt  # (B,KvH,G,T,Hd)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, H, Hd)


@dataclass
class ContiguousAttentionMetadata:
    """This step's tokens are at start_pos .. start_pos+T-1 (a bound symbolic variable under TinyJit)."""

    start_pos: int | UOp

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, Tensor],
               sliding_window: int | None = None) -> Tensor:
        """q: (B,T,H,Hd), k/v: (B,T,KvH,Hd) -> (B,T,H,Hd); sliding_window W: keys p-W+1 .. p only."""
        k_cache, v_cache = kv_cache
        T, sp = q.shape[1], self.start_pos
        # NOTE: a store + `after` instead of `assign`, so this also works inside a tinygrad `function`
        k_cache = Tensor(k_cache.uop.after(k_cache[:, sp:sp + T].uop.store(k.cast(k_cache.dtype).uop)))
        v_cache = Tensor(v_cache.uop.after(v_cache[:, sp:sp + T].uop.store(v.cast(v_cache.dtype).uop)))
        keys, values = k_cache[:, : sp + T], v_cache[:, : sp + T]
        mask = None
        if not isinstance(T, int) or T > 1 or sliding_window is not None:
            # causal: query t (at position sp+t) sees keys 0 .. sp+t (and, in a window, not before sp+t-W+1)
            # a fixed-length arange cut to the symbolic length: a symbolic-length arange is an S x S running sum
            key_pos = Tensor.arange(k_cache.shape[1])[: sp + T].reshape(1, -1)  # (1, S)
            query_pos = (Tensor.arange(T) + sp).reshape(-1, 1)  # (T, 1)
            hidden = key_pos > query_pos
            if sliding_window is not None:
                hidden = hidden | (key_pos <= query_pos - sliding_window)
            mask = hidden.where(float("-inf"), 0.0).cast(q.dtype)  # (T, S)
        return grouped_query_attention(q, keys.cast(q.dtype), values.cast(q.dtype), mask)
