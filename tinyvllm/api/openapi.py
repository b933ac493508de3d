"""`/openapi.json`: FastAPI's schema of the pydantic models, made true to what the server does."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tinyvllm.api.protocol import ErrorResponse
from tinyvllm.api.serving_chat import ROLES

# What each error status means here (docs/phases/09-appendix-endpoints.md has the table).
ERRORS = {400: "A bad field (`param` names it), or a prompt over the context", 401: "Missing or wrong API key",
          404: "A model this server does not serve", 413: "A body over --max-request-body-bytes",
          421: "A Host header not in --allowed-hosts", 429: "Over the key's limits, or the waiting queue is full",
          500: "A failed engine step (logged)", 503: "The model is loading, or the engine has stopped"}
RATE_LIMIT_HEADERS = {f"x-ratelimit-{what}-{kind}": {"description": f"{description} ({kind}, keys with limits)",
                                                     "schema": {"type": "string" if what == "reset" else "integer"}}
                      for kind in ("requests", "tokens")
                      for what, description in (("limit", "per minute"), ("remaining", "left now"),
                                                ("reset", "until the limit is whole again, e.g. 1.5s"))}


def responses(ok: type | dict, *statuses: int, stream: bool = False) -> dict:
    """One route's documented answers: the 200 (a model, or {media type: schema}; `stream`: SSE too) and errors."""
    documented: dict = {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}
    if isinstance(ok, dict):
        documented[200] = {"description": "OK", "content": {media: {"schema": schema} for media, schema in ok.items()}}
    else:
        documented[200] = {"description": "OK", "model": ok}
    if stream:  # one SSE event (OpenAPI 3.1): `data` is a JSON chunk, or [DONE]
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
        documented[200]["content"] = {"text/event-stream": {"schema": event}}
    if 429 in statuses:
        documented[200]["headers"] = RATE_LIMIT_HEADERS
        documented[429]["headers"] = {"Retry-After": {"description": "seconds until a retry can succeed",
                                                      "schema": {"type": "integer"}}, **RATE_LIMIT_HEADERS}
    return documented


# Two fields whose pydantic type is looser than what the serving code serves, described as served, so that a
# generated client or a fuzzer sends requests that can reach the engine (serving_chat checks messages' roles).
CHAT_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "minLength": 1, "examples": list(ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"}}}
TEXT = {"type": "string", "minLength": 1}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
SERVED_AS = {("ChatCompletionRequest", "messages"): {"type": "array", "items": CHAT_MESSAGE, "minItems": 1},
             ("CompletionRequest", "prompt"): {"anyOf": [TEXT, TOKEN_IDS, *(
                 {"type": "array", "items": one, "minItems": 1} for one in (TEXT, TOKEN_IDS))]}}


def openapi_schema(app: FastAPI, secured: bool, open_paths: tuple[str, ...] = ()) -> dict:
    """FastAPI's schema made true to this server; `secured`: every path but `open_paths` needs the bearer key."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for (model, field), served in SERVED_AS.items():
            properties = schema["components"]["schemas"][model]["properties"]
            properties[field] = {"title": properties[field].get("title", field), **served}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                for status, response in operation["responses"].items():
                    content = response.get("content", {})
                    if int(status) >= 400 and "application/json" not in content:  # /metrics: the 200 is text,
                        content["application/json"] = content.pop(next(iter(content)))  # its errors JSON
                if secured and path not in open_paths:
                    operation["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(unused, None)
        if secured:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema
