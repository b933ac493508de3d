"""Phase 1, task rms_norm: the normalization before every attention and MLP of the LLaMA block.

The engine calls it as `tinyvllm.model.llama.rms_norm` (each layer twice, and once before `lm_head`).
Chapter: docs/phases/01-foundation.md, "Build it". Grade: make course P=1
"""

from __future__ import annotations

from tinygrad import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: (..., D), weight: (D,) -> (..., D) in x's dtype.

    Each row is divided by its root mean square, then scaled per channel:

        x / sqrt(mean(x^2 over the last axis) + eps) * weight

    Compute the statistic in float32 (`x.float()`) whatever x's dtype (as HF does: float16 squares overflow),
    cast back to x.dtype, then multiply by weight. Tensor has `.square()`, `.mean(axis=-1, keepdim=True)`,
    `.rsqrt()`, `.cast(dtype)`.
    """
    raise NotImplementedError("course/phase1/rms_norm.py: rms_norm is yours to write")
