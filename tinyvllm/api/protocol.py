"""The OpenAI API's request and response bodies, as pydantic models, field for field.

Requests are validated here for type and shape (a string where a number belongs is a 400 before any
code of ours runs); values are validated once more by `SamplingParams`, which names the field.
Beside OpenAI's fields, the requests accept vLLM's sampling extras (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, ...) under the same names, so
the request maps onto `SamplingParams` name for name. Unknown fields are ignored, as OpenAI does.

    request                      response (stream=false)       chunk (stream=true, one per SSE event)
    CompletionRequest            CompletionResponse            CompletionStreamResponse
    ChatCompletionRequest        ChatCompletionResponse        ChatCompletionStreamResponse

Shapes follow the OpenAPI spec the official clients are generated from (openai/openai-openapi) and
vLLM's `vllm/entrypoints/openai/protocol.py`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tinyvllm"
    max_model_len: int | None = None  # vLLM's extra: how many tokens prompt + output may hold


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StreamOptions(BaseModel):
    include_usage: bool = False  # one last chunk with `usage` (and no choices) before [DONE]


# ---- requests ----------------------------------------------------------------------------------


class SamplingFields(BaseModel):
    """The fields both endpoints share. Names equal `SamplingParams`' wherever the meaning is the same."""

    model: str | None = None  # OpenAI requires it; like vLLM, a missing model means the served one
    n: int = 1
    temperature: float | None = None  # None: OpenAI's default 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: {"1234": -100}
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse monitoring; accepted and ignored


class CompletionRequest(SamplingFields):
    # one prompt: text or token ids. A list of them is a batch; only batches of one are served.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False  # put the prompt in front of the completion
    logprobs: int | None = None  # how many top alternatives per token (0 = the sampled token only)
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict]  # {"role", "content"}: content a string or a list of {"type": "text", "text"} parts
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # None: as many as the context leaves
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, needs logprobs=true


# ---- completions responses -----------------------------------------------------------------------


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop" | "length" (| "abort", vLLM's)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None  # only on the last chunk, with stream_options.include_usage


# ---- chat responses ------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes: a token may be half a character


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None  # "assistant" in each choice's first chunk only
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
