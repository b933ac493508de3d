"""The Responses API's bodies (OpenAI's `POST /v1/responses`) as pydantic models, after the openai client's
`responses.create` types and vLLM's `ResponsesRequest`. Taught in docs/phases/09-appendix-endpoints.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tinyvllm.api.fields import RequestModel
from tinyvllm.api.protocol import ReasoningEffort


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    """`text.format`: "text", "json_object", or "json_schema" with its schema beside the type (flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class Reasoning(BaseModel):
    effort: ReasoningEffort | None = None  # to the chat template, as the chat route's reasoning_effort
    summary: Literal["auto", "concise", "detailed"] | None = None  # refused: no summaries are written


class ResponsesRequest(RequestModel):
    model: StrictStr | None = None
    input: StrictStr | Annotated[list[dict], Field(min_length=1)]
    instructions: StrictStr | None = None  # a system message before the input
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    enable_response_messages: StrictBool = False  # vLLM's: the raw prompt and output, text and token ids
    stream: StrictBool = False
    store: StrictBool = True  # keep the response (tinyvllm/api/response_store.py), as OpenAI and vLLM default
    previous_response_id: StrictStr | None = None  # continue a stored response
    background: StrictBool = False  # answer "queued" at once; GET /v1/responses/{id} for the rest
    include: list[StrictStr] | None = None  # extra output: only "message.output_text.logprobs" is served
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)  # with the logprobs include: alternatives per token
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    # vLLM's sampling extras, as on the chat route
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    seed: StrictInt | None = None
    priority: StrictInt = 0


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    # include=["message.output_text.logprobs"]: per token {token, logprob, bytes, top_logprobs}, chat's shape
    logprobs: list[dict] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class RawMessage(BaseModel):
    """vLLM's `raw_message_tokens`: a prompt or an output as the model saw or wrote it."""

    type: Literal["raw_message_tokens"] = "raw_message_tokens"
    message: str
    tokens: list[int]


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputMessage | FunctionCallItem | ReasoningItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | NamedFunctionChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # whether this server kept it
    background: bool = False
    previous_response_id: str | None = None
    top_logprobs: int | None = None
    input_messages: list[RawMessage] | None = None  # with enable_response_messages
    output_messages: list[RawMessage] | None = None
