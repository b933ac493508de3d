"""`linear(x, w)`: the model's matmuls, on a hand-written kernel where there is one.

    x (..., K) @ w(N, K).T -> (..., N)        w as the model stores it: (out_features, in_features)

On the CPU device with float32 tensors this runs kernels/cpu/matmul.c (AVX2/FMA, both cores, see that file
for why); everywhere else, or with `TINYVLLM_PORTABLE=1` (or `tinyvllm.kernels.linear.PORTABLE = True`), it is the
portable `x @ w.T` that tinygrad compiles for any device. Both give the same numbers up to float rounding.

The kernel is compiled per shape: x's leading dimensions must be concrete (a decode batch bucket, a prefill
chunk), not symbolic; a symbolic shape takes the portable path. Inside a TinyJit or a
`function(precompile=True)` the kernel is one more node of the graph.
"""

from __future__ import annotations

import math
import os

from tinygrad import Tensor, dtypes

from tinyvllm.kernels.launcher import has_kernel, launch
from tinyvllm.tinygrad_adapter import Estimates

PORTABLE = os.getenv("TINYVLLM_PORTABLE", "0") == "1"  # True: never use the hand-written kernels


def uses_kernel(x: Tensor, w: Tensor) -> bool:
    """Would `linear(x, w)` run the hand-written kernel?"""
    if PORTABLE or not isinstance(x.device, str) or x.device != w.device:
        return False
    if x.dtype != dtypes.float32 or w.dtype != dtypes.float32 or w.ndim != 2 or x.ndim < 1:
        return False
    if not all(isinstance(s, int) for s in x.shape + w.shape) or x.shape[-1] != w.shape[1] or 0 in x.shape + w.shape:
        return False
    return has_kernel("matmul", x.device)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w(N, K).T -> (..., N)."""
    if not uses_kernel(x, w):
        return x @ w.T
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    # ops: one multiply-add per weight per row of x; mem: w once, x once, out once (what DEBUG=2 rates it by)
    estimates = Estimates(ops=2 * M * N * K, lds=4 * (M * K + N * K + M * N), mem=4 * (M * K + N * K + M * N))
    out = Tensor.invalids(M, N, dtype=dtypes.float32, device=x.device)  # (M,N), every element written by the kernel
    (out,) = launch("matmul", outs=[out], ins=[x.reshape(M, K).contiguous(), w.contiguous()],
                    defines={"TV_M": M, "TV_N": N, "TV_K": K}, estimates=estimates)
    return out.reshape(*x.shape[:-1], N)
