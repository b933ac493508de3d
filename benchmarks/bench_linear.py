"""Matmul speed at the model's shapes: the C kernel (kernels/cpu/matmul.c) vs tinygrad's own kernels, and the
quantized kernels (kernels/cpu/qmatmul.c, qmatmul_k.c) on the same shapes.

    .venv/bin/python benchmarks/bench_linear.py            # C kernel (all threads, 1 thread) vs tinygrad default
    BEAM=2 .venv/bin/python benchmarks/bench_linear.py     # the same, with tinygrad's kernels BEAM-searched
    .venv/bin/python benchmarks/bench_linear.py --formats q4_1,q8_0 --batch 1,32   # a subset of the formats

Every variant runs in this one process, on the same inputs, under TinyJit, as the model would: one jitted
call runs the matmul over several copies of the weight (>= 64 MB in all, more than the 32 MB L3), so weights
come from memory as they do in a real decode step, and the per-call Python overhead is shared. Reported:
ms per matmul (best of the repeats, the variants taking turns in each), GB/s of weights read for M=1
(bandwidth-bound), GFLOP/s for M>1. The machine's other load is printed: on shared cores, compare columns of one run.

The second table times `qlinear` on GGUF blocks (random quants with valid float16 scales) in each format, in the
same turns as the float32 C kernel on the same shape, both replayed as the engine replays a step (GraphedJit: one
C call, no Python per kernel), each over >= 64 MB of weights: weight GB/s (the bytes of the blocks), GFLOP/s
(2 M N K), and the speedup over float32. The K-quants need K to be a multiple of 256: of the model's shapes only
down_proj has one.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from common import BenchParser, add_peers_arg, no_peer_twin, write_results  # (benchmarks/common.py)
from tinygrad import Device, Tensor, TinyJit
from tinygrad.helpers import BEAM

from tinyvllm.kernels import cpu_threads
from tinyvllm.kernels import qlinear as qlinear_module
from tinyvllm.kernels.cpu_graph import GraphedJit
from tinyvllm.kernels.linear import linear, uses_kernel
from tinyvllm.kernels.qlinear import QUANT_FORMATS, QuantizedWeight, qlinear
from tinyvllm.model.quant import dequantize

# SmolLM2-135M: (N, K) = (out_features, in_features) of each weight
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}


FORMATS = {f.name.lower(): t for t, f in QUANT_FORMATS.items()}  # q4_0, q4_1, ..., iq4_xs -> ggml type


def random_blocks(rng: np.random.Generator, ggml_type: int, N: int, K: int) -> np.ndarray:
    """(N, row bytes) uint8 GGUF blocks: random quants and sub-block scales, float16 scales of a real weight's size."""
    fmt = QUANT_FORMATS[ggml_type]
    nb = K // fmt.block_size
    b = rng.integers(0, 256, (N, nb, fmt.type_size), dtype=np.uint8)
    scales = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2],
              14: [208], 20: [0], 23: [0]}[ggml_type]  # byte offsets of the float16 scales
    for at in scales:
        b[..., at:at + 2] = rng.uniform(0.001, 0.01, (N, nb)).astype(np.float16).view(np.uint8).reshape(N, nb, 2)
    return b.reshape(N, -1)


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


def graphed(fn: Callable, x: Tensor, ws: list) -> Callable[[], None]:
    """As `jitted`, replayed the way the engine replays a step: one C call for all the kernels (cpu_graph.py), so
    that the ~20 us of Python per kernel of a plain TinyJit replay is not counted (it would be most of a small
    quantized matmul's time)."""
    jit = GraphedJit(lambda x: Tensor.realize(*[fn(x, w) for w in ws]))
    return lambda: jit(x)


def with_threads(enabled: bool, run: Callable[[], None]) -> Callable[[], None]:
    def wrapped() -> None:
        with cpu_threads.threads_enabled(enabled):
            run()
    return wrapped


def without_vnni(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with qlinear's kernels built for AVX2's dot products (TV_NO_VNNI) on a CPU that has AVX-512 VNNI: the
    flag is read when the graph is captured (the first call), later calls replay what was built then."""
    def wrapped() -> None:
        before, qlinear_module.VNNI = qlinear_module.VNNI, False
        try:
            run()
        finally:
            qlinear_module.VNNI = before
    return wrapped


def has_vnni() -> bool:
    """Does this CPU have AVX-512 VNNI (the kernels, compiled for this machine, then use it)?"""
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_vnni" in f.read()
    except OSError:
        return False


def rate(M: int, N: int, K: int, t: float) -> str:
    """M=1 is bound by reading the weights: GB/s. Larger M by arithmetic: GFLOP/s."""
    return f"{4 * N * K / t / 1e9:.1f} GB/s" if M == 1 else f"{2 * M * N * K / t / 1e9:.1f} GFLOP/s"


def main() -> None:
    p = BenchParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--batch", default="1,8,32", help="rows of x (tokens): comma-separated")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="quantized formats, comma-separated subset of " + ",".join(FORMATS) + " ('' for none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quantized-only", action="store_true",
                   help="skip the float32 table (C kernel vs tinygrad); results go to bench_linear_quantized.json")
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
    for name in args.shapes.split(",") if not args.quantized_only else []:
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
    quantized = quantized_table(args, rng)
    no_peer_twin(args, "llama.cpp's matmuls are timed inside whole-model runs (bench_generate and bench_throughput "
                 "--peers), not alone")
    # --quantized-only: a file of its own, so that bench_linear.json keeps both tables of one run
    write_results("bench_linear_quantized" if args.quantized_only else "bench_linear",
                  {"device": Device.DEFAULT, "rows": rows, "quantized": quantized}, args)


def quantized_table(args: argparse.Namespace, rng: np.random.Generator) -> list[dict]:
    """qlinear in each format beside the float32 C kernel, same shape, same x, taking turns."""
    formats = [FORMATS[f.strip().lower()] for f in args.formats.split(",") if f.strip()]
    if not formats:
        return []
    vnni = has_vnni()
    print(f"\nquantized weights (kernels/cpu/qmatmul*.c), ms per matmul; GB/s of the weights' bytes; "
          f"load average {os.getloadavg()[0]:.1f}; AVX-512 VNNI: {'yes' if vnni else 'no'} (AVX2 ms: the same "
          f"kernels built with AVX2's dot products)\n")
    print("| weight (N x K) | M | format | bits/weight | ms | float32 ms | weight GB/s | GFLOP/s | vs float32 | "
          "1 thread ms | float32 1 thread ms | AVX2 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        fmts = [t for t in formats if K % QUANT_FORMATS[t].block_size == 0]
        ws = {0: [Tensor(rng.standard_normal((N, K), dtype=np.float32)).realize()
                  for _ in range(max(2, min(32, (64 << 20) // (4 * N * K) + 1)))]}
        for t in fmts:  # >= 64 MB of blocks in all, so that they come from memory (more copies than float32 needs)
            nbytes = N * K // QUANT_FORMATS[t].block_size * QUANT_FORMATS[t].type_size
            ws[t] = [QuantizedWeight(Tensor(random_blocks(rng, t, N, K)).realize(), t, (N, K))
                     for _ in range(max(2, min(512, (64 << 20) // nbytes + 1)))]
        for M in (int(m) for m in args.batch.split(",")):
            x = Tensor(rng.standard_normal((M, K), dtype=np.float32)).realize()
            variants = {0: graphed(linear, x, ws[0])}
            for t in fmts:
                w = ws[t][0]
                assert qlinear_module.uses_kernel(x, w), "the quantized kernel is not available here"
                W = dequantize(w.data.numpy().reshape(-1), t, (N, K))  # a sanity check: 8-bit x errs by ~1% of |x||W|
                err = np.abs(qlinear(x, w).numpy() - x.numpy() @ W.T)
                assert (err <= 0.02 * (np.abs(x.numpy()) @ np.abs(W.T))).all(), f"{QUANT_FORMATS[t].name}: wrong"
                variants[t] = graphed(qlinear, x, ws[t])
            variants.update({(t, 1): with_threads(False, run) for t, run in list(variants.items())})  # 1 thread
            variants.update({(t, "avx2"): without_vnni(graphed(qlinear, x, ws[t])) for t in fmts})
            times = time_variants(variants, x, 1, args.repeats)
            t_f32, t_f32_1 = times[0] / len(ws[0]), times[(0, 1)] / len(ws[0])
            for t in fmts:
                fmt, sec, sec_1 = QUANT_FORMATS[t], times[t] / len(ws[t]), times[(t, 1)] / len(ws[t])
                nbytes = N * K // fmt.block_size * fmt.type_size
                row = {"weight": name, "n": N, "k": K, "m": M, "format": fmt.name, "ms": sec * 1e3,
                       "float32_ms": t_f32 * 1e3, "weights_gb_s": nbytes / sec / 1e9,
                       "gflop_s": 2 * M * N * K / sec / 1e9, "speedup_vs_float32": t_f32 / sec,
                       "ms_1_thread": sec_1 * 1e3, "float32_ms_1_thread": t_f32_1 * 1e3,
                       "avx2_ms": times[(t, "avx2")] / len(ws[t]) * 1e3, "vnni": vnni}
                rows.append(row)
                print(f"| {name} {N}x{K} | {M} | {fmt.name} | {fmt.bits_per_weight:.2f} | {row['ms']:.3f} | "
                      f"{row['float32_ms']:.3f} | {row['weights_gb_s']:.1f} | {row['gflop_s']:.1f} | "
                      f"{row['speedup_vs_float32']:.1f}x | {row['ms_1_thread']:.3f} | "
                      f"{row['float32_ms_1_thread']:.3f} | {row['avx2_ms']:.3f} |",
                      flush=True)
    return rows


if __name__ == "__main__":
    main()
