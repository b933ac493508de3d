"""Paged attention on the hand-written kernel against the portable gather (Phase 5), alone and in the engine.

    .venv/bin/python benchmarks/bench_kernels.py                                   # everything, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_kernels.py --contexts 128,512 --batches 1,8 --no-e2e
    .venv/bin/python benchmarks/bench_kernels.py --json out.json

1. Attention per decode step. One layer's attention at the default model's shape (9 query heads, 3 KV heads,
   head_dim 64, block_size 16, float32): `attend` = reshape_and_cache of the new token, then paged attention
   over `context` tokens, for `batch` sequences, each one query. Each path runs under TinyJit (two warm-up
   calls: compile, capture), then the two paths take turns, `--repeats` times, and the best time of each
   counts (so load from other processes falls on both alike). A step of the model runs this 30 times (one
   per layer): "per step" is 30 x the layer's time. The sequences' blocks are scattered over the pool.
   Cases whose K/V would not fit `--max-cache-mib` per layer are left out and said so.
2. End-to-end decode. LLMEngine on the real model, greedy, `--output-len` tokens per request; two
   ModelRunners (kernel, `portable_attention=True`) on the same model and KV cache take turns as the
   engine's runner. A run's figure is the median time of its steps that only decode (tokens/s = batch / that
   time); after a first round that compiles and captures, the best of `--rounds` rounds counts.

Timings on shared cores move with the load average (printed): compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from common import BenchParser, add_peers_arg, load_average, no_peer_twin, write_results  # (benchmarks/common.py)
from tinygrad import Device, Tensor, TinyJit, UOp

from tinyvllm.attention.kernel_backend import KernelPagedAttentionMetadata, uses_kernels
from tinyvllm.attention.paged import PagedAttentionMetadata

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16  # SmolLM2-135M


def log(*args) -> None:
    print(*args, flush=True)


def attention_case(batch: int, context: int, seed: int = 0):
    """Caches holding `context` tokens for each of `batch` sequences, and one decode step's inputs."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [Tensor(rng.standard_normal(shape, dtype=np.float32)).realize() for _ in range(2)]
    tables = rng.permutation(batch * blocks_per_seq).astype(np.int32).reshape(batch, blocks_per_seq)
    positions = np.full((batch, 1), context, np.int32)  # the new token goes after `context` cached ones
    slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    inputs = [Tensor(rng.standard_normal((batch, 1, HEADS, HEAD_DIM), dtype=np.float32)).realize(),
              Tensor(rng.standard_normal((batch, 1, KV_HEADS, HEAD_DIM), dtype=np.float32)).realize(),
              Tensor(rng.standard_normal((batch, 1, KV_HEADS, HEAD_DIM), dtype=np.float32)).realize(),
              Tensor(slots.astype(np.int32)).realize(), Tensor(tables).realize(), Tensor(positions).realize()]
    return caches, inputs, blocks_per_seq


def make_step(caches: list[Tensor], kernel: bool):
    cls = KernelPagedAttentionMetadata if kernel else PagedAttentionMetadata

    def step(q, k, v, slots, tables, positions, num_blocks):
        metadata = cls(slots, tables, positions, num_blocks)
        return (metadata.attend(q, k, v, (caches[0], caches[1])) * 1).realize()
    return TinyJit(step)


def bench_attention(batch: int, context: int, repeats: int) -> dict:
    caches, inputs, blocks_per_seq = attention_case(batch, context)
    assert uses_kernels(inputs[0], caches[0]), "this device has no paged-attention kernel"
    v_num_blocks = UOp.variable("num_blocks", 1, blocks_per_seq).bind(blocks_per_seq)
    jits = {"kernel": make_step(caches, True), "portable": make_step(caches, False)}
    outs = {}
    for name, jit in jits.items():
        for _ in range(2):  # compile, capture
            outs[name] = jit(*inputs, v_num_blocks).numpy()
    err = float(np.abs(outs["kernel"] - outs["portable"]).max())
    best = {name: float("inf") for name in jits}
    for _ in range(repeats):
        for name, jit in jits.items():
            Device[caches[0].device].synchronize()
            t = time.perf_counter()
            jit(*inputs, v_num_blocks)
            Device[caches[0].device].synchronize()
            best[name] = min(best[name], time.perf_counter() - t)
    return {"batch": batch, "context": context, "kernel_ms": 1e3 * best["kernel"],
            "portable_ms": 1e3 * best["portable"], "max_abs_diff": err, "load": load_average()}


def run_attention(args) -> list[dict]:
    log("== attention per decode step: one layer (reshape_and_cache + paged attention), best of "
        f"{args.repeats}; per step = x{LAYERS} layers ==")
    log("batch  context  kernel ms  portable ms  kernel/step ms  portable/step ms  speed-up  max |diff|  load")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            cache_mib = 2 * batch * (context + BLOCK_SIZE) * KV_HEADS * HEAD_DIM * 4 / 2**20
            if cache_mib > args.max_cache_mib:
                log(f"{batch:5d}  {context:7d}  left out: {cache_mib:.0f} MiB of K/V per layer > --max-cache-mib")
                continue
            r = bench_attention(batch, context, args.repeats)
            rows.append(r)
            log(f"{batch:5d}  {context:7d}  {r['kernel_ms']:9.2f}  {r['portable_ms']:11.2f}  "
                f"{LAYERS * r['kernel_ms']:14.1f}  {LAYERS * r['portable_ms']:16.1f}  "
                f"{r['portable_ms'] / r['kernel_ms']:7.1f}x  {r['max_abs_diff']:10.1e}  {r['load']}")
    return rows


def engine_decode(engine, batch: int, prompt_len: int, output_len: int, tag: str) -> float:
    """Median seconds of the steps that only decode, for `batch` requests of `prompt_len` tokens."""
    from tinyvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [100 + (i * 7 + j) % 5000 for j in range(prompt_len)], params)
    decode_steps = []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        decodes_only = not sched.waiting and all(not s.is_prefill for s in sched.running)
        t = time.perf_counter()
        engine.step()
        if decodes_only:
            decode_steps.append(time.perf_counter() - t)
    return statistics.median(decode_steps)


def run_e2e(args) -> list[dict]:
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.worker.model_runner import ModelRunner

    max_len = max(p for _, p in args.e2e) + args.output_len + 1
    engine = LLMEngine(max_model_len=max_len, kv_cache_memory=f"{args.e2e_cache_mib}MiB")
    kernel = engine.model_runner
    # a second runner on the same model and KV cache: each keeps its own captured graphs, so the paths can alternate
    runners = {"kernel": kernel, "portable": ModelRunner(engine.model, engine.kv_cache, engine.max_model_len,
                                                         kernel.token_buckets[-1], kernel.max_num_seqs,
                                                         portable_attention=True)}
    log(f"\n== end-to-end decode: LLMEngine, {args.output_len} tokens per request, median decode step, "
        f"best of {args.rounds} rounds (the paths take turns) ==")
    log("batch  prompt  kernel ms  portable ms  kernel tok/s  portable tok/s  load")
    rows = []
    for batch, prompt_len in args.e2e:
        best = {name: float("inf") for name in runners}
        for round_ in range(args.rounds + 1):  # round 0 compiles and captures every graph it needs
            for name, runner in runners.items():
                engine.model_runner = runner
                step = engine_decode(engine, batch, prompt_len, args.output_len, f"{name}-{round_}")
                if round_ > 0:
                    best[name] = min(best[name], step)
        engine.model_runner = kernel
        row = {"batch": batch, "prompt_len": prompt_len, "kernel_step_ms": 1e3 * best["kernel"],
               "portable_step_ms": 1e3 * best["portable"], "kernel_tok_s": batch / best["kernel"],
               "portable_tok_s": batch / best["portable"], "load": load_average()}
        rows.append(row)
        log(f"{batch:5d}  {prompt_len:6d}  {row['kernel_step_ms']:9.1f}  {row['portable_step_ms']:11.1f}  "
            f"{row['kernel_tok_s']:12.1f}  {row['portable_tok_s']:14.1f}  {row['load']}")
    return rows


def main() -> None:
    parser = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--contexts", type=ints, default=[128, 512, 2048, 8192])
    parser.add_argument("--batches", type=ints, default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-cache-mib", type=float, default=1024, help="K+V of one layer, per case")
    parser.add_argument("--e2e", default="1x128,8x128,1x1024", help="batch x prompt tokens, comma separated")
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="end-to-end: timed rounds per path")
    parser.add_argument("--e2e-cache-mib", type=int, default=512)
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--json", help="also write the rows here")
    add_peers_arg(parser)
    args = parser.parse_args()
    args.e2e = [] if args.no_e2e else [tuple(int(x) for x in case.split("x")) for case in args.e2e.split(",")]
    log(f"device {Device.DEFAULT}   load average {load_average()}   python {sys.version.split()[0]}")
    result = {"attention": run_attention(args), "e2e": run_e2e(args) if args.e2e else []}
    no_peer_twin(args, "this times paged attention alone, a kernel llama.cpp does not expose; bench_generate and "
                 "bench_throughput --peers compare whole engines")
    write_results("bench_kernels", result, args, also=args.json)


if __name__ == "__main__":
    main()
