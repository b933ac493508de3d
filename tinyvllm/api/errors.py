"""Errors in vLLM's shape of OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: `code` is the HTTP
status, `type` vLLM's name for it ("BadRequestError" for a 400); `to_openai_error` is the one place that maps the
engine's exceptions onto them. The table of statuses is in docs/phases/09-appendix-endpoints.md, section 3.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tinyvllm.api.fields import FIELDS
from tinyvllm.api.protocol import ErrorInfo, ErrorResponse
from tinyvllm.engine.async_llm_engine import (EngineDeadError, EngineNotReadyError, EngineOverloadedError,
                                              EngineStepError)

logger = logging.getLogger("tinyvllm.api")


# vLLM's `create_error_response` names these statuses; any other takes its HTTP reason phrase ("Too Many Requests"),
# as vLLM's handler for Starlette's HTTPException writes it
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 501: "NotImplementedError"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or HTTPStatus(status).phrase


class OpenAIError(Exception):
    """An error answer: its status, the message, the request field at fault; `type` where it is not vLLM's name
    for the status (the rate limits' "requests" or "tokens", OpenAI's)."""

    def __init__(self, status: int, message: str, param: str | None = None, *, type: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or error_type(status)
        self.headers = dict(headers or {})
        if retry_after is not None:  # seconds
            self.headers["Retry-After"] = str(retry_after)

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def invalid_api_key() -> OpenAIError:
    # RFC 9110: a 401 names the scheme that would succeed
    return OpenAIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})


# a JSON escape of a UTF-16 surrogate: the only way a parsed string can hold a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate_error(body: bytes) -> OpenAIError | None:
    """A 400 naming the field if the JSON body holds a string with a lone surrogate (`"\ud800"`: valid JSON, not
    Unicode text, so a later 500); None otherwise."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None  # not JSON: FastAPI answers that itself
    path = _lone_surrogate_path(document)
    if path is None:
        return None  # a pair (a character outside the BMP), or an escaped backslash before "u"
    parts = [str(part).encode("utf-8", "backslashreplace").decode("utf-8") for part in path]
    field = ".".join(parts) or "body"
    return bad_request(f"{field}: the string holds a lone UTF-16 surrogate, which is not Unicode text; send UTF-8 "
                       "text (a character outside the Basic Multilingual Plane as a \\uD8xx\\uDCxx pair)",
                       parts[0] if parts else None)


def _lone_surrogate_path(value: object, path: tuple = ()) -> tuple | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate_path(key, path + (key,)) or _lone_surrogate_path(item, path + (key,))
        if found is not None:
            return found
    return None


def request_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(408, f"The request body did not all arrive within {seconds:g} s (--body-read-timeout)")


def request_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                       "(--max-request-body-bytes)")


def host_not_allowed(name: str) -> OpenAIError:
    # 421 Misdirected Request: the guard against DNS rebinding
    return OpenAIError(421, f"This server does not answer to the host name {name!r}: besides localhost and IP "
                       f"addresses it answers only to the names given with --allowed-hosts (e.g. --allowed-hosts "
                       f"{name}, or '*' for any)")


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist. This server serves: {', '.join(served)}",
                       "model")


def internal_error() -> OpenAIError:
    return OpenAIError(500, "The server had an error while processing the request; it was logged and the server "
                       "keeps serving")


def to_openai_error(e: BaseException) -> OpenAIError:
    """Map an exception from the engine or the serving code onto the status table above."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(429, str(e), retry_after=e.retry_after)
    if isinstance(e, (EngineNotReadyError, EngineDeadError)):
        return OpenAIError(503, str(e), retry_after=5)
    if isinstance(e, EngineStepError):
        logger.error("engine step error: %s", e)
        return OpenAIError(500, f"{e}; the server keeps serving")
    if isinstance(e, ValueError):  # the engine's word for bad caller input
        message = str(e)
        return bad_request(message, "prompt" if "context length" in message or "max_model_len" in message else None)
    logger.error("internal error", exc_info=e)
    return internal_error()


def validated(model, body: object):
    """`model` parsed from a body the route read itself (/invocations, the batch route), its errors reported as a
    body FastAPI parsed would have them."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in e.errors(include_url=False)], body=body) from e


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (bad JSON, wrong types, unknown routes) OpenAI-shaped too."""

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        # a refused field (tinyvllm/api/fields.py) says more than anything else wrong: even in a union's
        # errors (/tokenize), where it may not come first
        first = next((error for error in errors if error["type"] == "field_refused"), errors[0] if errors else {})
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return bad_request(f"the request body is not valid JSON: {detail}").response()
        if first.get("type") == "field_refused":
            return bad_request(first["msg"], first["ctx"]["field"]).response()
        # a union's member (/tokenize's) is named in the location too: the field is what the client wrote
        location = [str(part) for part in first.get("loc", ()) if part != "body" and part not in FIELDS]
        if first.get("type") == "extra_forbidden":  # in neither our model nor vLLM's nor OpenAI's
            return bad_request(f"{'.'.join(location)}: unknown field: this endpoint has no field of that name "
                               "(a typo?)", location[0] if location else None).response()
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return bad_request(message, location[0] if location else None).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        # vLLM's type for these is the reason phrase ("Method Not Allowed"); the exception's headers go too: a 405
        # must say which methods the path has (Allow, RFC 9110)
        return OpenAIError(e.status_code, str(e.detail), type=HTTPStatus(e.status_code).phrase,
                           headers=e.headers).response()
