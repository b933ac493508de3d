"""`act_and_mul(gate_up, act)`: the MLP's gated activation in one kernel where there is one (vLLM's `silu_and_mul`).

    gate_up (..., 2F) float32, each row [gate | up]  ->  (..., F) = act(gate) * up        act: "silu" or "gelu_tanh"

Chapter: docs/phases/04-batched-forward.md, section 5.
"""

from __future__ import annotations

import math

from tinygrad import Tensor, dtypes

from tinyvllm import ops
from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.launcher import has_kernel, launch, local_shape, output
from tinyvllm.tinygrad_ext.buffers import shard_axis
from tinyvllm.tinygrad_ext.programs import kernel_cost, kernel_input

KERNEL = "act_and_mul"
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # TV_GELU
NUM_THREADS = 256  # GPU threads per block (one per output element)


def uses_kernel(gate_up: Tensor) -> bool:
    """Would `act_and_mul` run the hand-written kernel on this tensor?"""
    if linear_module.PORTABLE or gate_up.dtype != dtypes.float32 or gate_up.ndim < 1:
        return False
    if not all(isinstance(s, int) for s in gate_up.shape) or 0 in gate_up.shape or gate_up.shape[-1] % 2:
        return False
    if not isinstance(gate_up.device, str):
        axis = shard_axis(gate_up)
        if gate_up.ndim < 2 or axis is None or axis % gate_up.ndim != gate_up.ndim - 2 or local_shape(gate_up)[-2] != 1:
            return False
    return has_kernel(KERNEL, gate_up.device)


def act_and_mul(gate_up: Tensor, act: str) -> Tensor:
    """gate_up (..., 2F) -> act(gate_up[..., :F]) * gate_up[..., F:], (..., F)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"no gated activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
    if not uses_kernel(gate_up):
        return ops.act_and_mul(gate_up, act)
    *lead, two_f = local_shape(gate_up)  # one device's part
    R, F = math.prod(lead), two_f // 2
    defines = {"TV_R": R, "TV_F": F, "TV_GELU": ACTIVATIONS[act], "TV_NUM_THREADS": NUM_THREADS}
    x = kernel_input(gate_up.reshape(R, -1))  # split: (R, S * 2F), device s's part [gate_s | up_s]
    out = output((R, F), dtypes.float32, x, None if isinstance(x.device, str) else 1)
    # ~30 operations per output (the exp polynomial, the division); reads 2F floats a row, writes F
    estimates = kernel_cost(ops=30 * R * F, lds=8 * R * F, mem=12 * R * F)
    # a GPU: one thread per output; the CPU runs the kernel once (its rows go to the thread pool), whatever the grid
    (out,) = launch(KERNEL, outs=[out], ins=[x], defines=defines, estimates=estimates,
                    grid=(-(-R * F // NUM_THREADS), 1, 1), local_size=(NUM_THREADS, 1, 1))
    return out.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
