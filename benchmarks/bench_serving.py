"""Serving benchmark: N concurrent streaming clients send a fixed number of requests to the OpenAI server.

    python -m tinyvllm.api.server --port 8000 &
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 32 --num-requests 128

    python benchmarks/bench_serving.py --launch -- --max-num-seqs 32     (starts and stops its own server)

Each client streams `/v1/completions` (greedy, then each other chain of `--sampling`, default llama.cpp's
default chain: benchmarks/sampling_chains.py; `ignore_eos`, so every request produces exactly `--max-tokens`
tokens) and takes the next request as soon as one finishes, until `--num-requests` are
done. Each run follows `--warmup` unmeasured requests of the same load: the JIT compiles each new
batch shape once, and a compile would otherwise show up as a latency spike of seconds. Reported:

    throughput   requests/s and output tokens/s over the whole run (what the batch buys)
    TTFT         time to first token: queueing + prefill, as a user waits for the first word
    ITL          inter-token latency: the gap between streamed chunks, one decode step of the batch
    E2E          request latency from send to [DONE]

A chunk can carry more than one token when the client falls behind (outputs are merged), so ITL is
measured per chunk and the token count comes from the final usage chunk. Only local servers are
accepted: this is a load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np
from common import BenchParser, add_peers_arg, find_peers, write_results  # (benchmarks/common.py)
from sampling_chains import CHAINS, add_sampling_arg, llama_server_fields  # (benchmarks/sampling_chains.py)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class RequestResult:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def one_request(http: httpx.AsyncClient, prompt: str, max_tokens: int,
                      sampling: dict | None = None) -> RequestResult:
    """sampling: the request's sampling fields (default greedy: temperature 0)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **(sampling or {}), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result, start, last = RequestResult(), time.perf_counter(), None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event, now = json.loads(line[len("data: "):]), time.perf_counter()
            if "error" in event:
                result.error = event["error"]["message"]
            elif event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    result.e2e = time.perf_counter() - start
    return result


async def run_benchmark(base_url: str, *, concurrency: int, num_requests: int, max_tokens: int,
                        prompt_words: int = 24, tag: str = "Request",
                        sampling: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send `num_requests` requests from `concurrency` clients; returns the results and the wall time.
    Prompts start with `tag` and their number: give a warm-up a tag of its own, or prefix caching (tinyvllm's,
    llama-server's cache_prompt) would serve the measured prompts' prefill from the warm-up's."""
    prompts = [f"{tag} {i}: " + " ".join(["tell me more about paged attention"] * (prompt_words // 5 + 1))
               for i in range(num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                results.append(await one_request(http, prompt, max_tokens, sampling))
            except httpx.HTTPError as e:  # counted, not fatal: the other clients go on
                results.append(RequestResult(error=f"{type(e).__name__}: {e}"))

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.array(values) * 1000, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def report(results: list[RequestResult], wall: float, concurrency: int) -> dict:
    """Print one run's figures; return them for the results file."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    figures = {"requests": len(results), "ok": len(ok), "wall_s": wall, "req_s": len(ok) / wall,
               "tok_s": tokens / wall, "ttft_ms": percentiles([r.ttft for r in ok]),
               "itl_ms": percentiles([gap for r in ok for gap in r.itl]), "e2e_ms": percentiles([r.e2e for r in ok])}
    print(f"concurrency {concurrency}: {len(ok)}/{len(results)} requests ok in {wall:.1f} s")
    print(f"  throughput  {figures['req_s']:8.2f} req/s   {figures['tok_s']:8.1f} output tok/s")
    for name in ("ttft", "itl", "e2e"):
        q = figures[f"{name}_ms"]
        text = "n/a" if q is None else f"p50 {q['p50']:8.1f} ms   p90 {q['p90']:8.1f} ms   p99 {q['p99']:8.1f} ms"
        print(f"  {name.upper():11s} {text}")
    for r in results[:3]:
        if r.error is not None:
            print(f"  error: {r.error}")
    return figures


def launch_server(server_args: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:  # a free port, released just before the server takes it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tinyvllm.api.server", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *server_args]
    process, url = subprocess.Popen(cmd), f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit(f"the server did not become healthy within {timeout} s")


def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true",
                   help="start a server (its arguments after --) and stop it at the end")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                   help="clients at once (several values: one run each)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-words", type=int, default=24, help="rough prompt length in words")
    p.add_argument("--warmup", type=int, default=None,
                   help="unmeasured requests before each run, to compile (default: the concurrency)")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    add_peers_arg(p)
    add_sampling_arg(p, default="greedy,llama")
    args, server_args = p.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]

    process = None
    if args.launch:
        process, args.base_url = launch_server(server_args, args.launch_timeout)
    if urlparse(args.base_url).hostname not in LOCAL_HOSTS:
        raise SystemExit(f"refusing to load {args.base_url}: only a server on this machine is benchmarked")
    llama = find_peers(args)
    runs = {}
    try:
        for concurrency in args.concurrency:
            runs[str(concurrency)] = run_chains(args.base_url, concurrency, args, CHAINS)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    figures = {"server_args": server_args, "concurrency": runs}
    if llama is not None:  # llama-server under the same client, one slot per client, the shipped Q4_1 weights
        peers = {}
        for concurrency in args.concurrency:
            context = concurrency * -(-(4 * args.prompt_words + args.max_tokens + 64) // 256) * 256
            with llama.server("Q4_1", context=context, parallel=concurrency) as url:
                print("llama-server:", end=" ")
                peers[str(concurrency)] = run_chains(url, concurrency, args, {c: llama_server_fields(c)
                                                                              for c in CHAINS})
            peers[str(concurrency)]["tinyvllm_tok_s_ratio"] = (runs[str(concurrency)]["tok_s"]
                                                               / peers[str(concurrency)]["tok_s"])
            print(f"  tinyvllm / llama-server output tok/s: {peers[str(concurrency)]['tinyvllm_tok_s_ratio']:.2f}x")
        figures["peers"] = {"llama_server_q4_1": peers}
    write_results("bench_serving", figures, args)


def run_chains(base_url: str, concurrency: int, args, fields: dict[str, dict]) -> dict:
    """One concurrency level, greedy (its figures at the top, as before) and then each other chain of --sampling
    ("sampling": {chain: figures, with tok_s_ratio_to_greedy}). fields: each chain's request fields."""
    figures = run_level(base_url, concurrency, args)
    figures["sampling"] = {}
    for i, chain in enumerate(c for c in args.sampling if c != "greedy"):
        r = run_level(base_url, concurrency, args, fields[chain], tag=f"Sampled {i}")
        r["tok_s_ratio_to_greedy"] = r["tok_s"] / figures["tok_s"]
        figures["sampling"][chain] = r
        print(f"  {chain}: {r['tok_s_ratio_to_greedy']:.2f}x greedy's output tok/s")
    return figures


def run_level(base_url: str, concurrency: int, args, sampling: dict | None = None, tag: str = "Request") -> dict:
    """One concurrency level: the same load first, unmeasured (each new batch shape compiles once, and should not be
    timed), then the measured run."""
    warmup = concurrency if args.warmup is None else args.warmup
    if warmup:
        asyncio.run(run_benchmark(base_url, concurrency=concurrency, num_requests=warmup, max_tokens=args.max_tokens,
                                  prompt_words=args.prompt_words, tag=f"Warm-up {tag}", sampling=sampling))
    results, wall = asyncio.run(run_benchmark(base_url, concurrency=concurrency, num_requests=args.num_requests,
                                              max_tokens=args.max_tokens, prompt_words=args.prompt_words, tag=tag,
                                              sampling=sampling))
    return report(results, wall, concurrency)


if __name__ == "__main__":
    main()
