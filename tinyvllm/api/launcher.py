"""The app under uvicorn: `serve` for the command line, `BackgroundServer` inside this process.

    serve(app, engine, port=8000)               until SIGTERM or Ctrl-C, then drain (GracefulServer)
    with BackgroundServer(app) as server: ...   on a thread, on a free port: the tests, the tutorial, the benchmarks
"""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from tinyvllm.api import access_log
from tinyvllm.api.read_timeouts import read_timeout_protocol
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine


class BackgroundServer:
    """A real uvicorn server on a thread, on a free port of 127.0.0.1 by default."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0,
                 wait_until_ready: bool = True, header_read_timeout: float = 10.0, root_path: str = ""):
        access_log.install()
        app.root_path = root_path or app.root_path
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=5,
                                http=read_timeout_protocol(header_read_timeout))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host, self.timeout, self.wait_until_ready, self.url = host, timeout, wait_until_ready, ""

    def start(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        engine = getattr(self.server.config.app.state, "engine", None)
        while self.wait_until_ready and httpx.get(f"{self.url}/health").status_code != 200:
            if engine is not None and engine.load_error is not None:
                self.stop()
                raise RuntimeError(f"the engine failed to load: {engine.load_error}") from engine.load_error
            if time.monotonic() > deadline:
                raise RuntimeError(f"the model did not load within {self.timeout} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class GracefulServer(uvicorn.Server):
    """uvicorn with a graceful shutdown: on SIGTERM the socket closes, new requests get 503, those in flight get
    `shutdown_timeout` seconds and then end with an error their clients can read."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain(self.shutdown_timeout)  # thread- and signal-safe: the work is queued on the event loop
        super().handle_exit(sig, frame)


def serve(app: FastAPI, engine: AsyncLLMEngine, *, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 10.0, log_level: str = "info", header_read_timeout: float = 10.0,
          uds: str | None = None, root_path: str = "") -> None:
    """Run `app` (built around `engine`) until SIGTERM or Ctrl-C, then drain it (see `GracefulServer`)."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
    access_log.install()
    # FastAPI's root_path, as vLLM sets it: /llm/v1/... (a proxy that keeps the prefix) and /v1/... both route
    app.root_path = root_path or app.root_path
    config = uvicorn.Config(app, host=host, port=port, uds=uds, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 5,
                            http=read_timeout_protocol(header_read_timeout))
    server = GracefulServer(config, engine, shutdown_timeout)
    engine.on_load_error = lambda e: setattr(server, "should_exit", True)  # a supervisor sees the exit, as vLLM's
    server.run()
    if engine.load_error is not None:
        raise SystemExit(f"error: the engine failed to load: {engine.load_error}")
