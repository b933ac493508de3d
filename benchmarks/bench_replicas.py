"""Engine replicas on Ray Serve (Phase 8): throughput of 2 replicas against 1, and the router's effect on TTFT.

  throughput   `--concurrency` streaming completions of distinct prompts through the ingress, total generated tok/s,
               with 1 replica and with 2 (on one machine the replicas share its cores: the ratio says what a second
               engine adds there, not what a second machine would)
  shared TTFT  groups of requests sharing a long prefix (a system prompt each): one request per group first, then
               the rest at once; the rest's mean time to first token with prefix-affinity routing against round robin

    python benchmarks/bench_replicas.py            -> benchmarks/results/bench_replicas.json   (needs tinyvllm[ray])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
from common import BenchParser, load_average, log, machine_description, table, write_results

PORT = 8766


async def one(client, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and "choices" in json.loads(line[6:]):
                first = first or time.perf_counter() - start
                tokens += 1
    return first or float("nan"), tokens


async def wave(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[tuple[float, int]]]:
    import httpx

    async with httpx.AsyncClient(timeout=1800) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[one(client, url, p, max_tokens) for p in prompts])
        return time.perf_counter() - start, results


def run_app(num_replicas: int, policy: str, server_args: list[str]) -> str:
    from ray import serve

    from tinyvllm.serve.ray import build_app

    serve.run(build_app(num_replicas, server_args, policy), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{PORT}"


def main() -> None:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix groups (default 4)")
    p.add_argument("--per-group", type=int, default=8, help="requests per group (default 8)")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    log(machine_description())
    import ray
    from ray import serve

    server_args = ["--served-model-name", "bench", "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024"]
    server_args += ["--model", args.model] if args.model else []
    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    rng = np.random.default_rng(0)
    words = "the of and to in is was for on that with as by at from it an be this which".split()
    distinct = [" ".join(rng.choice(words, 24)) + f" {i}" for i in range(args.concurrency)]
    systems = [f"System {g}: " + " ".join(rng.choice(words, 300)) for g in range(args.groups)]
    figures: dict = {"throughput": {}, "shared_prefix_ttft": {}}
    rows = []
    for replicas, policy in ((1, "prefix_affinity"), (2, "prefix_affinity"), (2, "round_robin")):
        log(f"{replicas} replica(s), {policy} (load average {load_average()})")
        url = run_app(replicas, policy, server_args)
        asyncio.run(wave(url, distinct[:8], 4))  # compile the small buckets
        if policy == "prefix_affinity":
            asyncio.run(wave(url, distinct, 4))  # and the large ones
            seconds, results = asyncio.run(wave(url, distinct, args.tokens))
            tok_s = sum(n for _, n in results) / seconds
            figures["throughput"][str(replicas)] = {"tok_s": round(tok_s, 1), "seconds": round(seconds, 2)}
            rows.append((f"{replicas} replica(s)", "throughput", round(tok_s, 1)))
        if replicas == 2:
            firsts = [s + " Question 0?" for s in systems]
            asyncio.run(wave(url, firsts, 1))  # each prefix computed once, somewhere
            rest = [s + f" Question {q}?" for q in range(1, args.per_group) for s in systems]
            _, results = asyncio.run(wave(url, rest, 1))
            ttft = float(np.mean([t for t, _ in results]))
            figures["shared_prefix_ttft"][policy] = {"mean_s": round(ttft, 3)}
            rows.append((f"2 replicas, {policy}", "shared-prefix TTFT s", round(ttft, 3)))
        serve.delete("bench")
    figures["throughput"]["ratio_2_to_1"] = round(figures["throughput"]["2"]["tok_s"] /
                                                  figures["throughput"]["1"]["tok_s"], 2)
    figures["shared_prefix_ttft"]["round_robin_to_affinity"] = round(
        figures["shared_prefix_ttft"]["round_robin"]["mean_s"] / figures["shared_prefix_ttft"]["prefix_affinity"]
        ["mean_s"], 2)
    print(table(rows, ("setup", "measure", "value")))
    write_results("bench_replicas", figures, args)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
