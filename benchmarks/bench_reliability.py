"""Reliability: how the server holds up under load, disconnects, faults, overload, bad input and a restart.

    python benchmarks/bench_reliability.py                  # all six, the real default model (minutes)
    python benchmarks/bench_reliability.py --only soak overload

    soak         64 concurrent streaming clients x 3 rounds (chat and completions, greedy and seeded, and in
                 each 8 one beam search of 4 beams and one seeded n=3: requests of several sequences arriving
                 beside a full batch): every stream ends with [DONE], and each output (every choice) equals the
                 same request sent alone; throughput and TTFT p50/p99 per round
    disconnect   32 streams, half dropped mid-stream at random points, plus non-streamed clients that time out:
                 the rest finish, and every KV block is free afterwards (read from /metrics)
    faults       a failed engine step, one request's failed detokenization, a KV pool run dry
                 (tinyvllm/engine/fault_injection.py): the requests hit end with a clear error, the others
                 finish, /health stays 200 and every block comes back
    overload     a burst of 4x --max-waiting: only 200s and 429s with Retry-After, no 5xx; then the same burst
                 from the openai client, which retries on 429, finishes every request
    fuzz         schemathesis against /openapi.json, a bounded number of cases: how many, how many 5xx
                 (the server around tests/fake_engine.py: the request path is what is fuzzed, not the model)
    restart      SIGTERM while streams run: each finishes or gets an error event within the grace period
                 (--shutdown-timeout), and a new server on the same port serves at once

Every figure lands in benchmarks/results/bench_reliability.json. tests/api/test_reliability.py runs the same
scenario functions, smaller, on the fake engine and a tiny random model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
from reliability_client import (blocks_all_free, free_port, metrics, percentile_ms, request_body, start_server,
                                stream, wait_until)  # the client side: benchmarks/reliability_client.py

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("soak", "disconnect", "faults", "overload", "fuzz", "restart")


# ---- the scenarios ----

def soak(url: str, model: str, clients: int = 64, rounds: int = 3, max_tokens: int = 16, wide: bool = True) -> dict:
    """`clients` concurrent streams per round, the same mixed requests each round, each compared with its
    output when sent alone (before the rounds, one at a time, on the same server). `wide`: beam searches and
    n=3 requests in the mix (see `request_body`; an engine without beam search, such as the tests' fake: False)."""

    async def run() -> dict:
        limits = httpx.Limits(max_connections=clients + 8)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            requests = [request_body(i, model, max_tokens, wide) for i in range(clients)]
            alone = [await stream(client, path, body) for path, body in requests]
            per_round, mismatches, incomplete = [], 0, 0
            sequences = sum(body.get("n", 1) for _, body in requests)
            for r in range(rounds):
                start = time.perf_counter()
                results = await asyncio.gather(*(stream(client, path, body) for path, body in requests))
                wall = time.perf_counter() - start
                done = sum(res["done"] and res["error"] is None for res in results)
                incomplete += len(results) - done
                mismatches += sum(res["text"] != ref["text"] for res, ref in zip(results, alone))
                ttfts = [res["ttft_s"] for res in results if res["ttft_s"] is not None]
                per_round.append({"round": r + 1, "requests": len(results), "completed_with_done": done,
                                  "wall_s": round(wall, 2),
                                  "tok_s": round(sequences * max_tokens / wall, 1),
                                  "ttft_p50_ms": percentile_ms(ttfts, 50), "ttft_p99_ms": percentile_ms(ttfts, 99)})
            return {"clients": clients, "sequences_per_round": sequences,
                    "beam_search_requests": sum(bool(body.get("use_beam_search")) for _, body in requests),
                    "n_gt_1_requests": sum(body.get("n", 1) > 1 and not body.get("use_beam_search")
                                           for _, body in requests),
                    "rounds": per_round, "requests": clients * rounds,
                    "incomplete": incomplete, "mismatches_vs_alone": mismatches,
                    "alone_finished": sum(ref["done"] and ref["error"] is None for ref in alone)}

    result = asyncio.run(run())
    result["kv_blocks_free_after_s"] = wait_until(lambda: blocks_all_free(url), 60)
    return result


def disconnect_storm(url: str, model: str, streams: int = 32, timeouts: int = 8, max_tokens: int = 64,
                     seed: int = 0) -> dict:
    """Half the streams dropped after a random number of chunks; `timeouts` non-streamed requests whose
    client gives up after a fraction of a second. Then: the kept streams finished, every block is free."""
    rng = random.Random(seed)

    async def run() -> tuple[list[dict], int]:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
            dropped = set(rng.sample(range(streams), streams // 2))
            tasks = [stream(client, "/v1/completions",
                            {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True},
                            drop_after=rng.randint(1, max_tokens // 2) if i in dropped else None)
                     for i in range(streams)]

            async def impatient(i: int) -> bool:
                try:
                    await client.post("/v1/completions", timeout=0.3, json={
                        "model": model, "prompt": f"Essay {i}:", "max_tokens": max_tokens * 4, "ignore_eos": True})
                except httpx.TimeoutException:
                    return True
                return False

            results = await asyncio.gather(*tasks, *(impatient(i) for i in range(timeouts)))
            return results[:streams], sum(results[streams:])

    results, timed_out = asyncio.run(run())
    kept = [r for r in results if not r["dropped"]]
    seconds = wait_until(lambda: blocks_all_free(url), 60)
    return {"streams": streams, "dropped": sum(r["dropped"] for r in results), "timed_out": timed_out,
            "kept": len(kept), "kept_finished": sum(r["done"] and r["finish_reason"] == "length" for r in kept),
            "kv_blocks_used_after": metrics(url)["tinyvllm:num_kv_blocks_used"], "seconds_to_free": seconds}


def faults(url: str, model: str, injector, max_tokens: int = 12, victim_tokens: int = 200, others: int = 8) -> dict:
    """The three faults of FaultInjector, one after the other, each with bystanders that must be served."""

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            requests = [request_body(i, model, max_tokens) for i in range(others)]
            alone = [await stream(client, path, body) for path, body in requests]
            assert all(ref["done"] and ref["error"] is None for ref in alone), "the requests alone must succeed"
            report = {}

            # 1. a failed step: every request in that step ends with an error event; the next ones are served
            victims = [asyncio.ensure_future(stream(client, "/v1/completions", {
                "model": model, "prompt": f"Count {i}:", "max_tokens": victim_tokens, "ignore_eos": True}))
                for i in range(4)]
            await asyncio.sleep(0.3)  # they are running
            injector.fail_next_step()
            hit = await asyncio.gather(*victims)
            after = await asyncio.gather(*(stream(client, path, body) for path, body in requests))
            report["step"] = {"hit": len(hit), "hit_with_clear_error": sum(
                r["done"] and r["error"] is not None and "InjectedFault" in r["error"]["message"] for r in hit),
                "others": len(after), "others_equal_alone": sum(
                    a["done"] and a["text"] == b["text"] for a, b in zip(after, alone))}

            # 2. one request's detokenization fails: it alone ends; the batch beside it goes on
            injector.fail_detokenization("[[poison]]")
            poisoned = stream(client, "/v1/completions", {"model": model, "prompt": "[[poison]] Hello",
                                                           "max_tokens": max_tokens, "temperature": 0})
            results = await asyncio.gather(poisoned, *(stream(client, path, body) for path, body in requests))
            report["detokenization"] = {
                "hit_with_clear_error": int(results[0]["done"] and results[0]["error"] is not None
                                            and "detokenizing" in results[0]["error"]["message"]),
                "others": len(requests), "others_equal_alone": sum(
                    a["done"] and a["text"] == b["text"] for a, b in zip(results[1:], alone))}

            # 3. the KV pool runs dry: requests that can never be admitted end with an error, not a hang
            injector.drain_kv_pool()
            dry = await asyncio.wait_for(asyncio.gather(*(stream(client, path, body) for path, body in requests[:4])),
                                         120)
            injector.restore_kv_pool()
            after = await asyncio.gather(*(stream(client, path, body) for path, body in requests))
            report["kv_pool_dry"] = {
                "hit": len(dry), "hit_with_clear_error": sum(
                    r["done"] and r["error"] is not None and "out of KV cache blocks" in r["error"]["message"]
                    for r in dry),
                "others": len(after), "others_equal_alone": sum(
                    a["done"] and a["text"] == b["text"] for a, b in zip(after, alone))}
            return report

    report = asyncio.run(run())
    report["healthy_after"] = httpx.get(f"{url}/health").status_code == 200
    report["kv_blocks_free_after_s"] = wait_until(lambda: blocks_all_free(url), 60)
    report["fired"] = dict(injector.fired)
    return report


def overload(url: str, model: str, queue_limit: int, max_tokens: int = 8) -> dict:
    """A burst of 4 x the waiting limit, raw (statuses counted), then through openai's retrying client."""
    import openai

    burst = 4 * queue_limit
    body = {"model": model, "prompt": "Overload:", "max_tokens": max_tokens, "ignore_eos": True}

    async def raw() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=burst)) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(burst)))

    async def retrying() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=50, timeout=600)
        kwargs = {"extra_body": {"ignore_eos": True}, **{k: v for k, v in body.items() if k != "ignore_eos"}}
        return await asyncio.gather(*(client.completions.create(**kwargs) for _ in range(burst)),
                                    return_exceptions=True)

    responses = asyncio.run(raw())
    statuses = Counter(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 429]
    start = time.perf_counter()
    completions = asyncio.run(retrying())
    return {"queue_limit": queue_limit, "burst": burst, "status_200": statuses[200], "status_429": statuses[429],
            "status_5xx": sum(n for s, n in statuses.items() if s >= 500),
            "other_statuses": sum(n for s, n in statuses.items() if s not in (200, 429) and s < 500),
            "retry_after_missing": sum("retry-after" not in r.headers for r in refused),
            "retried_finished": sum(not isinstance(c, BaseException) and c.choices[0].finish_reason == "length"
                                    for c in completions),
            "retried_wall_s": round(time.perf_counter() - start, 2)}


def fuzz(url: str, headers: dict, positive: int, negative: int, budget_s: float) -> dict:
    """schemathesis over every operation of /openapi.json: cases sent, answers by status, 5xx, failed checks."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    statuses: Counter = Counter()
    failures: list[str] = []
    start = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                if time.monotonic() - start > budget_s:
                    return
                response = case.call(base_url=url, headers=headers, timeout=60)
                statuses[response.status_code] += 1
                try:
                    case.validate_response(response, headers=headers, excluded_checks=[positive_data_acceptance])
                except (AssertionError, FailureGroup) as e:
                    failures.append(f"{operation.label} [{mode.value}] {response.status_code}: {str(e)[:300]}")

            try:
                run()
            except Unsatisfiable:  # a GET without parameters has no invalid form
                pass
    return {"operations": len(list(schema.get_all_operations())), "cases": sum(statuses.values()),
            "server_errors": sum(n for s, n in statuses.items() if s >= 500), "check_failures": len(failures),
            "statuses": {str(s): n for s, n in sorted(statuses.items())}, "first_failures": failures[:3],
            "seconds": round(time.monotonic() - start, 1)}


def restart(command: Callable[[int], list[str]], grace_s: float, streams: int = 8, short_tokens: int = 48,
            long_tokens: int = 2000) -> dict:
    """SIGTERM while `streams` stream (half short enough to finish within the grace period, half not); a new
    server is started on the same port right after the signal, while the old one drains."""
    port = free_port()
    old = start_server(command(port), port)
    url = f"http://127.0.0.1:{port}"

    async def poll_new_server(new: subprocess.Popen, signalled: float) -> tuple[float | None, float | None]:
        """Seconds after the signal until the port answers again (/health: 503 while the new server loads),
        and until the new server has served a completion. A new connection each time: never the old server's."""
        listening = None
        while time.perf_counter() - signalled < 600:
            if new.poll() is not None:
                raise RuntimeError(f"the new server exited: {new.stderr.read()[-2000:]}")
            try:
                async with httpx.AsyncClient(base_url=url, timeout=60) as fresh:
                    health = await fresh.get("/health")
                    listening = listening or time.perf_counter() - signalled
                    if health.status_code == 200 and (await fresh.post("/v1/completions", json={
                            "prompt": "Back:", "max_tokens": 2})).status_code == 200:
                        return listening, time.perf_counter() - signalled
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
        return listening, None

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            # the same batch once, short: the kernels for its shapes compile now, not during the grace period
            # (a step that is compiling cannot be interrupted; the drain acts between steps)
            await asyncio.gather(*(stream(client, "/v1/completions", {"prompt": f"Tale {i}:", "max_tokens": 4})
                                   for i in range(streams)))
            tasks = [asyncio.ensure_future(stream(client, "/v1/completions", {
                "prompt": f"Tale {i}:", "max_tokens": short_tokens if i % 2 else long_tokens,
                "temperature": 0, "ignore_eos": True})) for i in range(streams)]
            await asyncio.sleep(1.0)  # all running
            signalled = time.perf_counter()
            old.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:  # the old server takes no new connection now
                response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                refused = response.status_code == 503
            except httpx.TransportError:
                refused = True
            new = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            serving = asyncio.ensure_future(poll_new_server(new, signalled))  # meanwhile, the old one drains
            results = await asyncio.gather(*tasks, return_exceptions=True)
            drained = time.perf_counter() - signalled
            exit_code = await asyncio.to_thread(old.wait, grace_s + 30)
            exited = time.perf_counter() - signalled
            listening, first_200 = await serving
            new.send_signal(signal.SIGTERM)
            new.wait(60)
            ok = [r for r in results if not isinstance(r, BaseException)]
            return {"streams": streams, "grace_s": grace_s,
                    "finished": sum(r["done"] and r["error"] is None and r["finish_reason"] == "length" for r in ok),
                    "ended_with_error_event": sum(r["done"] and r["error"] is not None
                                                  and "shutting down" in r["error"]["message"] for r in ok),
                    "cut_without_done": streams - sum(r["done"] for r in ok),
                    "new_requests_refused_while_draining": refused,
                    "drain_s": round(drained, 2), "old_exit_s": round(exited, 2), "old_exit_code": exit_code,
                    "new_server_listening_s": None if listening is None else round(listening, 2),
                    "new_server_first_200_s": None if first_200 is None else round(first_200, 2)}

    try:
        return asyncio.run(run())
    finally:
        old.kill()


# ---- the run ----

@contextmanager
def in_process_server(engine_factory, max_waiting: int):
    sys.path.insert(0, str(ROOT))
    from tinyvllm.api.launcher import BackgroundServer
    from tinyvllm.api.server import build_app
    from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(engine_factory, max_waiting=max_waiting)
    with BackgroundServer(build_app(engine), timeout=600) as server:
        yield server


def main() -> None:
    from common import BenchParser, log, machine_description, write_results  # (benchmarks/common.py)

    p = BenchParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per soak request (default 16)")
    p.add_argument("--max-waiting", type=int, default=16, help="the overload scenario's queue limit (default 16)")
    p.add_argument("--fuzz-cases", type=int, default=200, help="schemathesis examples per operation and mode")
    p.add_argument("--grace", type=float, default=10.0, help="the restart scenario's --shutdown-timeout (default 10)")
    p.add_argument("--no-write", action="store_true", help="print, but do not write the results file")
    p.add_argument("--notes", default=None,
                   help="a sentence recorded with the figures (say, how loaded the machine was)")
    args = p.parse_args()
    log(f"bench_reliability on {machine_description()}")
    from tinyvllm.engine.fault_injection import FaultInjector
    from tinyvllm.engine.llm_engine import LLMEngine

    figures: dict = {} if args.notes is None else {"notes": args.notes}
    injectors = []

    def make_engine():  # the default model; 64 sequences at once so the soak's 64 clients run as one batch
        engine = LLMEngine(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512, kv_cache_memory="256MiB")
        injectors.append(FaultInjector(engine))  # armed only by the faults scenario
        return engine

    if set(args.only) & {"soak", "disconnect", "faults"}:
        with in_process_server(make_engine, max_waiting=256) as server:
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=600)
            if "soak" in args.only:
                log("soak ...")
                figures["soak"] = soak(server.url, model, args.clients, args.rounds, args.max_tokens)
            if "disconnect" in args.only:
                log("disconnect storm ...")
                figures["disconnect"] = disconnect_storm(server.url, model)
            if "faults" in args.only:
                log("faults ...")
                figures["faults"] = faults(server.url, model, injectors[0])
    if "overload" in args.only:
        log("overload ...")

        def small_engine():  # a small batch, so that a burst fills the waiting queue
            return LLMEngine(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="64MiB")

        with in_process_server(small_engine, max_waiting=args.max_waiting) as server:
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            figures["overload"] = overload(server.url, model, args.max_waiting)
    if "fuzz" in args.only:
        log("fuzz ...")
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_engine import FakeLLMEngine

        with in_process_server(lambda: FakeLLMEngine(max_model_len=256, num_blocks=512), max_waiting=64) as server:
            figures["fuzz"] = fuzz(server.url, {}, args.fuzz_cases, args.fuzz_cases // 2, budget_s=1200)
    if "restart" in args.only:
        log("restart ...")

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "tinyvllm.api.server", "--port", str(port), "--max-model-len", "4096",
                    "--kv-cache-memory", "256MiB", "--shutdown-timeout", str(args.grace), "--log-level", "warning"]

        figures["restart"] = restart(command, args.grace)
    print(json.dumps(figures, indent=2))
    if not args.no_write:
        write_results("bench_reliability", figures, args)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
