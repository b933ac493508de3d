"""`POST /v1/responses`, OpenAI's Responses API, as a chat request for `OpenAIServingChat` and back into output
items and events (one generator, `event_items`, for streamed, whole and background answers); `GET` and `cancel` of
stored responses. Drawn in docs/phases/09-appendix-endpoints.md, section 5.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from tinyvllm.api.errors import OpenAIError, bad_request, to_openai_error
from tinyvllm.api.protocol import ChatCompletionRequest
from tinyvllm.api.protocol_responses import (FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage,
                                             OutputText, OutputTokensDetails, RawMessage, ReasoningItem, ReasoningText,
                                             ResponseError, ResponsesRequest, ResponsesResponse, ResponseUsage)
from tinyvllm.api.response_store import DEFAULT_MAX_STORED_RESPONSES, RUNNING, ResponseStore, StoredResponse
from tinyvllm.api.serving_chat import OpenAIServingChat

logger = logging.getLogger("tinyvllm.api")

# the chat route's names for the fields a 400 may name, and theirs here
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text"}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the one `include` served: the output text's token logprobs
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "priority",
            "parallel_tool_calls", "user")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store if store is not None else ResponseStore(DEFAULT_MAX_STORED_RESPONSES)

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response | dict:
        self.check_background(request)
        if request.include and any(value != LOGPROBS for value in request.include):
            raise bad_request(f"include must hold only {LOGPROBS!r} (the other includes are outputs of tools "
                              f"this server does not run), got {request.include}", "include")
        history = []
        if request.previous_response_id is not None:
            history = continuation(self.store.get(request.previous_response_id, "previous_response_id"))
        messages = self.messages(request, history)
        # vLLM: store=true is silently not done where the server keeps nothing
        head = self.head(request, f"resp_{uuid.uuid4().hex}", int(time.time()), self.chat.check_model(request.model),
                         store=request.store and self.store.enabled)
        chat_request = self.chat_request(request, messages, stream=request.stream or request.background)
        try:  # the checks and the engine's add_request happen here: a 400 or 429 is sent now, never "queued"
            answer = await self.chat.create_chat_completion(chat_request, raw_request)
        except Exception as e:  # the chat route's 400 names its own field: say ours
            raise renamed(to_openai_error(e)) from e
        if request.background:
            queued = ResponsesResponse(**head, status="queued")
            task = asyncio.create_task(self.run_in_background(answer.body_iterator, request, head, messages))
            self.store.put(queued, messages, task)
            return queued.model_dump()
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(self.events(answer.body_iterator, request, head, messages),
                                     media_type="text/event-stream")
        if isinstance(answer, Response):  # the client left
            return answer
        response = self.from_chat(answer, request, head)
        if response.store:
            self.store.save(response, messages)
        return response.model_dump()

    def check_background(self, request: ResponsesRequest) -> None:
        if request.enable_response_messages and (request.stream or request.background):
            raise bad_request("enable_response_messages is served on responses that are neither streamed nor in the "
                              "background: the raw messages come with the whole response", "enable_response_messages")
        if not request.background:
            return
        if not request.store:  # vLLM's check, and its words
            raise bad_request("background can only be used when `store` is true", "background")
        if not self.store.enabled:
            raise bad_request("This server stores no responses (--max-stored-responses 0) and therefore does not "
                              "support the background mode; start it with --max-stored-responses N", "background")
        if request.stream:
            raise bad_request("background cannot be streamed here: send stream=false and read the response with "
                              "GET /v1/responses/{id}", "stream")

    def retrieve(self, response_id: str) -> dict:
        """`GET /v1/responses/{id}`: a stored response as it stands (a background one: queued, in progress or
        done)."""
        return self.store.get(response_id).response.model_dump()

    async def cancel(self, response_id: str) -> dict:
        """`POST /v1/responses/{id}/cancel`: a background response stops; its engine request is aborted (closing
        the chat stream aborts it), so its KV blocks go back to the pool."""
        entry = self.store.get(response_id)
        status = entry.response.status
        if status not in RUNNING:
            raise bad_request(f"Cannot cancel response '{response_id}': its status is {status!r}; only a "
                              "background response that is queued or in_progress can be cancelled")
        entry.response.status = "cancelled"
        if entry.task is not None:
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        return entry.response.model_dump()

    async def run_in_background(self, chunks: AsyncIterator[str], request: ResponsesRequest, head: dict,
                                messages: list[dict]) -> None:
        """A background response: the streamed path, its events read here instead of sent; the first says the
        engine is running it, the last (saved by `event_items`) is the final response."""
        try:
            async for kind, _ in self.event_items(chunks, request, head, messages):
                if kind == "response.in_progress":
                    self.store.set_status(head["id"], "in_progress")
        except Exception as e:  # nobody is there to be told: the poller reads "failed", never "in_progress" for ever
            logger.exception("background response %s failed", head["id"])
            self.store.save(ResponsesResponse(**head, status="failed", error=ResponseError(
                code="internal_error", message=f"the response failed: {type(e).__name__}")), messages)

    # ---- request: items -> messages ----

    def chat_request(self, request: ResponsesRequest, messages: list[dict], stream: bool) -> ChatCompletionRequest:
        fields = {name: getattr(request, name) for name in SAMPLING if getattr(request, name) is not None}
        fields.update(model=request.model, messages=messages, stream=stream,
                      max_completion_tokens=request.max_output_tokens)
        if request.enable_response_messages:
            fields["return_token_ids"] = True
        if request.reasoning is not None:
            if request.reasoning.summary is not None:
                raise bad_request("reasoning.summary: no reasoning summaries are written here; the reasoning itself "
                                  "comes as a reasoning item with --reasoning-parser. Leave summary out.",
                                  "reasoning")
            fields["reasoning_effort"] = request.reasoning.effort
        if stream:
            fields["stream_options"] = {"include_usage": True}
        if request.include and LOGPROBS in request.include:
            fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
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
    def messages(request: ResponsesRequest, history: list[dict] | None = None) -> list[dict]:
        """The conversation as chat messages, in vLLM's order: instructions first, then the history of the
        response it continues (`continuation`), then each input item."""
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        messages += history or []
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
    def head(request: ResponsesRequest, response_id: str, created: int, model: str, store: bool) -> dict:
        """The fields every response object of this request has, whatever its status."""
        return {"id": response_id, "created_at": created, "model": model, "store": store,
                "background": request.background, "previous_response_id": request.previous_response_id,
                "top_logprobs": request.top_logprobs,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "parallel_tool_calls": request.parallel_tool_calls is not False, "temperature": request.temperature,
                "top_p": request.top_p, "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
                "text": request.text, "metadata": request.metadata}

    def from_chat(self, answer: dict, request: ResponsesRequest, head: dict) -> ResponsesResponse:
        choice = answer["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        output = []
        if message.get("reasoning"):
            output.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message["reasoning"])]))
        forced = request.tool_choice not in (None, "auto", "none")  # a call, or nothing when it was cut short
        if message.get("content") or (message.get("tool_calls") is None and not forced):
            text = OutputText(text=message.get("content") or "", logprobs=token_logprobs(choice))
            output.append(OutputMessage(id=item_id("msg"), content=[text],
                                        status="incomplete" if finish_reason == "length" else "completed"))
        for call in message.get("tool_calls") or []:
            output.append(FunctionCallItem(id=item_id("fc"), call_id=call["id"], name=call["function"]["name"],
                                           arguments=call["function"]["arguments"]))
        raw = {}
        if request.enable_response_messages:  # as the model saw and wrote them, special tokens included
            decode = self.chat.tokenizer.decode
            raw = {"input_messages": [RawMessage(message=decode(answer["prompt_token_ids"]),
                                                 tokens=answer["prompt_token_ids"])],
                   "output_messages": [RawMessage(message=decode(choice["token_ids"]), tokens=choice["token_ids"])]}
        return ResponsesResponse(**head, output=output, **outcome(finish_reason), usage=response_usage(answer["usage"]),
                                 **raw)

    async def events(self, chunks: AsyncIterator[str], request: ResponsesRequest, head: dict,
                     messages: list[dict]) -> AsyncIterator[str]:
        """The chat route's stream as the Responses API's server-sent events, numbered."""
        numbers = itertools.count()
        async for kind, fields in self.event_items(chunks, request, head, messages):
            body = {"type": kind, "sequence_number": next(numbers), **fields}
            yield f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def event_items(self, chunks: AsyncIterator[str], request: ResponsesRequest, head: dict,
                          messages: list[dict]) -> AsyncIterator[tuple[str, dict]]:
        """The chat route's stream, chunk by chunk, as the Responses API's events (kind, fields); the final
        response is stored (where `head` says so) before its event goes out."""
        stream, started = ItemStream(logprobs=bool(request.include and LOGPROBS in request.include)), False
        try:
            async for raw in chunks:
                payload = raw.removeprefix("data: ").strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:  # after the 200: the chat route's error event
                    error = chunk["error"]
                    code = error["type"]  # vLLM's name of the error (its code is the HTTP status)
                    failed = ResponsesResponse(**head, status="failed", output=stream.output,
                                               error=ResponseError(code=code, message=error["message"]))
                    if failed.store:  # before any event: a client that leaves at one must not lose it
                        self.store.save(failed, messages)
                    yield "error", {"code": code, "message": error["message"], "param": error.get("param")}
                    if started:
                        yield "response.failed", {"response": failed.model_dump()}
                    return
                if not started:
                    started = True
                    in_progress = ResponsesResponse(**head, status="in_progress").model_dump()
                    yield "response.created", {"response": in_progress}
                    yield "response.in_progress", {"response": in_progress}
                if chunk.get("usage"):
                    stream.usage = chunk["usage"]
                for choice in chunk["choices"]:
                    for item in stream.feed(choice):
                        yield item
            for item in stream.close():
                yield item
            final = ResponsesResponse(**head, output=stream.output, **outcome(stream.finish_reason),
                                      usage=None if stream.usage is None else response_usage(stream.usage))
            if final.store:
                self.store.save(final, messages)
            if started:
                yield f"response.{final.status}", {"response": final.model_dump()}
        finally:  # closing the chat stream aborts its request
            await chunks.aclose()


class ItemStream:
    """The output items a streamed chat message becomes: at most one item is open; a delta of another kind closes
    it and opens the next."""

    def __init__(self, logprobs: bool = False):
        self.output: list = []
        self.open: ReasoningItem | OutputMessage | FunctionCallItem | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.logprobs = logprobs  # include=["message.output_text.logprobs"]: the text's tokens carry theirs
        self.pending_logprobs: list[dict] = []  # tokens whose text has not come out yet

    def feed(self, choice: dict) -> list[tuple[str, dict]]:
        events, delta = [], choice["delta"]
        self.pending_logprobs += token_logprobs(choice) or []
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
            item.content.append(OutputText(text="", logprobs=[] if self.logprobs else None))
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
        part = self.open.content[0]
        part.text += text
        if kind is ReasoningItem:
            return events + [("response.reasoning_text.delta", {**self.where(), "content_index": 0, "delta": text})]
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        if part.logprobs is not None:
            part.logprobs += logprobs
        return events + [("response.output_text.delta", {**self.where(), "content_index": 0, "delta": text,
                                                         "logprobs": logprobs if self.logprobs else []})]

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


def token_logprobs(choice: dict) -> list[dict] | None:
    """A chat choice's per-token logprobs ({token, logprob, bytes, top_logprobs}: the Responses API's shape too)."""
    return (choice.get("logprobs") or {}).get("content")


def continuation(entry: StoredResponse) -> list[dict]:
    """A copy of what continuing a stored response prepends: its messages, then its output as an assistant message
    (reasoning left out as vLLM does; function calls kept, so a function_call_output can follow its call)."""
    messages = copy.deepcopy(entry.messages)
    text = "".join(part.text for item in entry.response.output if isinstance(item, OutputMessage)
                   for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in entry.response.output if isinstance(item, FunctionCallItem)]
    if calls:
        messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif text:
        messages.append({"role": "assistant", "content": text})
    return messages


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_text(content: object, i: int) -> str | list[dict]:
    """A message item's content: a string, text parts (input_text, output_text) joined, or with `input_image`
    parts the chat's content parts (an image_url part each)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise bad_request(f"input[{i}].content must be a string or a list of input_text and input_image parts",
                          "input")
    parts = []
    for j, part in enumerate(content):
        if part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif part.get("type") == "input_image":
            raise bad_request(f"input[{i}].content[{j}]: input_image takes image_url, a data: URL (or an http(s) "
                              "one where the server allows it); file_id is not served", "input")
        else:
            raise bad_request(f"input[{i}].content[{j}] must be an input_text part ({{\"type\": \"input_text\", "
                              f"\"text\": \"...\"}}) or an input_image part, got type {part.get('type')!r}", "input")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


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
