"""`python -m tinyvllm.api.server`: the OpenAI API over the continuous-batching engine.

Taught in docs/phases/09-api-server.md (the request path: section 2); the endpoints in 09-appendix-endpoints.md.
"""

from __future__ import annotations

import importlib.metadata
import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from tinyvllm.api import legacy_functions
from tinyvllm.api.audit import AuditLog, RequestAccounting
from tinyvllm.api.cli_args import build_parser
from tinyvllm.api.dashboard import add_dashboard_routes
from tinyvllm.api.errors import bad_request, install_error_handlers, model_not_found, to_openai_error, validated
from tinyvllm.api.keys import ApiKeys, KeyedEngine
from tinyvllm.api.launcher import serve
from tinyvllm.api.metrics import KeyMetrics, ServerMetrics
from tinyvllm.api.middleware import (OPEN_PATHS, CorsConfig, RequestGuard, RequestIdHeader, ServerLoad,
                                     host_name)
from tinyvllm.api.openapi import openapi_schema, responses
from tinyvllm.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                   CompletionResponse, ModelCard, ModelList)
from tinyvllm.api.protocol_responses import ResponsesRequest, ResponsesResponse
from tinyvllm.api.serving_chat import OpenAIServingChat
from tinyvllm.api.serving_completions import OpenAIServingCompletion
from tinyvllm.api.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from tinyvllm.api.serving_embeddings import (EmbeddingRequest, EmbeddingResponse, OpenAIServingEmbedding,
                                             PoolingResponse)
from tinyvllm.api.serving_engine import ServerLimits
from tinyvllm.api.serving_responses import OpenAIServingResponses
from tinyvllm.api.serving_tokenize import (DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenization,
                                           TokenizerInfoResponse, TokenizeRequest, TokenizeResponse)
from tinyvllm.engine.arg_utils import EngineArgs, dashed_flags
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine, EngineNotReadyError
from tinyvllm.plugins import provided
from tinyvllm.pooling_params import PoolingParams


def build_app(engine: AsyncLLMEngine, *, served_model_names: list[str] | None = None,
              api_key: str | None = None, api_keys: ApiKeys | None = None, audit_log: str | Path | None = None,
              limits: ServerLimits | None = None, allowed_hosts: list[str] | None = None,
              reasoning_parser: str | None = None, cors: CorsConfig | None = None,
              tool_call_parser: str = "hermes", pooler: PoolingParams | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              enable_prompt_tokens_details: bool = False, enable_force_include_usage: bool = False,
              media=None, enable_request_id_headers: bool = False,
              enable_tokenizer_info_endpoint: bool = False, enable_server_load_tracking: bool = False,
              enable_per_request_metrics: bool = False) -> FastAPI:
    """The FastAPI app around `engine`, which it starts and stops with the server; the arguments are the flags of
    `cli_args.build_parser`."""
    if api_key is not None and api_keys is not None:
        raise ValueError("give api_key or api_keys, not both (ApiKeys.build(api_key, keys_file) merges them)")
    keys = api_keys if api_key is None else ApiKeys.build(api_key)
    if engine.stat_logger is None:
        engine.stat_logger = ServerMetrics()
    metrics: ServerMetrics = engine.stat_logger
    key_metrics = KeyMetrics() if keys is not None else None
    audit = AuditLog(audit_log) if audit_log is not None else None
    limits = limits or ServerLimits()
    keyed_engine = KeyedEngine(engine, keys)
    usage_flags = {"enable_prompt_tokens_details": enable_prompt_tokens_details,
                   "enable_force_include_usage": enable_force_include_usage,
                   "enable_per_request_metrics": enable_per_request_metrics}
    completions = OpenAIServingCompletion(keyed_engine, served_model_names, limits, **usage_flags)
    if media is None and provided("media_connector") is not None:  # Phase 10: data URLs only, by default
        media = provided("media_connector")()
    chat = OpenAIServingChat(keyed_engine, served_model_names, limits, reasoning_parser=reasoning_parser,
                             tool_call_parser=tool_call_parser, media=media, **usage_flags)
    tokenization = OpenAIServingTokenization(chat)
    responses_api = OpenAIServingResponses(chat, ResponseStore(max_stored_responses))
    embeddings = OpenAIServingEmbedding(keyed_engine, served_model_names, limits, pooler=pooler, chat=chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()
        if audit is not None:
            audit.close()

    app = FastAPI(title="tinyvllm", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(RequestGuard, keys=keys, max_body_bytes=limits.max_request_body_bytes,
                       body_read_timeout=limits.body_read_timeout,
                       allowed_hosts=frozenset(host_name(h) if h != "*" else h for h in allowed_hosts or ()))
    if keys is not None or audit is not None:  # added after the guard: outside it, it sees the guard's refusals too
        app.add_middleware(RequestAccounting, audit_log=audit, key_metrics=key_metrics, skip_paths=OPEN_PATHS)
    app.add_middleware(RequestIdHeader, make_ids=enable_request_id_headers)
    app.state.server_load = 0  # GET /load: 0 unless tracked
    if enable_server_load_tracking:
        app.add_middleware(ServerLoad, state=app.state)
    if cors is not None and cors.allowed_origins:  # the outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    app.openapi = lambda: openapi_schema(app, secured=keys is not None, open_paths=OPEN_PATHS)
    v1 = APIRouter(prefix="/v1")
    guarded = (401, 413, 421)

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

    @app.get("/load", responses=responses({"application/json": {
        "type": "object", "required": ["server_load"], "properties": {"server_load": {"type": "integer"}}}}, *guarded))
    async def load() -> dict:  # vLLM's: requests in flight on the generating routes (--enable-server-load-tracking)
        return {"server_load": app.state.server_load}

    @app.get("/version", responses=responses({"application/json": {
        "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}, *guarded))
    async def version() -> dict:
        return {"version": importlib.metadata.version("tinyvllm")}

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, *guarded, 404, 503))
    async def tokenize(request: TokenizeRequest):
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

    if enable_tokenizer_info_endpoint:  # off by default, as vLLM's: it shows the chat template
        @app.get("/tokenizer_info", responses=responses(TokenizerInfoResponse, *guarded, 503))
        async def tokenizer_info():
            try:
                engine.check_ready()
                return tokenization.tokenizer_info().model_dump()
            except Exception as e:
                return to_openai_error(e).response()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=responses({"text/plain": {"type": "string"}}, *guarded))
    async def prometheus_metrics() -> PlainTextResponse:
        model_name = chat.model_names()[0] if engine.is_ready else ""  # vLLM's label: the first served name
        text = metrics.render(engine.num_waiting(), model_name)
        text += key_metrics.render() if key_metrics is not None else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @v1.get("/models", responses=responses(ModelList, *guarded, 429, 503))
    async def list_models() -> dict:
        try:
            engine.check_ready()
            names, max_model_len = completions.model_names(), engine.max_model_len
        except Exception as e:
            return to_openai_error(e).response()
        return ModelList(data=[ModelCard(id=name, root=engine.model_path or name, max_model_len=max_model_len)
                               for name in names]).model_dump()

    @v1.get("/models/{model:path}", responses=responses(ModelCard, *guarded, 404, 429, 503))
    async def retrieve_model(model: str) -> dict:  # the openai client's models.retrieve (a name may hold "/")
        try:
            engine.check_ready()
            names = completions.model_names()
            if model not in names:
                raise model_not_found(model, names)
            return ModelCard(id=model, root=engine.model_path or model, max_model_len=engine.max_model_len).model_dump()
        except Exception as e:
            return to_openai_error(e).response()

    generation_errors = (400, *guarded, 404, 429, 500, 503)

    async def json_body(raw_request: Request) -> object:
        """The body of a route that reads it itself (several request kinds), or the 400 FastAPI's parsing gives."""
        try:
            return await raw_request.json()
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    def with_load_report(result, raw_request: Request):
        """A whole answer with vLLM's ORCA load report when the request asks for one (endpoint-load-metrics-format)."""
        asked = raw_request.headers.get("endpoint-load-metrics-format", "")
        header = metrics.load_report(asked, engine.num_waiting()) if asked and isinstance(result, dict) else None
        return result if header is None else JSONResponse(result, headers=header)

    @v1.post("/completions", responses=responses(CompletionResponse, *generation_errors, stream=True))
    async def create_completion(request: CompletionRequest, raw_request: Request):
        try:
            return with_load_report(await completions.create_completion(request, raw_request), raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.post("/chat/completions", responses=responses(ChatCompletionResponse, *generation_errors, stream=True))
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        try:
            if legacy_functions.uses_functions(request):
                return await legacy_functions.create_chat_completion(chat, request, raw_request)
            return with_load_report(await chat.create_chat_completion(request, raw_request), raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.post("/chat/completions/batch", responses=responses(ChatCompletionResponse, *generation_errors))
    async def create_batch_chat_completion(raw_request: Request):
        try:
            return await chat.create_batch_chat_completion(await json_body(raw_request), raw_request)
        except RequestValidationError:
            raise
        except Exception as e:
            return to_openai_error(e).response()

    embedding_answers = responses(EmbeddingResponse, *generation_errors)  # and encoding_format "bytes": binary
    embedding_answers[200]["content"] = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}

    @v1.post("/embeddings", responses=embedding_answers)
    async def create_embedding(request: EmbeddingRequest, raw_request: Request):
        try:
            return await embeddings.create_embedding(request, raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @app.post("/pooling", responses=responses(PoolingResponse, *generation_errors))
    async def create_pooling(request: EmbeddingRequest, raw_request: Request):
        answer = await create_embedding(request, raw_request)
        return PoolingResponse.of(answer) if isinstance(answer, dict) else answer

    @app.post("/invocations", responses=responses(ChatCompletionResponse, *generation_errors, stream=True))
    async def invocations(raw_request: Request):
        """SageMaker's one route (vLLM's): the body's keys say which request it is."""
        body = await json_body(raw_request)
        kinds = [("messages", ChatCompletionRequest, create_chat_completion),
                 ("prompt", CompletionRequest, create_completion), ("input", EmbeddingRequest, create_embedding)]
        for key, model, route in kinds:
            if isinstance(body, dict) and key in body:
                return await route(validated(model, body), raw_request)
        return bad_request("/invocations takes a chat (messages), completion (prompt) or embeddings (input) request",
                           None).response()

    @v1.post("/responses", responses=responses(ResponsesResponse, *generation_errors, stream=True))
    async def create_response(request: ResponsesRequest, raw_request: Request):
        try:
            return await responses_api.create_response(request, raw_request)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.get("/responses/{response_id}", responses=responses(ResponsesResponse, 400, *guarded, 404))
    async def retrieve_response(response_id: str):
        try:
            return responses_api.retrieve(response_id)
        except Exception as e:
            return to_openai_error(e).response()

    @v1.post("/responses/{response_id}/cancel", responses=responses(ResponsesResponse, 400, *guarded, 404))
    async def cancel_response(response_id: str):
        try:
            return await responses_api.cancel(response_id)
        except Exception as e:
            return to_openai_error(e).response()

    app.include_router(v1)
    add_dashboard_routes(app, engine, metrics, guarded)
    return app


def media_connector(args):
    """Phase 10's MediaConnector from --allow-remote-media and --allowed-local-media-path."""
    connector = provided("media_connector")
    return None if connector is None else connector(args.allow_remote_media, args.allowed_local_media_path)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(dashed_flags(argv))
    try:  # before the model loads
        keys = ApiKeys.build(args.api_key, args.api_keys_file)
    except (OSError, ValueError) as e:
        parser.error(f"--api-keys-file: {e}")
    try:  # before the model loads, as vLLM does
        engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    except ValueError as e:
        parser.error(str(e))
    if args.max_stored_responses < 0:
        parser.error(f"--max-stored-responses must be >= 0 (0: keep none), got {args.max_stored_responses}")
    try:
        pooler = PoolingParams.from_json(args.pooler_config)
    except (TypeError, ValueError) as e:
        parser.error(f"--pooler-config: {e}")
    if args.device:
        os.environ["DEV"] = args.device.upper()

    def make_engine():
        from tinyvllm.engine.llm_engine import LLMEngine  # here: --help stays instant

        return LLMEngine(config=engine_config)

    limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes, body_read_timeout=args.body_read_timeout,
                          max_n=args.max_n,
                          max_stop_sequences=args.max_stop_sequences, max_stop_length=args.max_stop_length)
    engine = AsyncLLMEngine(make_engine, max_waiting=args.max_waiting, stat_logger=ServerMetrics())
    # a Unix socket has no host name to rebind (only this machine's processes reach it): any Host header, as
    # clients send the socket's name or their own placeholder
    allowed_hosts = ["*"] if args.uds else [*args.allowed_hosts, args.host]
    app = build_app(engine, served_model_names=args.served_model_name, api_keys=keys, audit_log=args.audit_log,
                    limits=limits, allowed_hosts=allowed_hosts,
                    reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    enable_force_include_usage=args.enable_force_include_usage,
                    cors=CorsConfig(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                    tuple(args.allowed_headers), args.allow_credentials),
                    pooler=pooler, max_stored_responses=args.max_stored_responses, media=media_connector(args),
                    enable_request_id_headers=args.enable_request_id_headers,
                    enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                    enable_server_load_tracking=args.enable_server_load_tracking,
                    enable_per_request_metrics=args.enable_per_request_metrics)
    serve(app, engine, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
          header_read_timeout=args.header_read_timeout, uds=args.uds, root_path=args.root_path)


if __name__ == "__main__":
    main()
