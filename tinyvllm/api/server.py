"""`python -m tinyvllm.api.server`: the OpenAI API over the continuous-batching engine.

    client --HTTP--> uvicorn --> FastAPI route --> OpenAIServing*   (event loop: parse, validate, tokenize)
                                                        |
                                      AsyncLLMEngine.generate() --queue--> engine loop thread: step() ...
                                                        |
    client <--SSE chunks / JSON-- StreamingResponse <---+  (one asyncio.Queue of outputs per request)

    python -m tinyvllm.api.server --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (serving_responses.py: the chat
route in the Responses API's shapes), POST /v1/embeddings (serving_embeddings.py),
GET /v1/models (+ /{model}), GET /health (503
until the model is loaded), GET|POST /ping (the same), GET /version, POST /tokenize and /detokenize
(serving_tokenize.py), GET /metrics (Prometheus text), GET /v1/engine/state (+ /stream, SSE) and the page
GET /dashboard that draws it (tinyvllm/api/dashboard.py). The server listens on 127.0.0.1 unless told
otherwise. On SIGTERM it drains: the port is released at once, new requests get 503, and the requests in
flight get --shutdown-timeout seconds to finish before they end with an error (`GracefulServer`).

Before any route sees a request, `RequestGuard` checks, in this order and without reading the body
until the last step:

    Host header      a DNS name not in --allowed-hosts -> 421   (localhost and IP addresses always pass)
    API key          with --api-key or --api-keys-file, every path but /health -> 401 + WWW-Authenticate: Bearer
    the key's RPM    on /v1/, a key over its requests (or in debt for its tokens) per minute -> 429 + Retry-After
    body size        over --max-request-body-bytes -> 413, from Content-Length or while reading
    lone surrogates  a JSON string holding one ("\ud800": no Unicode text) -> 400 naming the field
    body time        not all arrived within --body-read-timeout seconds -> 408 (headers: --header-read-timeout,
                     in the connection's protocol: tinyvllm/api/read_timeouts.py)

Outside it, `audit.RequestAccounting` keeps a record of each request (the key's id, status, tokens,
latency) for --audit-log and the per-key counters of /metrics; `keys.KeyedEngine` charges the key's
tokens per minute as the request is admitted to the engine and as its tokens are generated.
`RequestIdHeader` echoes a client's `X-Request-Id` on the response (the serving code uses it as the
request's id); with --allowed-origins, Starlette's CORSMiddleware answers browsers' cross-origin checks.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import ipaddress
import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyvllm.api import access_log, legacy_functions
from tinyvllm.api.audit import AuditLog, RequestAccounting, current_record
from tinyvllm.api.dashboard import DASHBOARD_PATHS, add_dashboard_routes
from tinyvllm.api.errors import (OpenAIError, bad_request, host_not_allowed, install_error_handlers,
                                 lone_surrogate_error, model_not_found, request_timeout, request_too_large,
                                 to_openai_error)
from tinyvllm.api.keys import ApiKey, ApiKeys, KeyedEngine
from tinyvllm.api.metrics import KeyMetrics, ServerMetrics
from tinyvllm.api.openapi import openapi_schema, responses
from tinyvllm.api.read_timeouts import read_timeout_protocol
from tinyvllm.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                   CompletionResponse, ModelCard, ModelList)
from tinyvllm.api.protocol_responses import ResponsesRequest, ResponsesResponse
from tinyvllm.api.serving_chat import OpenAIServingChat
from tinyvllm.api.serving_completions import OpenAIServingCompletion
from tinyvllm.api.serving_embeddings import EmbeddingRequest, EmbeddingResponse, OpenAIServingEmbedding
from tinyvllm.api.serving_engine import ServerLimits
from tinyvllm.api.serving_responses import OpenAIServingResponses
from tinyvllm.api.serving_tokenize import (DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenization,
                                           TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse)
from tinyvllm.engine.arg_utils import add_engine_args, engine_kwargs
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine, EngineNotReadyError
from tinyvllm.pooling_params import PoolingParams

OPEN_PATHS = ("/health", "/ping", *DASHBOARD_PATHS)  # answered without the API key: a load balancer's probe has none,
# and the dashboard page holds no data (its calls to /v1/engine/state carry the key)


def host_name(host_header: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 address, bracketed because of the port
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (more colons: an IPv6 address without a port)
        host = host.rpartition(":")[0]
    return host.rstrip(".")  # "localhost." is the same name, fully qualified


def is_allowed_host(name: str, allowed: frozenset[str]) -> bool:
    """DNS rebinding: a web page on attacker.example has its name re-resolved to 127.0.0.1, and the
    browser then sends the page's requests to this server, with `Host: attacker.example`. So a
    name must be one the operator gave; an IP address can't be rebound and always passes."""
    if "*" in allowed or name in allowed or name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class RequestGuard:
    """ASGI middleware: the Host, API key, rate and body size checks, before routing and before the
    body is parsed (FastAPI would answer malformed JSON before a route's own checks ran)."""

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
            key = self.identify(scope["path"], headers)
            if key is not None and key.has_limits:
                send = self.with_rate_limit_headers(key, send)  # on every answer, this 429 included
                if scope["path"].startswith("/v1/"):
                    self.keys.admit_request(key)
            body = await self.read_body(headers, receive)
            if body and (error := lone_surrogate_error(body)) is not None:
                raise error
        except OpenAIError as e:
            return await e.response()(scope, receive, send)
        if body is None:  # the client left while sending
            return

        replayed = False

        async def replay() -> Message:  # the body once, then the real channel (to see a disconnect)
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
        if record is not None:  # for the audit log and /metrics
            record.key_id = key.id
        return key

    def with_rate_limit_headers(self, key: ApiKey, send: Send) -> Send:
        """OpenAI's x-ratelimit-* headers, as they stand when the response starts (for a non-streamed
        answer, after its completion tokens were charged)."""

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(name.encode(), value.encode()) for name, value in self.keys.headers(key).items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return send_with_headers

    async def read_body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole body, refused (413) as soon as it is known to be too big: a declared Content-Length
        over the limit before a byte is read, a chunked one when the bytes read pass it; 408 when it has not
        all arrived `body_read_timeout` seconds after the headers (a slow client holding the connection)."""
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


class RequestIdHeader:
    """ASGI middleware: a request's `X-Request-Id` comes back on its response, errors included (vLLM's
    --enable-request-id-headers, always on here), so a client can match its logs with the server's."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = Headers(scope=scope).get("x-request-id") if scope["type"] == "http" else None
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
    """vLLM's CORS flags. No origin is allowed unless given: a server on localhost that answered every origin
    would let any web page a user opens read from it (vLLM's default is "*"; here it is a choice to make)."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None,
              api_key: str | None = None, api_keys: ApiKeys | None = None, audit_log: str | Path | None = None,
              limits: ServerLimits | None = None, allowed_hosts: list[str] | None = None,
              reasoning_parser: str | None = None, cors: CorsConfig | None = None,
              tool_call_parser: str = "hermes", pooler: PoolingParams | None = None) -> FastAPI:
    """The FastAPI app around `engine`, which it starts and stops with the server. `allowed_hosts`:
    the DNS names the server answers to besides localhost and IP addresses ("*": any). `api_key`: one
    key without limits; `api_keys`: several, with limits (not both: `ApiKeys.build` merges them).
    `audit_log`: a file to append one JSON line per request to. `reasoning_parser`: "think" sends what the
    model writes in <think>...</think> as `reasoning_content`. `tool_call_parser`: the format the model writes
    tool calls in, "hermes" or "llama3_json" (vLLM's --tool-call-parser; tinyvllm/api/tool_parser.py). `cors`: the
    origins browsers may call it from. `pooler`: how /v1/embeddings pools the hidden states (vLLM's --pooler-config)."""
    if api_key is not None and api_keys is not None:
        raise ValueError("give api_key or api_keys, not both (ApiKeys.build(api_key, keys_file) merges them)")
    keys = api_keys if api_key is None else ApiKeys.build(api_key)
    if engine.stat_logger is None:  # before the engine thread starts: nothing reads it yet
        engine.stat_logger = ServerMetrics()
    metrics: ServerMetrics = engine.stat_logger
    key_metrics = KeyMetrics() if keys is not None else None
    audit = AuditLog(audit_log) if audit_log is not None else None
    limits = limits or ServerLimits()
    keyed_engine = KeyedEngine(engine, keys)  # the serving code's view: each request charged to its key
    completions = OpenAIServingCompletion(keyed_engine, served_model_names, limits)
    chat = OpenAIServingChat(keyed_engine, served_model_names, limits, reasoning_parser=reasoning_parser,
                             tool_call_parser=tool_call_parser)
    tokenization = OpenAIServingTokenization(chat)
    responses_api = OpenAIServingResponses(chat)
    embeddings = OpenAIServingEmbedding(keyed_engine, served_model_names, limits, pooler=pooler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()  # the engine thread builds the engine meanwhile; /health says when it is done
        yield
        await engine.shutdown()
        if audit is not None:
            audit.close()

    app = FastAPI(title="tinyvllm", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, keys=keys, max_body_bytes=limits.max_request_body_bytes,
                       body_read_timeout=limits.body_read_timeout,
                       allowed_hosts=frozenset(host_name(h) if h != "*" else h for h in allowed_hosts or ()))
    if keys is not None or audit is not None:  # added after the guard: outside it, it sees the guard's refusals too
        app.add_middleware(RequestAccounting, audit_log=audit, key_metrics=key_metrics, skip_paths=OPEN_PATHS)
    app.add_middleware(RequestIdHeader)
    if cors is not None and cors.allowed_origins:  # the outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    app.openapi = lambda: openapi_schema(app, secured=keys is not None, open_paths=OPEN_PATHS)
    v1 = APIRouter(prefix="/v1")
    guarded = (401, 413, 421)  # what RequestGuard may answer on any path but /health

    @app.get("/health", responses=responses({"application/json": {"type": "object"}}, 413, 421, 503))
    async def health() -> JSONResponse:
        if engine.is_ready:
            return JSONResponse({})
        return to_openai_error(EngineNotReadyError("the model is not loaded (yet)")).response()

    # vLLM's (SageMaker's) name for the health check, GET or POST
    app.get("/ping", responses=responses({"application/json": {"type": "object"}}, 413, 421, 503),
            operation_id="ping_get")(health)
    app.post("/ping", responses=responses({"application/json": {"type": "object"}}, 413, 421, 503),
             operation_id="ping_post")(health)

    @app.get("/version", responses=responses({"application/json": {
        "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}, *guarded))
    async def version() -> dict:
        return {"version": importlib.metadata.version("tinyvllm")}

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, *guarded, 404, 503))
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest):
        try:
            return tokenization.tokenize(request).model_dump()
        except Exception as e:
            return to_openai_error(e).response()

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, *guarded, 404, 503))
    async def detokenize(request: DetokenizeRequest):
        try:
            return tokenization.detokenize(request).model_dump()
        except Exception as e:
            return to_openai_error(e).response()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=responses({"text/plain": {"type": "string"}}, *guarded))
    async def prometheus_metrics() -> PlainTextResponse:
        text = metrics.render(engine.num_waiting()) + (key_metrics.render() if key_metrics is not None else "")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @v1.get("/models", responses=responses(ModelList, *guarded, 429, 503))
    async def list_models() -> dict:
        try:
            engine.check_ready()
            names, max_model_len = completions.model_names(), engine.engine.max_model_len
        except Exception as e:
            return to_openai_error(e).response()
        return ModelList(data=[ModelCard(id=name, max_model_len=max_model_len) for name in names]).model_dump()

    @v1.get("/models/{model:path}", responses=responses(ModelCard, *guarded, 404, 429, 503))
    async def retrieve_model(model: str) -> dict:  # the openai client's models.retrieve (a name may hold "/")
        try:
            engine.check_ready()
            names = completions.model_names()
            if model not in names:
                raise model_not_found(model, names)
            return ModelCard(id=model, max_model_len=engine.engine.max_model_len).model_dump()
        except Exception as e:
            return to_openai_error(e).response()

    generation_errors = (400, *guarded, 404, 429, 500, 503)

    @v1.post("/completions", responses=responses(CompletionResponse, *generation_errors, stream=True))
    async def create_completion(request: CompletionRequest, raw_request: Request):
        try:
            return await completions.create_completion(request, raw_request)
        except Exception as e:  # OpenAIError as it is; engine errors mapped; anything else logged as a 500
            return to_openai_error(e).response()

    @v1.post("/chat/completions", responses=responses(ChatCompletionResponse, *generation_errors, stream=True))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        try:
            if legacy_functions.uses_functions(request):
                return await legacy_functions.create_chat_completion(chat, request, raw_request)
            return await chat.create_chat_completion(request, raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.post("/embeddings", responses=responses(EmbeddingResponse, *generation_errors))
    async def create_embedding(request: EmbeddingRequest, raw_request: Request):
        try:
            return await embeddings.create_embedding(request, raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.post("/responses", responses=responses(ResponsesResponse, *generation_errors, stream=True))
    async def create_response(request: ResponsesRequest, raw_request: Request):
        try:
            return await responses_api.create_response(request, raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    app.include_router(v1)
    add_dashboard_routes(app, engine, metrics, guarded)
    return app


class BackgroundServer:
    """A real uvicorn server on a thread of this process, on a free port of 127.0.0.1 by default:
    what the tests, the tutorial and the benchmark talk to. `with BackgroundServer(app) as server:`
    returns once `/health` says the model is loaded; leaving the block stops the server."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0,
                 wait_until_ready: bool = True, header_read_timeout: float = 10.0):
        access_log.install()
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
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
        port = self.server.servers[0].sockets[0].getsockname()[1]  # the port the OS picked for port=0
        self.url = f"http://{self.host}:{port}"
        while self.wait_until_ready and httpx.get(f"{self.url}/health").status_code != 200:
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
    """uvicorn with a graceful shutdown. On SIGTERM (or Ctrl-C) uvicorn closes the listening socket at once, so a
    new server can take the port, and waits for the open responses to end; the engine meanwhile refuses new
    requests (503) and gives those in flight `shutdown_timeout` seconds to finish, then ends the rest with an
    error their clients can read (an SSE error event, then [DONE]). uvicorn's own limit, a little later, is
    only a backstop: past it, it cancels whatever still runs, mid-stream."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain(self.shutdown_timeout)  # thread- and signal-safe: the work is queued on the event loop
        super().handle_exit(sig, frame)


def serve(app: FastAPI, engine: AsyncLLMEngine, *, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 10.0, log_level: str = "info", header_read_timeout: float = 10.0) -> None:
    """Run `app` (built around `engine`) until SIGTERM or Ctrl-C, then drain it (see `GracefulServer`).
    Its access log redacts secret-looking query parameters (access_log.py); a request whose headers take over
    `header_read_timeout` seconds to arrive gets 408 (read_timeouts.py)."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
    access_log.install()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + 5,
                            http=read_timeout_protocol(header_read_timeout))
    GracefulServer(config, engine, shutdown_timeout).run()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="tinyvllm: an OpenAI-compatible server")
    p.add_argument("--model", default=None, help="a .gguf file or an HF checkpoint directory (default: SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health "
                        "(default: $TINYVLLM_API_KEY, else none)")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="API keys with optional requests/tokens-per-minute limits, as JSON or JSON lines "
                        "(tinyvllm/api/keys.py has the format; `python -m tinyvllm.api.keys ID` makes a key). "
                        "With --api-key too, that key is one more, id 'default', without limits")
    p.add_argument("--audit-log", default=None, metavar="PATH",
                   help="append one JSON line per request (time, key id, route, status, tokens, latency) to PATH")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="host names (the Host header) to answer to, besides localhost, IP addresses and the "
                        "--host value; '*' for any. Others get 421: a guard against DNS rebinding (default: none)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins browsers may call this server from (CORS), e.g. https://app.example; '*' for any "
                        "(default: none: vLLM allows any, which lets any web page read a local server)")
    p.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD",
                   help="HTTP methods allowed cross-origin (default '*')")
    p.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
                   help="request headers allowed cross-origin (default '*')")
    p.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin requests carry cookies and Authorization (default off)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients ask for in 'model' (default: the model's own name)")
    add_engine_args(p)  # LLMEngine's flags, shared with `tinyvllm generate` (engine/arg_utils.py)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="more requests than this waiting get 429 with Retry-After (default 256)")
    defaults = ServerLimits()
    p.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                   help=f"larger request bodies get 413 (default {defaults.max_request_body_bytes} = 4 MiB)")
    p.add_argument("--header-read-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request whose headers have not all arrived this long after their first byte gets 408 "
                        "and its connection closes (default 10)")
    p.add_argument("--body-read-timeout", type=float, default=defaults.body_read_timeout, metavar="SECONDS",
                   help=f"a request body not all arrived this long after the headers gets 408 "
                        f"(default {defaults.body_read_timeout:g})")
    p.add_argument("--max-n", type=int, default=defaults.max_n,
                   help=f"most choices (n) one request may ask for (default {defaults.max_n})")
    p.add_argument("--max-stop-sequences", type=int, default=defaults.max_stop_sequences,
                   help=f"most stop strings per request (default {defaults.max_stop_sequences})")
    p.add_argument("--max-stop-length", type=int, default=defaults.max_stop_length,
                   help=f"longest stop string, in characters (default {defaults.max_stop_length})")
    p.add_argument("--reasoning-parser", default="none", choices=["none", "think"],
                   help="think: send the model's <think>...</think> as reasoning_content (default none)")
    p.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json"],
                   help="the format the model writes tool calls in: hermes (<tool_call> JSON </tool_call>: Qwen, "
                        "Hermes, SmolLM2 with the default tool prompt) or llama3_json (Llama 3.1+; default hermes)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how /v1/embeddings pools the final hidden states, vLLM\'s pooler config as JSON: '
                        '\'{"pooling_type": "MEAN"}\' (LAST or MEAN; default LAST) and "normalize" (default true)')
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, requests in flight get this long to finish before they end with an error; "
                        "new ones get 503 meanwhile (default 10)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:  # before the model loads: a typo in the keys file is said at once
        keys = ApiKeys.build(args.api_key, args.api_keys_file)
    except (OSError, ValueError) as e:
        parser.error(f"--api-keys-file: {e}")
    try:  # before the model loads, as vLLM does: a typo in the JSON is said at once
        engine_args = engine_kwargs(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        pooler = PoolingParams.from_json(args.pooler_config)
    except (TypeError, ValueError) as e:
        parser.error(f"--pooler-config: {e}")
    if args.device:
        os.environ["DEV"] = args.device.upper()  # tinygrad reads DEV when it first opens a device

    def make_engine():
        from tinyvllm.engine.llm_engine import LLMEngine  # here: --help stays instant, tinygrad starts on this thread

        return LLMEngine(args.model, **engine_args)

    limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes, body_read_timeout=args.body_read_timeout,
                          max_n=args.max_n,
                          max_stop_sequences=args.max_stop_sequences, max_stop_length=args.max_stop_length)
    engine = AsyncLLMEngine(make_engine, max_waiting=args.max_waiting, stat_logger=ServerMetrics())
    app = build_app(engine, served_model_names=args.served_model_name, api_keys=keys, audit_log=args.audit_log,
                    limits=limits, allowed_hosts=[*args.allowed_hosts, args.host],
                    reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                    cors=CorsConfig(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                    tuple(args.allowed_headers), args.allow_credentials),
                    pooler=pooler)
    serve(app, engine, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
          header_read_timeout=args.header_read_timeout)


if __name__ == "__main__":
    main()
