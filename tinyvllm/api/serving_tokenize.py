"""`POST /tokenize` and `POST /detokenize` (vLLM's endpoints and shapes); `messages` go through the chat route's
`render_text`, so the count is that chat request's.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from tinyvllm.api.errors import bad_request
from tinyvllm.api.fields import RequestModel
from tinyvllm.api.protocol import ChatCompletionToolParam
from tinyvllm.api.serving_chat import OpenAIServingChat


class TokenizeCompletionRequest(RequestModel):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # the model's BOS, where it has one
    return_token_strs: StrictBool = False


class TokenizeChatRequest(RequestModel):
    model: StrictStr | None = None
    messages: list[dict] = Field(min_length=1)
    tools: list[ChatCompletionToolParam] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: StrictBool = False  # the template writes them (vLLM's default for chat)
    return_token_strs: StrictBool = False


def _tokenize_kind(body: object) -> str:
    if isinstance(body, TokenizeChatRequest) or isinstance(body, dict) and "messages" in body:
        return "TokenizeChatRequest"
    return "TokenizeCompletionRequest"


# /tokenize's body: messages make it a chat request, otherwise a prompt one; chosen by that key first, so a bad
# field is reported against the one the client meant, not against both
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")], Discriminator(_tokenize_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfoResponse(BaseModel):
    """vLLM's: the tokenizer's configuration, as its tokenizer_config.json would say it."""
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeRequest(RequestModel):
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(fail_fast=True)


class DetokenizeResponse(BaseModel):
    prompt: str


class OpenAIServingTokenization:
    """Tokenize with the chat serving's template path: one rendering of a conversation, not two."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        chat = self.chat
        chat.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
            text = chat.render_text(request.messages, tools or None,
                                    add_generation_prompt=request.add_generation_prompt,
                                    continue_final_message=request.continue_final_message,
                                    chat_template_kwargs=request.chat_template_kwargs)
        else:
            text = request.prompt
            chat.check_prompt_chars(text, "prompt")
        tokens = chat.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        token_strs = [chat.tokenizer.token_string(t) for t in tokens] if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=chat.engine.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        chat = self.chat
        chat.check_model(request.model)
        vocab_size = chat.tokenizer.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"tokens must be token ids in [0, {vocab_size}), got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=chat.tokenizer.decode(request.tokens))

    def tokenizer_info(self) -> TokenizerInfoResponse:
        tok = self.chat.tokenizer
        name = lambda token_id: None if token_id is None else tok.token_string(token_id)  # noqa: E731
        return TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__, vocab_size=tok.vocab_size,
            model_max_length=self.chat.engine.max_model_len, bos_token=name(tok.bos_token_id),
            eos_token=name(tok.eos_token_id), add_bos_token=tok.add_bos_token, chat_template=tok.chat_template,
            added_tokens_decoder={str(i): {"content": content, "special": tok.is_special(i)}
                                  for content, i in sorted(tok.added_tokens.items(), key=lambda item: item[1])})
