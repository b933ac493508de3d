"""`POST /v1/responses`: OpenAI's Responses API, translated into a chat request for `OpenAIServingChat` and back
into output items and events.

The translation is drawn in docs/phases/09-appendix-endpoints.md, section 5.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from tinyvllm.api.errors import OpenAIError, bad_request, to_openai_error
from tinyvllm.api.protocol import ChatCompletionRequest
from tinyvllm.api.protocol_responses import (FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage,
                                             OutputText, OutputTokensDetails, ReasoningItem, ReasoningText,
                                             ResponseError, ResponsesRequest, ResponsesResponse, ResponseUsage)
from tinyvllm.api.serving_chat import OpenAIServingChat

# the chat route's names for the fields a 400 may name, and theirs here
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text"}
TEXT_PARTS = ("input_text", "output_text", "text")
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "priority",
            "parallel_tool_calls", "user")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response | dict:
        if request.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: this server keeps no responses; send the "
                              "earlier items again in input", "previous_response_id")
        try:
            answer = await self.chat.create_chat_completion(self.chat_request(request), raw_request)
        except Exception as e:  # the chat route's 400 names its own field: say ours
            raise renamed(to_openai_error(e)) from e
        created = int(time.time())
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(self.events(answer.body_iterator, request, created),
                                     media_type="text/event-stream")
        if isinstance(answer, Response):  # the client left
            return answer
        return self.from_chat(answer, request, created).model_dump()

    # ---- request: items -> messages ----

    def chat_request(self, request: ResponsesRequest) -> ChatCompletionRequest:
        fields = {name: getattr(request, name) for name in SAMPLING if getattr(request, name) is not None}
        fields.update(model=request.model, messages=self.messages(request), stream=request.stream,
                      max_completion_tokens=request.max_output_tokens)
        if request.stream:
            fields["stream_options"] = {"include_usage": True}
        if request.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in request.tools]
        choice = request.tool_choice
        if choice is not None:
            fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                            "function": {"name": choice.name}}
        text_format = request.text.format if request.text is not None else None
        if text_format is not None and text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif text_format is not None and text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise bad_request('text.format of type "json_schema" needs "schema"', "text")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            raise bad_request(f"input: {e.errors()[0]['msg']}", "input") from e

    @staticmethod
    def messages(request: ResponsesRequest) -> list[dict]:
        """The conversation as chat messages: instructions first, then each input item."""
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        if isinstance(request.input, str):
            return [*messages, {"role": "user", "content": request.input}]
        for i, item in enumerate(request.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"), "content": item_text(item.get("content"), i)})
            elif kind == "function_call":
                call = {"id": string(item, "call_id", i), "type": "function",
                        "function": {"name": string(item, "name", i), "arguments": string(item, "arguments", i)}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": string(item, "call_id", i),
                                 "content": string(item, "output", i)})
            elif kind != "reasoning":
                raise bad_request(f"input[{i}].type must be message, function_call, function_call_output or "
                                  f"reasoning, got {kind!r}", "input")
        return messages

    # ---- response: message -> output items ----

    @staticmethod
    def head(request: ResponsesRequest, created: int, chat_id: str, model: str) -> dict:
        """The fields every response object of this request has, whatever its status."""
        return {"id": "resp_" + chat_id.removeprefix("chatcmpl-"), "created_at": created, "model": model,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "parallel_tool_calls": request.parallel_tool_calls is not False, "temperature": request.temperature,
                "top_p": request.top_p, "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
                "text": request.text, "metadata": request.metadata}

    def from_chat(self, answer: dict, request: ResponsesRequest, created: int) -> ResponsesResponse:
        choice = answer["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        output = []
        if message.get("reasoning"):
            output.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message["reasoning"])]))
        if message.get("content") or message.get("tool_calls") is None:
            output.append(OutputMessage(id=item_id("msg"), content=[OutputText(text=message.get("content") or "")],
                                        status="incomplete" if finish_reason == "length" else "completed"))
        for call in message.get("tool_calls") or []:
            output.append(FunctionCallItem(id=item_id("fc"), call_id=call["id"], name=call["function"]["name"],
                                           arguments=call["function"]["arguments"]))
        return ResponsesResponse(**self.head(request, created, answer["id"], answer["model"]), output=output,
                                 **outcome(finish_reason), usage=response_usage(answer["usage"]))

    async def events(self, chunks: AsyncIterator[str], request: ResponsesRequest,
                     created: int) -> AsyncIterator[str]:
        """The chat route's stream, chunk by chunk, as the Responses API's events."""
        numbers = itertools.count()
        stream = ItemStream()

        def event(kind: str, **fields) -> str:
            body = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        head = None
        try:
            async for raw in chunks:
                payload = raw.removeprefix("data: ").strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:  # after the 200: the chat route's error event
                    error = chunk["error"]
                    yield event("error", code=error.get("code") or error["type"], message=error["message"],
                                param=error.get("param"))
                    if head is not None:
                        failed = ResponsesResponse(**head, status="failed", output=stream.output, error=ResponseError(
                            code=error.get("code") or error["type"], message=error["message"]))
                        yield event("response.failed", response=failed.model_dump())
                    return
                if head is None:
                    head = self.head(request, created, chunk["id"], chunk["model"])
                    started = ResponsesResponse(**head, status="in_progress").model_dump()
                    yield event("response.created", response=started)
                    yield event("response.in_progress", response=started)
                if chunk.get("usage"):
                    stream.usage = chunk["usage"]
                for choice in chunk["choices"]:
                    for kind, fields in stream.feed(choice):
                        yield event(kind, **fields)
            for kind, fields in stream.close():
                yield event(kind, **fields)
            if head is not None:
                final = ResponsesResponse(**head, output=stream.output, **outcome(stream.finish_reason),
                                          usage=None if stream.usage is None else response_usage(stream.usage))
                yield event(f"response.{final.status}", response=final.model_dump())
        finally:  # closing the chat stream aborts its request
            await chunks.aclose()


class ItemStream:
    """The output items a streamed chat message becomes: at most one item is open; a delta of another kind closes
    it and opens the next."""

    def __init__(self):
        self.output: list = []
        self.open: ReasoningItem | OutputMessage | FunctionCallItem | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def feed(self, choice: dict) -> list[tuple[str, dict]]:
        events, delta = [], choice["delta"]
        if delta.get("reasoning"):
            events += self.text_delta(ReasoningItem, delta["reasoning"])
        if delta.get("content"):
            events += self.text_delta(OutputMessage, delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self.close()
                item = FunctionCallItem(id=item_id("fc"), call_id=call["id"], name=function.get("name", ""),
                                        arguments="", status="in_progress")
                events += self.start(item)
            if function.get("arguments") and isinstance(self.open, FunctionCallItem):
                self.open.arguments += function["arguments"]
                events.append(("response.function_call_arguments.delta", {**self.where(), "delta":
                                                                          function["arguments"]}))
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return events

    def where(self) -> dict:
        return {"item_id": self.open.id, "output_index": len(self.output) - 1}

    def start(self, item) -> list[tuple[str, dict]]:
        self.open = item
        self.output.append(item)
        events = [("response.output_item.added", {"output_index": len(self.output) - 1, "item": item.model_dump()})]
        if isinstance(item, OutputMessage):
            item.content.append(OutputText(text=""))
            events.append(("response.content_part.added", {**self.where(), "content_index": 0,
                                                           "part": item.content[0].model_dump()}))
        elif isinstance(item, ReasoningItem):
            item.content.append(ReasoningText(text=""))
        return events

    def text_delta(self, kind: type, text: str) -> list[tuple[str, dict]]:
        events = []
        if not isinstance(self.open, kind):
            events += self.close()
            events += self.start(kind(id=item_id("msg" if kind is OutputMessage else "rs")))
        self.open.content[0].text += text
        name = "response.output_text.delta" if kind is OutputMessage else "response.reasoning_text.delta"
        return events + [(name, {**self.where(), "content_index": 0, "delta": text})]

    def close(self) -> list[tuple[str, dict]]:
        """The open item's .done events (none open: nothing)."""
        item, events = self.open, []
        if item is None:
            return events
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            events += [("response.output_text.done", {**self.where(), "content_index": 0, "text": text}),
                       ("response.content_part.done", {**self.where(), "content_index": 0,
                                                       "part": item.content[0].model_dump()})]
        elif isinstance(item, ReasoningItem):
            events.append(("response.reasoning_text.done", {**self.where(), "content_index": 0,
                                                            "text": item.content[0].text}))
        else:
            events.append(("response.function_call_arguments.done", {**self.where(), "arguments": item.arguments}))
        if not isinstance(item, ReasoningItem):
            item.status = "completed"
        events.append(("response.output_item.done", {"output_index": len(self.output) - 1,
                                                     "item": item.model_dump()}))
        self.open = None
        return events


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_text(content: object, i: int) -> str:
    """A message item's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") in TEXT_PARTS
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise bad_request(f"input[{i}].content must be a string or a list of input_text parts "
                      '({"type": "input_text", "text": "..."}): only text is served', "input")


def string(item: dict, field: str, i: int) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{field} must be a string, got {value!r}", "input")
    return value


def outcome(finish_reason: str | None) -> dict:
    """The status a chat finish_reason gives a response: cut by max_output_tokens is "incomplete"."""
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": IncompleteDetails(reason="max_output_tokens")}
    return {"status": "completed"}


def response_usage(usage: dict) -> ResponseUsage:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return ResponseUsage(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"], input_tokens_details=InputTokensDetails(
                             cached_tokens=cached), output_tokens_details=OutputTokensDetails(
                             reasoning_tokens=reasoning))


def renamed(error: OpenAIError) -> OpenAIError:
    """A chat route's error, with the field it names as this API names it."""
    if error.param in PARAM_NAMES:
        error.message = error.message.replace(error.param, PARAM_NAMES[error.param])
        error.param = PARAM_NAMES[error.param]
    return error
