"""The client side of benchmarks/bench_reliability.py: the requests it sends, a stream read as a client reads it,
the server's /metrics, and a server in a process of its own (for the restart).

    request_body(i, model, max_tokens)   request i of a mixed load: chat or completions, greedy or seeded
    await stream(client, path, body)     one streamed request: its text, finish_reason, [DONE], error event, TTFT
    metrics(url), blocks_all_free(url)   /metrics as numbers; whether every KV block is free and nothing runs
    start_server(command, port)          a server process, once its /health says 200

tests/api/test_reliability.py reaches these through the benchmark's scenarios.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable

import httpx
import numpy as np


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else None


def request_body(i: int, model: str, max_tokens: int, wide: bool = False) -> tuple[str, dict]:
    """Request i of a mixed load: chat or completions, greedy or seeded sampling, in turn. `wide`: of every 8,
    request 4 is a beam search of 4 beams and request 6 a seeded n=3 (each several sequences in the batch)."""
    path = "/v1/chat/completions" if i % 2 else "/v1/completions"
    sampling = {"temperature": 0} if i % 4 < 2 else {"temperature": 0.8, "seed": 1000 + i}
    if wide and i % 8 == 4:
        sampling = {"temperature": 0, "use_beam_search": True, "n": 4}
    elif wide and i % 8 == 6:
        sampling = {**sampling, "n": 3}
    question = f"Question {i}: what is {i} plus {i + 1}? Answer:"
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    body.update({"messages": [{"role": "user", "content": question}]} if i % 2 else {"prompt": question})
    return path, body


async def stream(client: httpx.AsyncClient, path: str, body: dict, drop_after: int | None = None) -> dict:
    """POST with stream=true and read the events. `drop_after`: close the connection after that many chunks.
    Returns status, text (the choices' texts, in index order), finish_reason, done ([DONE] seen), error (an
    error event), ttft_s, chunks, dropped."""
    result = {"status": None, "text": "", "finish_reason": None, "done": False, "error": None, "ttft_s": None,
              "chunks": 0, "dropped": False}
    texts: dict[int, str] = {}  # choice index -> its text: with n > 1 the choices' chunks interleave
    start = time.perf_counter()
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            result["error"] = json.loads(await response.aread()).get("error")
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                result["error"] = event["error"]
                continue
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and result["ttft_s"] is None:
                    result["ttft_s"] = time.perf_counter() - start
                texts[choice.get("index", 0)] = texts.get(choice.get("index", 0), "") + piece
                result["text"] = "\x1e".join(texts[k] for k in sorted(texts))
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
            result["chunks"] += 1
            if drop_after is not None and result["chunks"] >= drop_after:
                result["dropped"] = True
                break
    return result


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", headers=headers, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `condition()` held, or None if it never did within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return round(time.monotonic() - start, 3)
        time.sleep(0.02)
    return None


def blocks_all_free(url: str) -> bool:
    m = metrics(url)
    return m["tinyvllm:num_kv_blocks_used"] == 0 and m["tinyvllm:num_requests_running"] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], port: int, timeout: float = 600, env: dict | None = None) -> subprocess.Popen:
    """A server process (`env`: its whole environment, default this process's); returns once its /health says 200."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server on port {port} did not become healthy within {timeout} s")
