"""Helpers for the server tests: a live server around an engine, SSE and Prometheus parsing."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai

from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine


@contextmanager
def serve(engine_factory: Callable[[], object], *, max_waiting: int | None = None, api_key: str | None = None,
          served_model_names: list[str] | None = None, wait_until_ready: bool = True,
          **app_options) -> Iterator[BackgroundServer]:
    """A real uvicorn server on a free port of 127.0.0.1, stopped on leaving the block; `app_options`: more of
    `build_app`'s arguments (the server's flags)."""
    engine = AsyncLLMEngine(engine_factory, max_waiting=max_waiting)
    app = build_app(engine, served_model_names=served_model_names, api_key=api_key, **app_options)
    server = BackgroundServer(app, wait_until_ready=wait_until_ready, timeout=600)
    server.async_engine = engine  # for the tests that look inside
    with server:
        yield server


def client(server: BackgroundServer, api_key: str = "unused") -> openai.OpenAI:
    # no retries: a 429 or 503 must reach the test, not be retried away
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=120)


def async_client(server: BackgroundServer, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=300)


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def stream_json(server: BackgroundServer, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """POST with stream=true; returns the parsed JSON events and the raw payloads (with the final [DONE])."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = sse_events(response)
    return [json.loads(event) for event in raw if event != "[DONE]"], raw


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; comments dropped."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def metrics(server: BackgroundServer) -> dict[str, float]:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def histogram_count_above(samples: dict[str, float], name: str, bound: float) -> float:
    """How many observations of histogram `name` were above `bound` (which must be one of its buckets)."""
    total = samples[f"{name}_count"]
    at_most = next(v for k, v in samples.items() if re.fullmatch(rf'{re.escape(name)}_bucket\{{le="{bound}"\}}', k))
    return total - at_most


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
