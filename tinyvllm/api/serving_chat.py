"""`POST /v1/chat/completions`: a conversation through the model's chat template, the assistant's next message
out.

Taught in docs/phases/09-api-server.md; tools and reasoning in 09-appendix-tools-and-reasoning.md.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tinyvllm.api.errors import bad_request, validated
from tinyvllm.api.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                   ChatCompletionStreamResponse, ChatCompletionTokenLogprob, ChatMessage,
                                   CompletionTokensDetails, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                   NamedToolChoice, ToolCall, TopLogprob, UsageInfo)
from tinyvllm.api.reasoning_parser import REASONING_PARSERS, ThinkReasoningParser
from tinyvllm.api.serving_engine import (SSE_DONE, ChoiceDelta, OpenAIServing, base_request_id, choice_deltas,
                                         grammar_error, last_output, sse, sse_error)
from tinyvllm.api.tool_parser import (END, NO_PARAMETERS, START, TOOL_PARSERS, ToolCallPolicy, ToolParser,
                                      with_default_tool_prompt, with_parsed_arguments)
from tinyvllm.model.chat_template import content_text, template_messages, template_variables
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import StructuredOutputsParams


# OpenAI's roles ("developer" is the newer "system"); as in vLLM, any other string goes to the chat template too
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ToolUse:
    """What a request's `tools` and `tool_choice` ask of the server."""

    tools: list[dict] | None = None
    parse: bool = False  # look for calls in the output: tool_choice auto, required or named
    forced: list[dict] = field(default_factory=list)  # the functions the calls must be to (required, named)
    parallel: bool = True
    parser: type[ToolParser] = TOOL_PARSERS["hermes"]

    @property
    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """A forced call is a structured output, from the field that asked for it."""
        if not self.forced:
            return None
        return "tool_choice", StructuredOutputsParams(grammar=self.parser.forced_grammar(self.forced, self.parallel))

    def make_parser(self) -> ToolParser | None:
        if not self.parse:
            return None
        return self.parser(ToolCallPolicy([tool["function"] for tool in self.tools], self.parallel,
                                          forced=bool(self.forced)))


class ChoiceParser:
    """One choice's text -> (reasoning, content, tool calls), piece by piece: reasoning first, then tool calls."""

    def __init__(self, reasoning: ThinkReasoningParser | None, tools: ToolParser | None, show_reasoning: bool = True):
        self.reasoning, self.tools = reasoning, tools
        self.show_reasoning = show_reasoning  # vLLM's include_reasoning: false keeps it out of the answer
        self.reasoning_text = ""  # all of it, shown or not: the usage counts its tokens

    @property
    def forced(self) -> bool:
        """tool_choice "required" or named: the reply is calls, none when cut short."""
        return self.tools is not None and self.tools.policy is not None and self.tools.policy.forced

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def num_calls(self) -> int:
        return 0 if self.tools is None else self.tools.num_calls

    def feed(self, text: str, last: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if last:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            self.reasoning_text += reasoning
            reasoning = reasoning if self.show_reasoning else ""
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if last:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        return reasoning, content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def template_kwargs(request: ChatCompletionRequest) -> dict | None:
    """The chat template's extra variables: the request's, and vLLM's reasoning_effort with enable_thinking (true
    unless the effort is "none"; the request's own enable_thinking wins). A template ignores the ones it lacks."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", request.reasoning_effort != "none")
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs or None


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, reasoning_parser: str | None = None, tool_call_parser: str = "hermes", media=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.media = media  # Phase 10's MediaConnector: image_url parts to images
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {reasoning_parser!r}")
        if tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
        self.reasoning_parser = reasoning_parser if reasoning_parser != "none" else None
        self.tool_parser = TOOL_PARSERS[tool_call_parser]

    async def create_batch_chat_completion(self, body: object, raw_request: Request) -> Response | dict:
        """vLLM's /v1/chat/completions/batch: `messages` a list of conversations, each answered as a chat request
        of the other fields, run side by side; one response, choice i for conversation i, usage summed."""
        conversations = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(conversations, list) or not conversations or not all(
                isinstance(c, list) and c for c in conversations):
            raise bad_request("messages must be a non-empty list of conversations (each a non-empty list of "
                              "messages)", "messages")
        for name, allowed in (("stream", False), ("n", 1), ("use_beam_search", False)):
            if body.get(name, allowed) not in (allowed, None):
                raise bad_request(f"{name}={body[name]!r} is not supported by the batch route: send the "
                                  "conversations to /v1/chat/completions one by one", name)
        if body.get("tools"):
            raise bad_request("tools are not supported by the batch route: use /v1/chat/completions", "tools")
        requests = [validated(ChatCompletionRequest, {**body, "messages": c}) for c in conversations]
        base = f"chatcmpl-{base_request_id(raw_request)}"
        answers = await asyncio.gather(*(self.create_chat_completion(r, raw_request, f"{base}_{i}")
                                         for i, r in enumerate(requests)))
        if not all(isinstance(answer, dict) for answer in answers):
            return Response(status_code=499)  # the client left
        choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
        usage = {key: sum(answer["usage"][key] for answer in answers)
                 for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {**answers[0], "id": base, "choices": choices, "usage": usage}

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request,
                                     request_id: str | None = None) -> Response | dict:
        model = self.check_model(request.model)
        self.check_limits(request)
        include_usage, continuous_usage = self.check_stream_options(request)
        if request.top_logprobs and not request.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        tool_use = self.tool_use(request)
        images = [] if self.engine.multimodal_processor is not None else None
        text = self.render_text(request.messages, tool_use.tools, add_generation_prompt=request.add_generation_prompt,
                                continue_final_message=request.continue_final_message,
                                chat_template_kwargs=template_kwargs(request),
                                check_length=request.truncate_prompt_tokens is None, images=images)
        prompt_ids = self.truncate_prompt(self.tokenize(text), request.truncate_prompt_tokens,
                                          request.truncation_side)
        prompt = prompt_ids
        if images:
            prompt_ids, prompt = self.image_prompt(text, images, request)
        if request.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_completion_tokens, "messages",
                                                 "max_completion_tokens")
        else:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_tokens, "messages")
        num_logprobs = self.num_logprobs(request.top_logprobs or 0, "top_logprobs") if request.logprobs else None
        structured = self.structured_outputs(request, tool_use.constraint)
        # a tag that is a special token (Qwen's <tool_call>) must stay in the text to be parsed
        tags = ([START, END] if tool_use.parse else []) + (["<think>", "</think>"] if self.reasoning_parser else [])
        defaults = {"skip_special_tokens": False} if self.has_special_token(tags) else {}
        # vLLM's rule: the prompt's logprobs as asked, else with echo top_logprobs' count
        num_prompt_logprobs = self.num_prompt_logprobs(request, (num_logprobs or 0) if request.echo else None)
        params = self.sampling_params(request, max_tokens, num_logprobs, structured, num_prompt_logprobs, **defaults)

        def make_parser() -> ChoiceParser:
            prompt_opened = text.rstrip().endswith(ThinkReasoningParser.START)
            return ChoiceParser(ThinkReasoningParser(prompt_opened) if self.reasoning_parser else None,
                                tool_use.make_parser(), request.include_reasoning)

        request_id, created = request_id or f"chatcmpl-{base_request_id(raw_request)}", int(time.time())
        stream = self.engine.add_request(request_id, prompt, params, request.priority)  # 429 now, before any 200
        head = {"id": request_id, "created": created, "model": model}
        if request.stream:
            chunks = self.stream_chunks(stream, head, num_logprobs, include_usage, make_parser, bool(tool_use.forced),
                                        continuous_usage, request)
            return StreamingResponse(chunks, media_type="text/event-stream")
        final = await last_output(raw_request, stream)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return self.full_response(final, head, num_logprobs, make_parser, request)

    def image_prompt(self, text: str, images: list, request: ChatCompletionRequest) -> tuple[list[int], dict]:
        """(the token ids, each image's placeholder expanded; the engine's prompt dict with the images)."""
        if request.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
        try:
            prompt = self.engine.multimodal_processor.prompt_with_images(text, images, add_special_tokens=False)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return prompt["prompt_token_ids"], prompt

    @staticmethod
    def echoed(request: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the last message's text, when it has the role the answer has (the assistant's, or
        with add_generation_prompt false the last message's own): the answer then continues it."""
        if not request.echo or not request.messages:
            return ""
        last = request.messages[-1]
        role = "assistant" if request.add_generation_prompt else last.get("role")
        content = last.get("content") if last.get("role") == role else None
        if isinstance(content, list):  # text parts, one a line (as vLLM joins them)
            return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else ""

    def tool_use(self, request: ChatCompletionRequest) -> ToolUse:
        """Check `tools` and `tool_choice` (OpenAI's defaults: "auto" with tools, "none" without)."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools: give the functions the model may call in tools",
                                  "tool_choice")
            return ToolUse()
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        names = [tool["function"]["name"] for tool in tools]
        if len(set(names)) < len(names):
            raise bad_request(f"tools must have distinct function names, got {names}", "tools")
        for i, tool in enumerate(tools):  # whatever tool_choice
            error = grammar_error(StructuredOutputsParams(json=tool["function"].get("parameters") or NO_PARAMETERS))
            if error:
                raise bad_request(f"tools[{i}].function.parameters is not a JSON schema this server can check "
                                  f"arguments against: {error}", "tools")
        if choice == "none":
            return ToolUse(tools)  # in the prompt, never parsed
        parallel = request.parallel_tool_calls is not False
        if choice in (None, "auto"):
            return ToolUse(tools, parse=True, parallel=parallel, parser=self.tool_parser)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                              f"({', '.join(names)})", "tool_choice")
        wanted = names if choice == "required" else [choice.function.name]
        forced = [tool["function"] for tool in tools if tool["function"]["name"] in wanted]
        # a named function: one call (vLLM's); required: one or more, as parallel_tool_calls allows
        return ToolUse(tools, parse=True, forced=forced, parallel=parallel and choice == "required",
                       parser=self.tool_parser)

    def has_special_token(self, tags: list[str]) -> bool:
        """Whether any of `tags` is one special token of this vocabulary."""
        return any(self.tokenizer.special_token_id(tag) is not None for tag in tags)

    def render_text(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    check_length: bool = True, images: list | None = None) -> str:
        """The prompt text: messages (and tools) through the model's chat template; `check_length` false when the
        caller truncates; `images` collects each image_url part's image (the part becoming `<image>`)."""
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true: the first opens "
                              "a new assistant turn, the second continues the last message", "continue_final_message")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted({"messages", "add_generation_prompt", "tools"} & set(extra))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: they have their own fields",
                              "chat_template_kwargs")
        conversation = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else message
            if not isinstance(message, dict) or not isinstance(role, str) or not role:
                raise bad_request(f"messages[{i}].role must be a string: one of {', '.join(ROLES)}, or another role "
                                  f"the chat template knows, got {role!r}", "messages")
            content = message.get("content")
            if content is None:  # an assistant turn of tool_calls only
                content = ""
            if isinstance(content, list):  # content parts: text, and images for a model that takes them
                read_image = None if images is None else functools.partial(
                    self.engine.multimodal_processor.add_image, images, self.media)
                try:
                    content = content_text(content, f"messages[{i}]", read_image)
                except ValueError as e:
                    raise bad_request(str(e), "messages") from None
            elif not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got "
                                  f"{type(content).__name__}", "messages")
            tool_calls = message.get("tool_calls")
            if tool_calls is not None and not (isinstance(tool_calls, list) and all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict)
                    and isinstance(call["function"].get("name"), str) for call in tool_calls)):
                raise bad_request(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                                  "\"function\": {\"name\", \"arguments\"}}", "messages")
            for field in ("name", "tool_call_id"):
                if message.get(field) is not None and not isinstance(message[field], str):
                    raise bad_request(f"messages[{i}].{field} must be a string, got {message[field]!r}", "messages")
            conversation.append({**message, "content": content})
        variables = {}
        if self.tokenizer.chat_template is not None and "tools" in template_variables(self.tokenizer.chat_template):
            conversation = with_parsed_arguments(conversation)
            variables = {"tools": tools} if tools else {}
        else:
            conversation = with_default_tool_prompt(conversation, tools)
        if self.tokenizer.chat_template is not None:
            placeholder = None if images is None else self.engine.multimodal_processor.placeholder
            conversation = template_messages(self.tokenizer.chat_template, conversation, placeholder)
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      **extra, **variables)
        except (ValueError, TypeError) as e:
            raise bad_request(f"the messages do not fit the model's chat template: {e}", "messages") from e
        if continue_final_message:
            text = self.open_final_message(text, conversation)
        if check_length:
            self.check_prompt_chars(text, "messages")
        return text

    @staticmethod
    def open_final_message(text: str, conversation: list[dict]) -> str:
        """The rendered text cut right after the last message's content."""
        final = conversation[-1]["content"] if conversation else ""
        if not final or final not in text:
            raise bad_request("continue_final_message needs a last message with text content to continue",
                              "continue_final_message")
        return text[:text.rindex(final) + len(final)]

    def tokenize(self, text: str) -> list[int]:
        # the template wrote the special tokens
        return self.tokenizer.encode(text, add_special_tokens=False)

    def full_response(self, final: RequestOutput, head: dict, num_logprobs: int | None,
                      make_parser: Callable[[], ChoiceParser], request: ChatCompletionRequest) -> dict:
        """The stream joined: each choice's whole text through a fresh parser, as if it came in one chunk."""
        choices, parsers = [], []
        echoed = self.echoed(request)
        for completion in final.outputs:
            parser = make_parser()
            parsers.append(parser)
            reasoning, content, calls = parser.feed(completion.text, last=True)
            has_reasoning = parser.reasoning is not None and parser.reasoning.has_reasoning and parser.show_reasoning
            empty = calls or has_reasoning or parser.forced
            content = (content or None) if empty else content
            if echoed:
                content = echoed + (content or "")
            message = ChatMessage(role="assistant", content=content, reasoning=reasoning if has_reasoning else None,
                                  tool_calls=calls or None)  # a forced call cut short: none, as OpenAI and vLLM
            logprobs = None
            if num_logprobs is not None:
                logprobs = self.logprobs(completion.token_ids, completion.logprobs, num_logprobs,
                                         bool(request.return_tokens_as_token_ids))
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=message, logprobs=logprobs,
                finish_reason=parser.finish_reason(completion.finish_reason),
                token_ids=list(completion.token_ids) if request.return_token_ids else None))
        prompt_logprobs = None
        if final.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs(final.prompt_token_ids, final.prompt_logprobs)
        return ChatCompletionResponse(**head, choices=choices, usage=self.billed_usage(final, parsers),
                                      prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
                                      metrics=self.request_metrics(final)).model_dump()

    def billed_usage(self, final: RequestOutput, parsers: list[ChoiceParser]) -> UsageInfo:
        """The usage, with the reasoning text's tokens (vLLM's `reasoning_tokens`) under a reasoning parser."""
        billed = self.usage(final)
        if self.reasoning_parser:
            reasoning_tokens = sum(len(self.tokenizer.encode(parser.reasoning_text, add_special_tokens=False))
                                   for parser in parsers if parser.reasoning_text)
            billed.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return billed

    async def stream_chunks(self, stream: AsyncIterator[RequestOutput], head: dict, num_logprobs: int | None,
                            include_usage: bool, make_parser: Callable[[], ChoiceParser], forced_tool: bool,
                            continuous_usage: bool, request: ChatCompletionRequest) -> AsyncIterator[str]:
        parsers: dict[int, ChoiceParser] = {}
        final = None
        echoed = self.echoed(request)
        try:
            async for final, deltas in choice_deltas(stream):
                for delta in deltas:
                    if delta.first:
                        parsers[delta.index] = make_parser()
                        # a forced tool call has no content: OpenAI's opening chunk then says null, not ""
                        opening = DeltaMessage(role="assistant", content=None if forced_tool else "")
                        before = self.usage(final, opening=True) if continuous_usage else None
                        prompt_ids = final.prompt_token_ids if request.return_token_ids else None
                        yield sse(ChatCompletionStreamResponse(**head, choices=[ChatCompletionResponseStreamChoice(
                            index=delta.index, delta=opening)], usage=before, prompt_token_ids=prompt_ids))
                        if echoed:  # vLLM's echo: the last message's text, as a chunk of its own
                            yield sse(ChatCompletionStreamResponse(**head, choices=[ChatCompletionResponseStreamChoice(
                                index=delta.index, delta=DeltaMessage(content=echoed))], usage=before))
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs = self.logprobs(delta.token_ids, delta.logprobs, num_logprobs,
                                                 bool(request.return_tokens_as_token_ids))
                    so_far = self.usage(final) if continuous_usage else None
                    token_ids = delta.token_ids if request.return_token_ids else None
                    for choice in self.stream_choices(delta, parsers[delta.index], logprobs, token_ids):
                        yield sse(ChatCompletionStreamResponse(**head, choices=[choice], usage=so_far))
            if include_usage and final is not None:
                billed = self.billed_usage(final, list(parsers.values()))
                yield sse(ChatCompletionStreamResponse(**head, choices=[], usage=billed,
                                                       metrics=self.request_metrics(final)))
        except Exception as e:  # after the 200: the error travels as an event
            yield sse_error(e)
        yield SSE_DONE

    @staticmethod
    def stream_choices(delta: ChoiceDelta, parser: ChoiceParser, logprobs: ChatCompletionLogProbs | None,
                       token_ids: list[int] | None = None) -> list[ChatCompletionResponseStreamChoice]:
        """One choice's engine delta as chunks: the text, then each completed call (id and name, then arguments);
        the first carries the delta's logprobs and (return_token_ids) token ids."""
        reasoning, content, calls = parser.feed(delta.text, last=delta.finish_reason is not None)
        messages = []
        if not parser.active:
            messages.append(DeltaMessage(content=content))
        elif content or reasoning or logprobs is not None:
            messages.append(DeltaMessage(content=content or None, reasoning=reasoning or None))
        for k, call in enumerate(calls, start=parser.num_calls - len(calls)):
            name = DeltaFunctionCall(name=call.function.name, arguments="")
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(index=k, id=call.id, type="function",
                                                                   function=name)]))
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=k, function=DeltaFunctionCall(arguments=call.function.arguments))]))
        if not messages and delta.finish_reason is None:
            return []  # all held back (a tag, an open call)
        choices = [ChatCompletionResponseStreamChoice(index=delta.index, delta=message)
                   for message in messages or [DeltaMessage()]]
        choices[0].logprobs, choices[0].token_ids = logprobs, token_ids
        choices[-1].finish_reason = parser.finish_reason(delta.finish_reason)
        return choices

    def logprobs(self, token_ids: list[int], logprobs: list | None, num_top: int,
                 as_id: bool = False) -> ChatCompletionLogProbs:
        """Chat's logprobs: one entry per token, with its bytes and the `num_top` most likely alternatives; `as_id`:
        vLLM's return_tokens_as_token_ids."""
        content = []
        for token_id, (logprob, top) in zip(token_ids, logprobs or []):
            alternatives = [self.top_logprob(other_id, other_logprob, as_id)
                            for other_id, other_logprob in top[:num_top]]
            sampled = self.top_logprob(token_id, logprob, as_id)
            content.append(ChatCompletionTokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
        return ChatCompletionLogProbs(content=content)

    def top_logprob(self, token_id: int, logprob: float, as_id: bool = False) -> TopLogprob:
        # "token_id:123" stands for the token: its bytes are still the token's own
        return TopLogprob(token=self.token_text(token_id, as_id), logprob=logprob,
                          bytes=list(self.tokenizer.token_bytes(token_id)))
