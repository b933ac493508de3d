"""The checks every request passes before any route sees it, as ASGI middleware: `RequestGuard` checks the Host
(421), the API key (401), the key's rate (429), then reads the body (413, 408, 400 for a lone surrogate).

Taught in docs/phases/09-appendix-limits-and-keys.md, which lists them in order.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import uuid
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.api.audit import current_record, route_path
from tinyvllm.api.dashboard import DASHBOARD_PATHS
from tinyvllm.api.errors import (OpenAIError, bad_request, host_not_allowed, lone_surrogate_error, request_timeout,
                                 request_too_large)
from tinyvllm.api.keys import ApiKey, ApiKeys

OPEN_PATHS = ("/health", "/ping", *DASHBOARD_PATHS)  # without the API key: a probe has none, the page holds no data


def host_name(host_header: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 address, bracketed because of the port
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (more colons: an IPv6 address without a port)
        host = host.rpartition(":")[0]
    return host.rstrip(".")  # "localhost." is the same name, fully qualified


def is_allowed_host(name: str, allowed: frozenset[str]) -> bool:
    """Against DNS rebinding: a name must be localhost or one the operator gave; an IP address can't be rebound."""
    if "*" in allowed or name in allowed or name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class RequestGuard:
    """The Host, API key, rate and body checks, before FastAPI parses the body (it would answer bad JSON first)."""

    def __init__(self, app: ASGIApp, *, keys: ApiKeys | None, allowed_hosts: frozenset[str], max_body_bytes: int,
                 body_read_timeout: float = 60.0):
        self.app, self.keys, self.allowed_hosts, self.max_body_bytes = app, keys, allowed_hosts, max_body_bytes
        self.body_read_timeout = body_read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        try:
            name = host_name(headers.get("host", ""))
            if name and not is_allowed_host(name, self.allowed_hosts):
                raise host_not_allowed(name)
            path = route_path(scope)
            key = self.identify(path, headers)
            if key is not None and key.has_limits:
                send = self.with_rate_limit_headers(key, send)
                if path.startswith("/v1/"):
                    self.keys.admit_request(key)
            body = await self.read_body(headers, receive)
            if body and (error := lone_surrogate_error(body)) is not None:
                raise error
        except OpenAIError as e:
            return await e.response()(scope, receive, send)
        if body is None:  # the client left while sending
            return

        replayed = False

        async def replay() -> Message:  # the body once, then the real channel
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def identify(self, path: str, headers: Headers) -> ApiKey | None:
        """The caller's key (401 without a valid one); None when no keys are configured, or on /health."""
        if self.keys is None or path in OPEN_PATHS:
            return None
        key = self.keys.identify(headers.get("authorization", ""))
        record = current_record.get()
        if record is not None:
            record.key_id = key.id
        return key

    def with_rate_limit_headers(self, key: ApiKey, send: Send) -> Send:
        """OpenAI's x-ratelimit-* headers, as they stand when the response starts."""

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(name.encode(), value.encode()) for name, value in self.keys.headers(key).items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return send_with_headers

    async def read_body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole body (None if the client left); 413 as soon as it is too big, 408 when it comes too slowly."""
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"Content-Length must be a byte count, got {declared!r}")
            if int(declared) > self.max_body_bytes:
                raise request_too_large(self.max_body_bytes)
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise request_timeout(self.body_read_timeout) from None
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise request_too_large(self.max_body_bytes)
            if not message.get("more_body", False):
                return b"".join(chunks)


class ServerLoad:
    """vLLM's --enable-server-load-tracking: how many requests of the generating and pooling routes are in flight
    (`state.server_load`, read by GET /load); a stream counts until its last byte is sent."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling", "/invocations")

    def __init__(self, app: ASGIApp, state):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(self.PATHS):
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class RequestIdHeader:
    """A request's `X-Request-Id` echoed on its response; with `make_ids` (vLLM's --enable-request-id-headers) one
    is made for a request that sent none."""

    def __init__(self, app: ASGIApp, make_ids: bool = False):
        self.app, self.make_ids = app, make_ids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = Headers(scope=scope).get("x-request-id") if scope["type"] == "http" else None
        if not request_id and self.make_ids and scope["type"] == "http":
            request_id = uuid.uuid4().hex
        if not request_id:
            return await self.app(scope, receive, send)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass(frozen=True)
class CorsConfig:
    """vLLM's CORS flags; no origin is allowed unless given (vLLM's default is "*": any web page could read a
    server on localhost)."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
