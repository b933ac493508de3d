"""OpenAI's deprecated `functions` / `function_call` on /v1/chat/completions, served as tools.

    functions [{name, parameters}]   -> tools [{"type": "function", "function": {...}}]
    function_call "none" | "auto"    -> tool_choice "none" | "auto"
    function_call {"name": f}        -> tool_choice {"type": "function", "function": {"name": f}}
    message.tool_calls[0].function   -> message.function_call      (one call: the old API has no more)
    delta.tool_calls[0].function     -> delta.function_call
    finish_reason "tool_calls"       -> "function_call"
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tinyvllm.api.errors import bad_request
from tinyvllm.api.protocol import ChatCompletionRequest
from tinyvllm.api.serving_chat import OpenAIServingChat


def uses_functions(request: ChatCompletionRequest) -> bool:
    return request.functions is not None or request.function_call is not None


async def create_chat_completion(chat: OpenAIServingChat, request: ChatCompletionRequest,
                                 raw_request: Request) -> Response | dict:
    answer = await chat.create_chat_completion(as_tools(request), raw_request)
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(as_function_call_chunks(answer.body_iterator), media_type="text/event-stream")
    if isinstance(answer, Response):  # the client left
        return answer
    for choice in answer["choices"]:
        as_function_call(choice, choice["message"])
    return answer


def as_tools(request: ChatCompletionRequest) -> ChatCompletionRequest:
    if request.tools is not None or request.tool_choice is not None:
        raise bad_request("give functions (deprecated) or tools, not both", "functions")
    if not request.functions:
        raise bad_request("function_call needs functions: the functions the model may call", "function_call")
    choice = request.function_call
    tool_choice = choice if isinstance(choice, str) or choice is None else {"type": "function",
                                                                            "function": {"name": choice.name}}
    update = {"tools": [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in request.functions],
              "tool_choice": tool_choice, "parallel_tool_calls": False, "functions": None, "function_call": None}
    return ChatCompletionRequest.model_validate({**request.model_dump(exclude_none=True, by_alias=True), **update})


def as_function_call(choice: dict, message: dict) -> None:
    """One choice (a message, or a stream chunk's delta) in the old shape, in place."""
    calls = message.pop("tool_calls", None)
    if calls:
        function = calls[0]["function"]
        message["function_call"] = {key: function[key] for key in ("name", "arguments") if key in function}
    if choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "function_call"


async def as_function_call_chunks(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for raw in chunks:
            payload = raw.removeprefix("data: ").strip()
            if payload == "[DONE]" or not payload.startswith("{"):
                yield raw
                continue
            chunk = json.loads(payload)
            for choice in chunk.get("choices", []):
                as_function_call(choice, choice["delta"])
            yield f"data: {json.dumps(chunk)}\n\n"
    finally:  # the client left: closing the chat stream aborts its request
        await chunks.aclose()
