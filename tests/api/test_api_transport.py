"""What the server does below the API: slow clients are cut off, and no secret reaches the access log.

Read timeouts are tested with a raw socket against a real uvicorn on 127.0.0.1: part of the headers then
silence, part of a body then silence. Before, both connections stayed open for as long as the client liked.
"""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from fake_engine import FakeLLMEngine
from tinyvllm.api import access_log
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.api.serving_engine import ServerLimits
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(FakeLLMEngine)
    app = build_app(engine, limits=ServerLimits(body_read_timeout=1.0))
    with BackgroundServer(app, header_read_timeout=1.0, timeout=120) as server:
        yield server


def raw_exchange(server, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send `data` on a new connection, then nothing; returns what came back until the server closed the
    connection, and how long that took."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        start = time.monotonic()
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):  # b"": the server closed it (a socket timeout fails the test)
            received += chunk
        return received, time.monotonic() - start


def test_headers_that_never_end_get_408(server):
    received, elapsed = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    assert received.startswith(b"HTTP/1.1 408") and 0.9 < elapsed < 8


def test_a_body_that_never_ends_gets_408(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    received, elapsed = raw_exchange(server, head + b"Content-Length: 100\r\nConnection: close\r\n\r\n{\"prompt\":")
    assert received.startswith(b"HTTP/1.1 408") and b"--body-read-timeout" in received and 0.9 < elapsed < 8


def test_a_kept_alive_connection_still_serves_prompt_requests(server):
    with httpx.Client(base_url=server.url) as client:  # one connection, several requests, each well inside the limit
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(0.3)
        body = {"prompt": "hi", "max_tokens": 2, "model": "fake-smollm2"}
        assert client.post("/v1/completions", json=body).status_code == 200


def test_the_access_log_redacts_keys_in_the_query():
    assert access_log.redact_query("/dashboard?key=sk-secret") == "/dashboard?key=***"
    assert (access_log.redact_query("/v1/models?api_key=sk-a%20b&limit=2&access_token=t")
            == "/v1/models?api_key=***&limit=2&access_token=***")
    assert access_log.redact_query("/v1/models?limit=2") == "/v1/models?limit=2"
    access_log.install()
    logger = logging.getLogger("uvicorn.access")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:  # as uvicorn's h11 protocol logs a response
        logger.handle(logger.makeRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                                        ("127.0.0.1:5000", "GET", "/dashboard?key=sk-secret", "1.1", 200), None))
    finally:
        logger.removeHandler(handler)
    assert seen == ['127.0.0.1:5000 - "GET /dashboard?key=*** HTTP/1.1" 200']
