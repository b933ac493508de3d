"""`POST /v1/chat/completions`: a conversation in, the assistant's next message out.

The engine knows nothing of chats. The conversation becomes one prompt through the model's own
chat template (the Jinja template shipped with its weights), which writes each turn with the
markers the model was trained on and ends with the assistant's header, so that the model's
continuation is the reply:

    [{"role": "user", "content": "Hi"}]
        --chat template-->  "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
        --tokenize------->  prompt token ids  --> engine.generate()

A streamed reply opens each choice with a chunk holding only `delta.role`, then sends the new text
as `delta.content`, the last one with its `finish_reason`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tinyvllm.api.errors import bad_request
from tinyvllm.api.protocol import (ChatCompletionLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                   ChatCompletionStreamResponse, ChatCompletionTokenLogprob, ChatMessage,
                                   DeltaMessage, TopLogprob)
from tinyvllm.api.serving_engine import (SSE_DONE, OpenAIServing, choice_deltas, last_output, sse, sse_error,
                                         usage)
from tinyvllm.outputs import RequestOutput


# the roles of OpenAI's chat API ("developer" is the newer name of "system")
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response | dict:
        model = self.check_model(request.model)
        self.check_limits(request)
        include_usage = self.check_stream_options(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        prompt_ids = self.render(request.messages)
        # max_completion_tokens replaced max_tokens in OpenAI's API; either is accepted, the new one wins
        if request.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_completion_tokens, "messages",
                                                 "max_completion_tokens")
        else:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_tokens, "messages")
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_logprobs)

        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = self.engine.add_request(request_id, prompt_ids, params)  # 429 now, before any 200
        head = {"id": request_id, "created": created, "model": model}
        if request.stream:
            chunks = self.stream_chunks(stream, head, num_logprobs, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        final = await last_output(raw_request, stream)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return self.full_response(final, head, num_logprobs)

    def render(self, messages: list[dict]) -> list[int]:
        """The prompt's token ids: the conversation through the model's chat template."""
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                role = message.get("role") if isinstance(message, dict) else message
                raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
            content = message.get("content")
            if content is None:  # an assistant turn that only carries tool_calls, or a missing content
                content = ""
            if isinstance(content, list):  # content parts: only text ones can be served by a text model
                if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                content = "".join(str(part.get("text", "")) for part in content)
            conversation.append({**message, "content": content})
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except (ValueError, TypeError) as e:  # malformed messages, or the template's own raise_exception
            raise bad_request(f"the messages do not fit the model's chat template: {e}", "messages") from e
        self.check_prompt_chars(text, "messages")
        # the template wrote the special tokens (BOS included, where the model uses one): add none
        return self.tokenizer.encode(text, add_special_tokens=False)

    def full_response(self, final: RequestOutput, head: dict, num_logprobs: int | None) -> dict:
        choices = [ChatCompletionResponseChoice(
            index=completion.index, message=ChatMessage(role="assistant", content=completion.text),
            logprobs=None if num_logprobs is None else self.logprobs(completion.token_ids, completion.logprobs,
                                                                     num_logprobs),
            finish_reason=completion.finish_reason) for completion in final.outputs]
        return ChatCompletionResponse(**head, choices=choices, usage=usage(final)).model_dump()

    async def stream_chunks(self, stream: AsyncIterator[RequestOutput], head: dict, num_logprobs: int | None,
                            include_usage: bool) -> AsyncIterator[str]:
        final = None
        try:
            async for final, deltas in choice_deltas(stream):
                for delta in deltas:
                    if delta.first:
                        opening = ChatCompletionResponseStreamChoice(index=delta.index,
                                                                     delta=DeltaMessage(role="assistant", content=""))
                        yield sse(ChatCompletionStreamResponse(**head, choices=[opening]))
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs = self.logprobs(delta.token_ids, delta.logprobs, num_logprobs)
                    choice = ChatCompletionResponseStreamChoice(index=delta.index,
                                                                delta=DeltaMessage(content=delta.text),
                                                                logprobs=logprobs, finish_reason=delta.finish_reason)
                    yield sse(ChatCompletionStreamResponse(**head, choices=[choice]))
            if include_usage and final is not None:
                yield sse(ChatCompletionStreamResponse(**head, choices=[], usage=usage(final)))
        except Exception as e:  # after the 200: the error travels as an event
            yield sse_error(e)
        yield SSE_DONE

    def logprobs(self, token_ids: list[int], logprobs: list | None, num_top: int) -> ChatCompletionLogProbs:
        """Chat's logprobs: one entry per token, with its bytes and the `num_top` most likely alternatives."""
        content = []
        for token_id, (logprob, top) in zip(token_ids, logprobs or []):
            alternatives = [self.top_logprob(other_id, other_logprob) for other_id, other_logprob in top[:num_top]]
            sampled = self.top_logprob(token_id, logprob)
            content.append(ChatCompletionTokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
        return ChatCompletionLogProbs(content=content)

    def top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.token_text(token_id), logprob=logprob,
                          bytes=list(self.tokenizer.token_bytes(token_id)))
