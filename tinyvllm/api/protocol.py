"""The OpenAI API's request and response bodies, as pydantic models, field for field.

Requests are validated here for type, shape and OpenAI's ranges (a string where a number belongs,
or a temperature of 3, is a 400 naming the field before any code of ours runs); values are
validated once more by `SamplingParams`, which names the field. Types are strict, as OpenAI's are:
`"n": "2"`, `"stream": "yes"` or `"max_tokens": true` are refused, not coerced; a float field takes
a JSON integer (`"temperature": 1`) but not a string or a boolean. The limits the server's operator
sets (`--max-n`, the stop strings, the body size) are checked in `serving_engine.py` and `server.py`.
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
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tinyvllm.sampling_params import MAX_LOGPROBS


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
    include_usage: StrictBool = False  # one last chunk with `usage` (and no choices) before [DONE]


# ---- requests ----------------------------------------------------------------------------------

# A list that stops at its first bad item. A prompt is a union of list types, tried in turn: without
# fail_fast, a million token ids tried as list[str] would first collect a million errors.
Ids = Annotated[list[StrictInt], Field(fail_fast=True)]
Strings = Annotated[list[StrictStr], Field(fail_fast=True)]


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`. Only its shape is checked: the output is not constrained (yet)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name", "schema", "strict"} with type "json_schema"


class SamplingFields(BaseModel):
    """The fields both endpoints share. Names equal `SamplingParams`' wherever the meaning is the same;
    ranges are OpenAI's (the API reference) where OpenAI has the field, `SamplingParams`' otherwise."""

    model: StrictStr | None = None  # OpenAI requires it; like vLLM, a missing model means the served one
    n: StrictInt = Field(1, ge=1)  # at most the server's --max-n
    temperature: StrictFloat | None = Field(None, ge=0, le=2)  # None: OpenAI's default 1.0
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    seed: StrictInt | None = None
    stop: StrictStr | Strings | None = None  # at most --max-stop-sequences, each --max-stop-length chars
    stop_token_ids: Ids | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # JSON keys are strings: {"1234": -100}
    min_tokens: StrictInt | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    response_format: ResponseFormat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # an end-user id for abuse monitoring; accepted and ignored


class CompletionRequest(SamplingFields):
    # one prompt: text or token ids. A list of them is a batch; only batches of one are served.
    prompt: StrictStr | Strings | Ids | Annotated[list[Ids], Field(fail_fast=True)]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    echo: StrictBool = False  # put the prompt in front of the completion
    # how many top alternatives per token (0 = the sampled token only); OpenAI allows 5, vLLM 20
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict]  # {"role", "content"}: content a string or a list of {"type": "text", "text"} parts
    max_tokens: StrictInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: StrictInt | None = None  # None: as many as the context leaves
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token, needs logprobs


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
