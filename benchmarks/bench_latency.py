"""Latency under load: requests arrive at random (a Poisson process) while LLMEngine.step() runs.

    .venv/bin/python benchmarks/bench_latency.py --rate 0.5 --num-requests 32
    .venv/bin/python benchmarks/bench_latency.py --rate 0.25,0.5,1 --output-len 32 --json out.json

One thread drives the engine, as a server's engine loop does: before each step it adds every request
whose arrival time has passed; when nothing is running it sleeps until the next arrival. The gaps
between arrivals are exponential with mean 1/rate (a Poisson process, the usual model of independent
users), drawn from a seeded generator so runs compare. Each request is greedy, ignores eos and asks
for exactly `--output-len` tokens. Reported, as p50 / p90 / p99 over requests (or over token gaps):

    TTFT   first token - the request's arrival time (not the moment the loop noticed it: a request that
           arrives mid-step waits for that step, as it would in a server)
    TPOT   (last token - first token) / (output_len - 1), per request
    ITL    every gap between two consecutive tokens of a request: one step of the batch it sits in
    E2E    last token - arrival

If the rate asks for more tokens per second than the engine can produce, the queue grows for as long as
requests keep coming and TTFT grows with it; the achieved throughput then says where the knee is.
Every token bucket is compiled and captured before the clock starts (see bench_throughput.warm_up).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import make_prompts, warm_up  # noqa: E402
from common import (  # noqa: E402
    BenchParser,
    add_engine_args,
    add_peers_arg,
    code_version,
    load_average,
    log,
    machine_description,
    no_peer_twin,
    write_results,
)

from tinyvllm.engine.llm_engine import LLMEngine  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402


def percentiles(values: list[float]) -> dict[str, float]:
    p50, p90, p99 = np.percentile(np.array(values) * 1e3, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def run_poisson(engine: LLMEngine, prompts: list[list[int]], rate: float, output_len: int, seed: int) -> dict:
    """Drive the engine with Poisson arrivals; per-request token times come from the loop's own clock."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(prompts)))  # seconds after the start
    arrivals -= arrivals[0]  # the first request arrives at 0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    token_times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    batch_sizes: list[int] = []
    load_before = load_average()
    start = time.monotonic()
    next_request, done = 0, 0
    while done < len(prompts):
        now = time.monotonic() - start
        while next_request < len(prompts) and arrivals[next_request] <= now:
            engine.add_request(str(next_request), prompts[next_request], params)
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - (time.monotonic() - start)))
            continue
        outputs = engine.step()
        now = time.monotonic() - start
        batch_sizes.append(len(engine.scheduler.running) + sum(o.finished for o in outputs))
        for out in outputs:
            times = token_times[int(out.request_id)]
            times.extend([now] * (len(out.outputs[0].token_ids) - len(times)))
            done += out.finished
    wall = time.monotonic() - start
    ttft = [token_times[i][0] - arrivals[i] for i in token_times]
    tpot = [(t[-1] - t[0]) / max(1, output_len - 1) for t in token_times.values()]
    itl = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    e2e = [token_times[i][-1] - arrivals[i] for i in token_times]
    return {"rate": rate, "requests": len(prompts), "wall_s": wall, "arrival_span_s": float(arrivals[-1]),
            "tok_s": len(prompts) * output_len / wall, "mean_batch": float(np.mean(batch_sizes)),
            "max_batch": int(max(batch_sizes)), "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles(itl), "e2e_ms": percentiles(e2e), "load_average": [load_before, load_average()]}


def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="0.5", help="requests per second (comma-separated: one run each)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--max-num-seqs", type=int, default=32)
    add_engine_args(p, max_num_batched_tokens=128, kv_cache_memory="512MiB", max_model_len=1024)
    add_peers_arg(p)
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rate.split(",")]

    engine = LLMEngine(args.model, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    # the runner's own switch (ModelRunner(portable_attention=...)); read when a bucket's graph is first built
    engine.model_runner.portable_attention = args.portable_attention
    warm_up(engine, log=log)
    jits_before = {n: jit.cnt for n, jit in engine.model_runner._jits.items()}
    results = []
    for k, rate in enumerate(rates):
        # prompts of their own per rate: with prefix caching on, a prompt seen at an earlier rate would skip its prefill
        prompts = make_prompts(engine, args.num_requests, args.prompt_len, first=k * args.num_requests)
        results.append(run_poisson(engine, prompts, rate, args.output_len, args.seed))
        log(f"rate {rate}: done in {results[-1]['wall_s']:.1f} s")
    fresh = [n for n, jit in engine.model_runner._jits.items() if jits_before.get(n, 0) < 2]
    assert not fresh, f"buckets {fresh} were compiled during the measurement"

    print(f"bench_latency: {engine.model_name}, float32, {machine_description(False)}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"code: {code_version()}; attention: {'portable gather' if args.portable_attention else 'kernels'}")
    print(f"{args.num_requests} requests per rate, Poisson arrivals (seed {args.seed}), prompt {args.prompt_len} "
          f"tokens, output {args.output_len} tokens, greedy, ignore_eos; max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}")
    for r in results:
        print(f"\nrate {r['rate']} req/s: arrivals over {r['arrival_span_s']:.1f} s, all done in {r['wall_s']:.1f} s, "
              f"{r['tok_s']:.1f} output tok/s, batch mean {r['mean_batch']:.1f} max {r['max_batch']}, "
              f"load average {r['load_average'][0]} -> {r['load_average'][1]}")
        for name in ("ttft", "tpot", "itl", "e2e"):
            q = r[f"{name}_ms"]
            print(f"  {name.upper():5s} p50 {q['p50']:9.1f} ms   p90 {q['p90']:9.1f} ms   p99 {q['p99']:9.1f} ms")
    no_peer_twin(args, "llama.cpp has no driver of one engine under Poisson arrivals (bench_throughput --peers "
                 "compares the engines batch for batch)")
    write_results("bench_latency", {"model": engine.model_name, "portable_attention": args.portable_attention,
                                    "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": results},
                  args, also=args.json)


if __name__ == "__main__":
    main()
