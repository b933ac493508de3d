"""A live picture of the engine: `GET /dashboard` (three static files, public: they hold no data), fed by
`GET /v1/engine/state` and its SSE stream, the engine's state taken between two steps plus rates diffed from
/metrics' counters over RATE_WINDOW_S seconds. Taught in docs/phases/09-appendix-dashboard.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from tinyvllm.api.errors import OpenAIError, to_openai_error
from tinyvllm.api.metrics import ServerMetrics
from tinyvllm.api.openapi import responses

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_FILES = {"dashboard.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
DASHBOARD_PATHS = ("/dashboard", *(f"/dashboard/{name}" for name in PAGE_FILES))  # public: the page, not its data
RATE_WINDOW_S = 10.0
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 10.0


def histogram_quantile(q: float, buckets: tuple[float, ...], counts: list[float]) -> float | None:
    """The q-quantile of per-bucket counts (the last above every bound), interpolated in its bucket as Prometheus
    does; None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, count in enumerate(counts):
        if count > 0 and seen + count >= rank:
            if i == len(buckets):
                return buckets[-1]
            lower = buckets[i - 1] if i > 0 else 0.0
            return lower + (buckets[i] - lower) * (rank - seen) / count
        seen += count
    return buckets[-1]


class RateWindow:
    """Samples of the server's counters over the last RATE_WINDOW_S seconds, shared by every viewer."""

    def __init__(self, metrics: ServerMetrics | None, window_s: float = RATE_WINDOW_S):
        self.metrics, self.window_s = metrics, window_s
        self.samples: deque[tuple[float, dict]] = deque()

    def read(self) -> dict:
        m = self.metrics
        with m.lock:
            return {"prompt_tokens": m.prompt_tokens.values[""], "generation_tokens": m.generation_tokens.values[""],
                    "prefix_queries": m.prefix_queries.values[""], "prefix_hits": m.prefix_hits.values[""],
                    "ttft": list(m.ttft.counts), "itl": list(m.itl.counts)}

    def rates(self, extra_stats: dict) -> dict:
        """Rates over the window (the first call: no rates, percentiles over everything so far)."""
        if self.metrics is None:
            return {}
        now, current = time.monotonic(), self.read()
        self.samples.append((now, current))
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()  # one sample at least window_s old
        then, old = self.samples[0]
        dt = now - then
        if len(self.samples) == 1:
            old = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_queries": 0, "prefix_hits": 0,
                   "ttft": [0] * len(current["ttft"]), "itl": [0] * len(current["itl"])}
        queries = current["prefix_queries"] - old["prefix_queries"]
        rates = {"window_s": round(dt, 3),
                 "generation_tok_s": (current["generation_tokens"] - old["generation_tokens"]) / dt if dt else None,
                 "prompt_tok_s": (current["prompt_tokens"] - old["prompt_tokens"]) / dt if dt else None,
                 "prefix_cache_hit_rate": (current["prefix_hits"] - old["prefix_hits"]) / queries if queries else None,
                 "generation_tokens_total": current["generation_tokens"],
                 "prompt_tokens_total": current["prompt_tokens"]}
        for name, histogram in (("ttft", self.metrics.ttft), ("itl", self.metrics.itl)):
            gained = [c - o for c, o in zip(current[name], old[name])]
            for q in (0.5, 0.99):
                value = histogram_quantile(q, histogram.buckets, gained)
                rates[f"{name}_p{round(q * 100)}_ms"] = None if value is None else value * 1e3
        drafted = extra_stats.get("spec_decode_num_draft_tokens")
        if drafted:
            rates["spec_decode_acceptance_rate"] = extra_stats.get("spec_decode_num_accepted_tokens", 0) / drafted
        return rates


def add_dashboard_routes(app: FastAPI, engine, metrics: ServerMetrics | None, guarded: tuple[int, ...]) -> None:
    """GET /dashboard (+ its files), GET /v1/engine/state and GET /v1/engine/state/stream."""
    window = RateWindow(metrics)
    router = APIRouter()

    async def snapshot() -> dict:
        state = await engine.get_state(timeout=10.0)
        state["rates"] = window.rates(state.get("stats", {}))
        state["server"] = {"num_waiting_including_queued": engine.num_waiting(), "draining": engine.draining,
                           "time": time.time()}
        return state

    @router.get("/v1/engine/state", responses=responses({"application/json": {"type": "object"}}, *guarded, 503))
    async def engine_state() -> JSONResponse:
        """What the engine is doing now: its KV blocks, queues, last steps, rates, model and device."""
        try:
            return JSONResponse(await snapshot())
        except Exception as e:
            return to_openai_error(e).response()

    @router.get("/v1/engine/state/stream", include_in_schema=False)
    async def engine_state_stream(request: Request, interval: float = Query(0.25)) -> StreamingResponse:
        interval = min(max(interval, MIN_INTERVAL_S), MAX_INTERVAL_S)

        async def events():
            while not await request.is_disconnected():
                try:
                    yield f"data: {json.dumps(await snapshot())}\n\n"
                except Exception as e:  # said as an event, the stream goes on
                    yield f"data: {json.dumps(to_openai_error(e).body())}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return page_file("dashboard.html")

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_file(name: str):
        return page_file(name)

    app.include_router(router)


def page_file(name: str):
    if name not in PAGE_FILES:  # only the page's own files: no path from the URL reaches the disk
        return OpenAIError(404, f"the dashboard has no file {name!r}").response()
    return FileResponse(STATIC_DIR / name, media_type=PAGE_FILES[name], headers={"Cache-Control": "no-cache"})

