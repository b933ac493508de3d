"""The model's two ops that have kernels, in portable tinygrad (Phase 1): what runs on any device."""

from __future__ import annotations

from tinygrad import Tensor


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w(N, K).T -> (..., N), w as the model stores it: (out_features, in_features)."""
    return x @ w.T


def act_and_mul(gate_up: Tensor, act: str) -> Tensor:
    """gate_up (..., 2F) -> act(gate) * up (..., F): SwiGLU (silu) or GeGLU (gelu, tinygrad's tanh form)."""
    F = gate_up.shape[-1] // 2
    gate = gate_up[..., :F]
    return (gate.silu() if act == "silu" else gate.gelu()) * gate_up[..., F:]
