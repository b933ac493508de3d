"""`linear(x, w)`: the model's matmuls, on a hand-written kernel where there is one.

    x (..., K) @ w(N, K).T -> (..., N)        w as the model stores it: (out_features, in_features)

Chapter: docs/phases/04-batched-forward.md, section 5.
"""

from __future__ import annotations

import math
import os

from tinygrad import Tensor, dtypes

from tinyvllm import ops
from tinyvllm.kernels.launcher import has_kernel, launch, local_shape, output
from tinyvllm.tinygrad_ext.buffers import shard_axis
from tinyvllm.tinygrad_ext.programs import kernel_cost, kernel_input

PORTABLE = os.getenv("TINYVLLM_PORTABLE", "0") == "1"  # True: never use the hand-written kernels


def uses_kernel(x: Tensor, w: Tensor) -> bool:
    """Would `linear(x, w)` run the hand-written kernel?"""
    if PORTABLE or x.device != w.device or not split_fits(x, w):
        return False
    if x.dtype != dtypes.float32 or w.dtype != dtypes.float32 or w.ndim != 2 or x.ndim < 1:
        return False
    if not all(isinstance(s, int) for s in x.shape + w.shape) or x.shape[-1] != w.shape[1] or 0 in x.shape + w.shape:
        return False
    return has_kernel("matmul", x.device)


def split_fits(x: Tensor, w: Tensor) -> bool:
    """Can a kernel run per device on these operands (tensor parallel, Phase 8)?"""
    if isinstance(x.device, str):
        return True
    w_axis, x_axis = shard_axis(w), shard_axis(x)
    return (w_axis in (None, 0) and x_axis is None) or (w_axis == 1 and x_axis == x.ndim - 1)


def run_split(x: Tensor, w: Tensor, N: int, kernel) -> Tensor:
    """Run `kernel(x2d, w, out)` (M, K_local) x (N_local, K_local) -> (M, N_local) once per device of w and return
    x (..., K) @ w(N, K).T -> (..., N): a column-parallel w gives each device its slice of the output features;
    a row-parallel w gives each a partial sum of every output, summed over the devices (the all-reduce)."""
    lead = x.shape[:-1]
    M, K_local = math.prod(lead), local_shape(x)[-1]
    # N // w.shape[0]: a weight repacked 8 rows to a row of its data (kernels/repack.py) holds 8 outputs per row
    N_local, row_parallel = local_shape(w)[0] * (N // w.shape[0]), shard_axis(w) == 1
    out = output((M, N_local), dtypes.float32, w, None if isinstance(w.device, str) or shard_axis(w) is None
                 else 0 if row_parallel else 1)
    out = kernel(kernel_input(x.reshape(M, -1)), M, N_local, K_local, out)
    if row_parallel:  # (S*M, N) split by device: each device's partial product, summed over them
        return out.reshape(-1, M, N).sum(0).reshape(*lead, N)
    return out.reshape(*lead, N)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w(N, K).T -> (..., N)."""
    if not uses_kernel(x, w):
        return ops.linear(x, w)

    def kernel(x2d: Tensor, M: int, N: int, K: int, out: Tensor) -> Tensor:
        # ops: one multiply-add per weight per row of x; mem: w once, x once, out once (what DEBUG=2 rates it by)
        estimates = kernel_cost(ops=2 * M * N * K, lds=4 * (M * K + N * K + M * N), mem=4 * (M * K + N * K + M * N))
        return launch("matmul", outs=[out], ins=[x2d, w.contiguous()], defines={"TV_M": M, "TV_N": N, "TV_K": K},
                      estimates=estimates)[0]
    return run_split(x, w, w.shape[0], kernel)
