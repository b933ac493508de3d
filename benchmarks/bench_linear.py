"""Matmul speed at the model's shapes: the C kernel (kernels/cpu/matmul.c) vs tinygrad's own kernels.

    .venv/bin/python benchmarks/bench_linear.py            # C kernel (all threads, 1 thread) vs tinygrad default
    BEAM=2 .venv/bin/python benchmarks/bench_linear.py     # the same, with tinygrad's kernels BEAM-searched

Every variant runs in this one process, on the same inputs, under TinyJit, as the model would: one jitted
call runs the matmul over several copies of the weight (>= 64 MB in all, more than the 32 MB L3), so weights
come from memory as they do in a real decode step, and the per-call Python overhead is shared. Reported:
ms per matmul (best of the repeats, the variants taking turns in each), GB/s of weights read for M=1
(bandwidth-bound), GFLOP/s for M>1. The machine's other load is printed: on shared cores, compare columns of one run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from common import add_peers_arg, no_peer_twin, write_results  # (benchmarks/common.py)
from tinygrad import Device, Tensor, TinyJit
from tinygrad.helpers import BEAM

from tinyvllm.kernels import cpu_threads
from tinyvllm.kernels.linear import linear, uses_kernel

# SmolLM2-135M: (N, K) = (out_features, in_features) of each weight
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}


def time_variants(variants: dict[str, Callable[[], None]], x: Tensor, num_matmuls: int,
                  repeats: int) -> dict[str, float]:
    """Best seconds per matmul of each variant. The variants take turns in every repeat, so that a burst of load
    from other processes falls on all of them alike; the best repeat is the one least disturbed."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats + 2):  # 2 warm-up calls of each: run, then TinyJit capture
        for name, run in variants.items():
            Device[x.device].synchronize()
            st = time.perf_counter()
            run()
            Device[x.device].synchronize()
            if i >= 2:
                times[name].append((time.perf_counter() - st) / num_matmuls)
    return {name: min(ts) for name, ts in times.items()}


def jitted(fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, ws: list[Tensor]) -> Callable[[], None]:
    """fn(x, w) for every w in one TinyJit call: the weights are captured by the JIT, as a model's are."""
    jit = TinyJit(lambda x: Tensor.realize(*[fn(x, w) for w in ws]))
    return lambda: jit(x)


def with_threads(enabled: bool, run: Callable[[], None]) -> Callable[[], None]:
    def wrapped() -> None:
        with cpu_threads.threads_enabled(enabled):
            run()
    return wrapped


def rate(M: int, N: int, K: int, t: float) -> str:
    """M=1 is bound by reading the weights: GB/s. Larger M by arithmetic: GFLOP/s."""
    return f"{4 * N * K / t / 1e9:.1f} GB/s" if M == 1 else f"{2 * M * N * K / t / 1e9:.1f} GFLOP/s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--batch", default="1,8,32", help="rows of x (tokens): comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    add_peers_arg(p)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    tg_name = f"tinygrad BEAM={BEAM.value}" if BEAM.value else "tinygrad default"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    # other processes share the cores: the load average says how much of them this run had
    print(f"device {Device.DEFAULT}; C kernel threads: {cpu_threads.NUM_THREADS}; load average {load:.1f} "
          f"on {os.cpu_count()} cores; times are ms per matmul\n")
    print(f"| weight (N x K) | M | C kernel ms | C 1 thread ms | {tg_name} ms | C rate | {tg_name} rate | C speedup |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = max(2, min(32, (64 << 20) // (4 * N * K) + 1))
        ws = [Tensor(rng.standard_normal((N, K), dtype=np.float32)).realize() for _ in range(copies)]
        for M in (int(m) for m in args.batch.split(",")):
            x = Tensor(rng.standard_normal((M, K), dtype=np.float32)).realize()
            assert uses_kernel(x, ws[0]), "the C kernel is not available here"
            np.testing.assert_allclose(linear(x, ws[0]).numpy(), x.numpy() @ ws[0].numpy().T, rtol=1e-4, atol=1e-3)
            c_kernel = jitted(linear, x, ws)
            t = time_variants({"c": c_kernel, "c1": with_threads(False, c_kernel),
                               "tg": jitted(lambda x, w: x @ w.T, x, ws)}, x, len(ws), args.repeats)
            t_c, t_c1, t_tg = t["c"], t["c1"], t["tg"]
            print(f"| {name} {N}x{K} | {M} | {t_c * 1e3:.3f} | {t_c1 * 1e3:.3f} | {t_tg * 1e3:.3f} | "
                  f"{rate(M, N, K, t_c)} | {rate(M, N, K, t_tg)} | {t_tg / t_c:.1f}x |", flush=True)
            rows.append({"weight": name, "n": N, "k": K, "m": M, "c_kernel_ms": t_c * 1e3, "c_1_thread_ms": t_c1 * 1e3,
                         "tinygrad_ms": t_tg * 1e3, "tinygrad_beam": BEAM.value,
                         "c_kernel_weights_gb_s": 4 * N * K / t_c / 1e9})
    no_peer_twin(args, "llama.cpp's matmuls are timed inside whole-model runs (bench_generate and bench_throughput "
                 "--peers), not alone")
    write_results("bench_linear", {"device": Device.DEFAULT, "rows": rows}, args)


if __name__ == "__main__":
    main()
