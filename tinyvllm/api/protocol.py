"""The OpenAI API's request and response bodies as pydantic models, field for field (openai/openai-openapi,
vLLM's `entrypoints/openai/protocol.py`): strict types and OpenAI's ranges, a 400 naming the field; vLLM's
sampling extras under `SamplingParams`' names. Taught in docs/phases/09-api-server.md and 09-appendix-endpoints.md.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_serializer)
from pydantic_core import PydanticCustomError

from tinyvllm.api.fields import RequestModel


class ErrorInfo(BaseModel):
    message: str
    type: str  # vLLM's: "BadRequestError", "NotFoundError", ... (errors.error_type)
    param: str | None = None
    code: int  # vLLM's: the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelPermission(BaseModel):
    """vLLM's (after OpenAI's retired shape): what a client may do with the model."""
    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tinyvllm"
    root: str | None = None  # the checkpoint served under this name
    parent: str | None = None  # vLLM's: the base model of an adapter; none here
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with --reasoning-parser


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False  # a last chunk with the usage (OpenAI's and vLLM's default: off)
    continuous_usage_stats: StrictBool | None = False  # vLLM's: every chunk carries the usage so far


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`, one entry of `prompt_logprobs`: a token's log-probability at a prompt position, its rank in
    the vocabulary (1: the most likely; None where it fell outside the top alternatives computed) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token: None for the first (nothing predicts it), then {token id: PromptLogprob} for the prompt's token
# and the top alternatives (JSON writes the ids as string keys)
PromptLogprobs = list[dict[int, PromptLogprob] | None]

# the strings pydantic's lax `bool` (vLLM's request models) reads as a boolean: `"logprobs": "true"` is true there
BOOL_STRINGS = {**dict.fromkeys(("true", "True", "TRUE", "1", "yes", "on", "t", "y"), True),
                **dict.fromkeys(("false", "False", "FALSE", "0", "no", "off", "f", "n"), False)}


def _as_bool(value: bool | str | None) -> bool:
    return BOOL_STRINGS[value] if isinstance(value, str) else bool(value)


# a boolean, or one of those strings (named in the schema, so a schema-driven client still sees a boolean field)
LaxBool = Annotated[StrictBool | Literal[tuple(BOOL_STRINGS)] | None, AfterValidator(_as_bool)]


# ---- requests ----

# fail_fast: a million token ids tried as list[str] (a prompt's union) would first collect a million errors
Ids = Annotated[list[StrictInt], Field(fail_fast=True)]
Strings = Annotated[list[StrictStr], Field(fail_fast=True)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Choices = Annotated[list[NonEmptyStr], Field(min_length=1, fail_fast=True)]


class JsonSchemaFormat(BaseModel):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # always strict here


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text", "json_object" or "json_schema" (against `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one of these (see `StructuredOutputsParams`)."""

    json_: dict | NonEmptyStr | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Choices | None = None
    grammar: NonEmptyStr | None = None
    json_object: StrictBool | None = None


class SamplingFields(RequestModel):
    """The fields both endpoints share: `SamplingParams`' names; OpenAI's ranges where OpenAI has the field.
    Every other field of vLLM's and OpenAI's requests is refused by `RequestModel` (tinyvllm/api/fields.py)."""

    model: StrictStr | None = None  # missing: the served one
    n: StrictInt = Field(1, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    seed: StrictInt | None = None
    stop: StrictStr | Strings | None = None
    stop_token_ids: Ids | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # JSON keys are strings: {"1234": -100}
    min_tokens: StrictInt | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extra
    guided_json: dict | NonEmptyStr | None = None  # vLLM's older names for the same constraints
    guided_regex: NonEmptyStr | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmptyStr | None = None
    priority: StrictInt = 0  # lower is served first
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted and ignored
    # vLLM's extras: each prompt token's logprob and this many alternatives; the token ids in the answer; logprob
    # tokens written "token_id:123"; only the prompt's last N tokens (-1: the model's context length)
    prompt_logprobs: StrictInt | None = None
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": the prompt's first tokens are kept instead


class CompletionRequest(SamplingFields):
    prompt: StrictStr | Strings | Ids | Annotated[list[Ids], Field(fail_fast=True)] | None = Field(
        None, validate_default=True)
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    echo: StrictBool = False
    # top alternatives per token (0: the sampled token only); OpenAI allows 5, vLLM 20
    logprobs: StrictInt | None = None  # -1: every token's; at most the server's --max-logprobs
    best_of: StrictInt | None = None
    # vLLM's extras: n beams instead of n samples, ranked with this penalty
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0

    @field_validator("prompt")
    @classmethod
    def _given(cls, prompt):
        if prompt is None:  # vLLM's words (prompt_embeds are not served here)
            raise PydanticCustomError("prompt_missing",
                                      "Either prompt or prompt_embeds must be provided and non-empty.")
        return prompt


class FunctionDefinition(BaseModel):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: StrictBool | None = None


class ChatCompletionToolParam(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape: the client parses it)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM's (no `reasoning_content` alias, as in current vLLM): inside <think>


class ChatCompletionRequest(SamplingFields):
    messages: list[dict]  # {"role", "content"}: content a string or a list of {"type": "text", "text"} parts
    tools: list[ChatCompletionToolParam] | None = None
    # None: "auto" with tools, "none" without; a named function is {"type": "function", "function": {"name"}}
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI's deprecated forms of tools and tool_choice (tinyvllm/api/legacy_functions.py)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: LaxBool = False  # vLLM declares a lax bool: "true" is true
    top_logprobs: StrictInt | None = None  # -1: every token's; at most the server's --max-logprobs
    echo: StrictBool = False  # vLLM's: the last message's content opens the answer when its role is the answer's
    # vLLM's chat template extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    include_reasoning: StrictBool = True  # vLLM's: false leaves a --reasoning-parser's reasoning out of the answer
    # vLLM's: given to the chat template as reasoning_effort, with enable_thinking = (effort != "none")
    reasoning_effort: ReasoningEffort | None = None


# ---- completions responses ----


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _VllmExtras(BaseModel):
    """A streamed chunk's model whose vLLM-only fields (`EXTRAS`) are left out of its JSON while unset (vLLM's
    `exclude_unset` for chunks); a whole response carries them as null, as vLLM's does."""

    EXTRAS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None or key not in self.EXTRAS}


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop" | "length" (| "abort", vLLM's)
    token_ids: list[int] | None = None  # return_token_ids: this piece's generated ids
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs (or echo with logprobs)
    prompt_token_ids: list[int] | None = None  # return_token_ids: the choice's prompt (a stream's first chunk)


class _WithoutNulls(BaseModel):
    """Serialized without its None fields: the official client merges tool-call deltas key by key (a null `type`
    or `name` would overwrite the one an earlier chunk sent); vLLM leaves out a timing it cannot tell."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class PerRequestMetrics(_WithoutNulls):
    """vLLM's per-request timings (--enable-per-request-metrics), milliseconds from the engine's clock: the first
    token after the first step that ran it, the rest of the generation, the queue, the mean gap between tokens.
    A timing that cannot be told (one token: no gap) is left out, as vLLM leaves it."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None


class CompletionStreamChoice(CompletionResponseChoice, _VllmExtras):
    EXTRAS = ("token_ids", "prompt_logprobs", "prompt_token_ids")


class CompletionStreamResponse(_VllmExtras):
    EXTRAS = ("metrics",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    metrics: PerRequestMetrics | None = None  # on the usage chunk, with --enable-per-request-metrics


# ---- chat responses ----


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
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts chat's on the response, not the choice
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None  # --enable-per-request-metrics


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """One piece of a streamed tool call: `index` says which call; `id`, `type` and the name come first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_WithoutNulls):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(_VllmExtras):
    EXTRAS = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's generated ids


class ChatCompletionStreamResponse(_VllmExtras):
    EXTRAS = ("prompt_token_ids", "metrics")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk
    metrics: PerRequestMetrics | None = None  # on the usage chunk, with --enable-per-request-metrics
