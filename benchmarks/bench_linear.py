"""Matmul speed at the model's shapes: the C kernel (kernels/cpu/matmul.c) vs tinygrad's own kernels.

    .venv/bin/python benchmarks/bench_linear.py            # C kernel (all threads, 1 thread) vs tinygrad default
    BEAM=2 .venv/bin/python benchmarks/bench_linear.py     # the same, with tinygrad's kernels BEAM-searched

Every variant runs in this one process, on the same inputs, under TinyJit, as the model would: one jitted
call runs the matmul over several copies of the weight (>= 64 MB in all, more than the 32 MB L3), so weights
come from memory as they do in a real decode step, and the per-call Python overhead is shared. Reported:
ms per matmul (median of repeats), GB/s of weights read for M=1 (bandwidth-bound), GFLOP/s for M>1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from tinygrad import Device, Tensor, TinyJit
from tinygrad.helpers import BEAM

from tinyvllm.kernels import cpu_threads
from tinyvllm.kernels.linear import linear, uses_kernel

# SmolLM2-135M: (N, K) = (out_features, in_features) of each weight
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}


def time_variant(fn, x: Tensor, ws: list[Tensor], repeats: int) -> float:
    """Median seconds per matmul of `fn(x, w)`, jitted over all of `ws` in one call."""
    # the weights are captured by the JIT, as a model's are; only x is an input
    jit = TinyJit(lambda x: Tensor.realize(*[fn(x, w) for w in ws]))
    times = []
    for i in range(repeats + 2):  # 2 warm-up calls: run, then capture
        Device[x.device].synchronize()
        st = time.perf_counter()
        jit(x)
        Device[x.device].synchronize()
        if i >= 2:
            times.append((time.perf_counter() - st) / len(ws))
    return statistics.median(times)


def rate(M: int, N: int, K: int, t: float) -> str:
    """M=1 is bound by reading the weights: GB/s. Larger M by arithmetic: GFLOP/s."""
    return f"{4 * N * K / t / 1e9:.1f} GB/s" if M == 1 else f"{2 * M * N * K / t / 1e9:.1f} GFLOP/s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--batch", default="1,8,32", help="rows of x (tokens): comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    tg_name = f"tinygrad BEAM={BEAM.value}" if BEAM.value else "tinygrad default"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    # other processes share the cores: the load average says how much of them this run had
    print(f"device {Device.DEFAULT}; C kernel threads: {cpu_threads.NUM_THREADS}; load average {load:.1f} "
          f"on {os.cpu_count()} cores; times are ms per matmul\n")
    print(f"| weight (N x K) | M | C kernel ms | C 1 thread ms | {tg_name} ms | C rate | {tg_name} rate | C speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = max(2, min(32, (64 << 20) // (4 * N * K) + 1))
        ws = [Tensor(rng.standard_normal((N, K), dtype=np.float32)).realize() for _ in range(copies)]
        for M in (int(m) for m in args.batch.split(",")):
            x = Tensor(rng.standard_normal((M, K), dtype=np.float32)).realize()
            assert uses_kernel(x, ws[0]), "the C kernel is not available here"
            np.testing.assert_allclose(linear(x, ws[0]).numpy(), x.numpy() @ ws[0].numpy().T, rtol=1e-4, atol=1e-3)
            t_c = time_variant(linear, x, ws, args.repeats)
            with cpu_threads.threads_enabled(False):
                t_c1 = time_variant(linear, x, ws, args.repeats)
            t_tg = time_variant(lambda x, w: x @ w.T, x, ws, args.repeats)
            print(f"| {name} {N}x{K} | {M} | {t_c * 1e3:.3f} | {t_c1 * 1e3:.3f} | {t_tg * 1e3:.3f} | "
                  f"{rate(M, N, K, t_c)} | {rate(M, N, K, t_tg)} | {t_tg / t_c:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
