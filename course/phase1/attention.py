"""Phase 1, task grouped_query_attention: softmax(q k^T / sqrt(head_dim) + mask) v, with fewer K/V heads than q heads.

The engine calls it as `tinyvllm.attention.contiguous.grouped_query_attention`, from the contiguous cache's
attention (Phase 1) and the paged one (Phase 2) alike. Chapter: docs/phases/01-foundation.md ("Grouped-query
attention", "Build it"). Grade: make course P=1
"""

from __future__ import annotations

from tinygrad import Tensor


def grouped_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention where each of the KvH K/V heads serves G = H / KvH query heads.

    q: (B, T, H, Hd)   k, v: (B, S, KvH, Hd)   mask: None, or broadcastable to (B, KvH, G, T, S), 0 or -inf
    -> (B, T, H, Hd)

    Query head h uses K/V head h // G (heads 0..G-1 share K/V head 0). Do not copy K and V G times: reshape q to
    (B, T, KvH, G, Hd) and move the axes so that a matmul broadcasts K over G:

        qg: (B, KvH, G, T, Hd)   k: (B, KvH, 1, Hd, S)   v: (B, KvH, 1, S, Hd)
        scores = qg @ k / sqrt(Hd) (+ mask)             (B, KvH, G, T, S)
        out = softmax(scores over S, in float32, cast back to q.dtype) @ v      (B, KvH, G, T, Hd)

    then back to (B, T, H, Hd). Tensor has `.reshape`, `.permute`, `.unsqueeze`, `.softmax(-1)`, `@`.
    """
    raise NotImplementedError("course/phase1/attention.py: grouped_query_attention is yours to write")
