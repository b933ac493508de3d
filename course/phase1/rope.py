"""Phase 1, task apply_rope: rotary position embeddings, the way each q and k learns where its token stands.

The engine calls it as `tinyvllm.model.rope.apply_rope` on q and k in every layer, with cos and sin from
`rope_cos_sin(positions, inv_freq)`. Chapter: docs/phases/01-foundation.md ("RoPE: position by rotation",
"Build it"); by hand in 01-appendix-weights-and-layers.md. Grade: make course P=1
"""

from __future__ import annotations

from tinygrad import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (..., T, n_heads, head_dim), cos and sin: (..., T, 1, head_dim/2) -> x rotated, same shape.

    HF's rotate_half pairing: channel i is paired with channel i + head_dim/2 (not with its neighbour i+1), and
    each pair (x1, x2) turns by its angle:

        x1' = x1 * cos - x2 * sin
        x2' = x2 * cos + x1 * sin

    where x1 = x[..., :half] and x2 = x[..., half:]; the result is x1' followed by x2' on the last axis
    (`a.cat(b, dim=-1)`). cos and sin broadcast over the heads.
    """
    raise NotImplementedError("course/phase1/rope.py: apply_rope is yours to write")
