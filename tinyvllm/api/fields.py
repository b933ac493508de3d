"""Every request field, honoured or refused: each field of our request models and of vLLM's (and OpenAI's) is
SUPPORTED (parsed and used) or `Refused` (a 400 naming the field, why, and what to use instead; accepted and
dropped at its default, which asks for nothing). A field in neither is a 400 "unknown field". `RequestModel`
applies the table; taught in docs/phases/09-appendix-endpoints.md, section 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

SUPPORTED = "supported"


@dataclass(frozen=True)
class Refused:
    reason: str  # why, and the supported alternative
    default: object = None  # the value that asks for nothing this server lacks: accepted, then dropped


def is_default(value: object, default: object) -> bool:
    """`value` asks for nothing beyond `default`: null (not sent), or the same JSON value (1 and 1.0 alike, but
    never `true` for 1)."""
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


# ---- refusals shared by the generating routes ----

NO_MULTIMODAL = "the models served here read text only: send text"
NO_DISAGGREGATION = "no disaggregated prefill and decode: one engine does both"

_ENGINE_EXTRAS = {
    "watermarking": Refused("no watermarking in this engine's sampler"),
    "spaces_between_special_tokens": Refused(
        "special tokens are detokenized as the tokenizer writes them; skip_special_tokens leaves them out", True),
    "truncate_prompt_tokens": SUPPORTED,
    "truncation_side": SUPPORTED,
    "allowed_token_ids": Refused("no allow-list of tokens: use structured_outputs (choice, regex) or logit_bias"),
    "logprob_token_ids": Refused("log-probabilities of chosen tokens are not served: use logprobs"),
    "bad_words": Refused("no bad-words filter: use logit_bias (-100) for single-token words", []),
    "request_id": Refused("the request id is the X-Request-Id header, echoed back in the response's id"),
    "session_id": Refused("no session affinity: one engine serves every request"),
    "return_tokens_as_token_ids": SUPPORTED,
    "return_token_ids": SUPPORTED,
    "return_weight_versions": Refused("weights are loaded once: there are no versions", False),
    "routed_experts_prompt_start": Refused("no mixture-of-experts models here", 0),
    "return_token_offsets": Refused("no token offsets: /v1/completions logprobs carry text_offset", False),
    "mm_payload": Refused(NO_MULTIMODAL, "tensors"),
    "return_mm_kwargs": Refused(NO_MULTIMODAL),
    "cache_salt": Refused("the prefix cache is shared by every request: serve tenants that must not share it from "
                          "separate servers"),
    "kv_transfer_params": Refused(NO_DISAGGREGATION),
    "ec_transfer_params": Refused(NO_DISAGGREGATION),
    "vllm_xargs": Refused("no logits-processor plugins read extra arguments"),
    "repetition_detection": Refused("no repetition detection: use repetition_penalty or stop"),
    "thinking_token_budget": Refused("no thinking budget: max_tokens bounds the whole output, reasoning included"),
    "stream_interval": Refused("every token is streamed as it is made"),
    "prompt_logprobs": SUPPORTED,
}

_CHAT_TEMPLATE_EXTRAS = {
    "chat_template": Refused("the model's own chat template is used: chat_template_kwargs passes it variables"),
    "media_io_kwargs": Refused(NO_MULTIMODAL),
    "mm_processor_kwargs": Refused(NO_MULTIMODAL),
}

# OpenAI's fields that ask for a hosted service's features
_OPENAI_SERVICE = {
    "metadata": Refused("chat completions are not stored, so there is nothing to tag: /v1/responses echoes "
                        "metadata"),
    "moderation": Refused("no moderation model runs here"),
    "prompt_cache_key": Refused("the prefix cache is automatic: requests sharing a prefix share its blocks"),
    "prompt_cache_options": Refused("the prefix cache is automatic: requests sharing a prefix share its blocks"),
    "prompt_cache_retention": Refused("the prefix cache keeps blocks until their space is needed"),
    "safety_identifier": Refused("no safety monitoring per end user"),
    "service_tier": Refused("one tier: every request is scheduled by priority", "auto"),
}

_SAMPLING = {name: SUPPORTED for name in (
    "model", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "min_tokens", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "priority", "stream", "stream_options", "user")}

COMPLETION_FIELDS = {
    **_SAMPLING, **_ENGINE_EXTRAS,
    **{name: SUPPORTED for name in ("prompt", "max_tokens", "echo", "logprobs", "best_of", "use_beam_search",
                                    "length_penalty")},
    "suffix": Refused("fill-in-the-middle is not implemented (it needs a model trained with FIM markers such as "
                      "<fim_prefix>, <fim_suffix>, <fim_middle>): send the text before the hole as the prompt"),
    "prompt_embeds": Refused("prompts are text or token ids: send the prompt's token ids", []),
    "add_special_tokens": Refused("a text prompt gets the model's special tokens (BOS) as its tokenizer adds them: "
                                  "send token ids to choose them yourself", True),
}

CHAT_FIELDS = {
    **_SAMPLING, **_ENGINE_EXTRAS, **_CHAT_TEMPLATE_EXTRAS, **_OPENAI_SERVICE,
    **{name: SUPPORTED for name in ("messages", "tools", "tool_choice", "functions", "function_call",
                                    "parallel_tool_calls", "max_tokens", "max_completion_tokens", "logprobs",
                                    "top_logprobs", "add_generation_prompt", "continue_final_message",
                                    "chat_template_kwargs")},
    "echo": SUPPORTED,
    "use_beam_search": Refused("beam search is served on /v1/completions (use_beam_search, n beams) and offline "
                               "by LLM.beam_search", False),
    "length_penalty": Refused("beam search (and so its length_penalty) is served on /v1/completions", 1.0),
    "add_special_tokens": Refused("the chat template writes the special tokens: /v1/completions takes token ids",
                                  False),
    "documents": Refused("no documents slot in the chat template: put the documents in a message"),
    "return_prompt_text": Refused("the rendered prompt is not returned: /tokenize with return_token_strs shows it"),
    "reasoning_effort": SUPPORTED,
    "include_reasoning": SUPPORTED,
    "audio": Refused("text output only"),
    "modalities": Refused("text output only"),
    "prediction": Refused("no predicted outputs: speculative decoding is set when the server starts "
                          "(--speculative-config)"),
    "store": Refused("chat completions are not stored: /v1/responses is the stateful API", False),
    "verbosity": Refused("no verbosity control: use max_completion_tokens or a system message"),
    "web_search_options": Refused("no built-in web search: give a function tool and run the search yourself"),
}

_ON_CHAT = "not on /v1/responses: /v1/chat/completions has it"

RESPONSES_FIELDS = {
    **{name: SUPPORTED for name in ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                                    "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "metadata",
                                    "user", "top_k", "min_p", "repetition_penalty", "seed", "priority",
                                    "store", "previous_response_id", "background", "include", "top_logprobs")},
    **{name: _ENGINE_EXTRAS[name] for name in (
        "watermarking", "spaces_between_special_tokens", "request_id", "session_id", "mm_payload",
        "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs")},
    **{name: _CHAT_TEMPLATE_EXTRAS[name] for name in ("media_io_kwargs", "mm_processor_kwargs")},
    **{name: _OPENAI_SERVICE[name] for name in ("moderation", "prompt_cache_key", "prompt_cache_options",
                                                "prompt_cache_retention", "safety_identifier", "service_tier")},
    **{name: Refused(_ON_CHAT, default) for name, default in (
        ("logit_bias", None), ("presence_penalty", None), ("frequency_penalty", None), ("stop", []),
        ("stop_token_ids", []), ("ignore_eos", False), ("skip_special_tokens", None),
        ("include_stop_str_in_output", False), ("structured_outputs", None), ("chat_template_kwargs", None))},
    "background_options": Refused("background responses are polled (GET /v1/responses/{id}), not streamed"),
    "conversation": Refused("no conversation objects: previous_response_id continues a stored response"),
    "context_management": Refused("no server-side compaction: send the items to keep in input"),
    "max_tool_calls": Refused("the client runs the tools: parallel_tool_calls=false allows one call per response"),
    "prompt": Refused("no stored prompt templates: send instructions and input"),
    "reasoning": SUPPORTED,
    "include_reasoning": Refused("reasoning is split out by --reasoning-parser: a server started without it returns "
                                 "the text whole", True),
    "truncation": Refused("the context is not truncated: an input too long is a 400", "disabled"),
    "enable_response_messages": SUPPORTED,
    "previous_input_messages": Refused("for harmony-format models only, which this server does not serve"),
    "stream_options": Refused("a streamed response always ends with response.completed, usage included"),
    "image": Refused("text output only"),
    "access_programs": Refused("no hosted programs run here"),
}

EMBEDDING_FIELDS = {
    **{name: SUPPORTED for name in ("model", "input", "encoding_format", "user", "normalize", "priority")},
    **{name: _ENGINE_EXTRAS[name] for name in ("truncation_side", "request_id", "cache_salt")},
    **_CHAT_TEMPLATE_EXTRAS,
    "dimensions": Refused("this model was not trained to give shorter vectors (Matryoshka): its vectors have "
                          "the full hidden size"),
    "padding": Refused("inputs are not padded: each is pooled over its own tokens"),
    "add_special_tokens": Refused("a text input gets the model's special tokens (BOS) as its tokenizer adds them: "
                                  "send token ids to choose them yourself", True),
    "use_activation": Refused("the pooler's normalization is set by normalize (or --pooler-config)"),
    **{name: SUPPORTED for name in ("messages", "add_generation_prompt", "continue_final_message",
                                    "chat_template_kwargs", "embed_dtype", "endianness", "truncate_prompt_tokens")},
}

TOKENIZE_COMPLETION_FIELDS = {name: SUPPORTED for name in ("model", "prompt", "add_special_tokens",
                                                           "return_token_strs")}

TOKENIZE_CHAT_FIELDS = {
    **{name: SUPPORTED for name in ("model", "messages", "tools", "add_generation_prompt", "continue_final_message",
                                    "chat_template_kwargs", "add_special_tokens", "return_token_strs")},
    **_CHAT_TEMPLATE_EXTRAS,
}

DETOKENIZE_FIELDS = {"model": SUPPORTED, "tokens": SUPPORTED}

# our request model's class name -> its table
FIELDS: dict[str, dict[str, str | Refused]] = {
    "CompletionRequest": COMPLETION_FIELDS,
    "ChatCompletionRequest": CHAT_FIELDS,
    "ResponsesRequest": RESPONSES_FIELDS,
    "EmbeddingRequest": EMBEDDING_FIELDS,
    "TokenizeCompletionRequest": TOKENIZE_COMPLETION_FIELDS,
    "TokenizeChatRequest": TOKENIZE_CHAT_FIELDS,
    "DetokenizeRequest": DETOKENIZE_FIELDS,
}


def refused_field_error(name: str, value: object, refused: Refused) -> PydanticCustomError:
    """The error `RequestModel` raises; errors.py turns its type into a 400 with `param` = the field."""
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    at = "" if refused.default is None else f" (or send {json.dumps(refused.default)})"
    reason = refused.reason[0].upper() + refused.reason[1:]
    message = f"{name}={shown}: not supported by this server. {reason}. Leave it out{at}."
    return PydanticCustomError("field_refused", message, {"field": name})


class RequestModel(BaseModel):
    """A request body checked against `FIELDS`: refused fields at their default are dropped, at any other value
    refused; a field in neither the model nor the table is an unknown field (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: object) -> object:
        table = FIELDS.get(cls.__name__)
        if not isinstance(data, dict) or table is None:
            return data
        kept = {}
        for name, value in data.items():
            entry = table.get(name)
            if not isinstance(entry, Refused) or name in cls.model_fields:
                kept[name] = value
            elif not is_default(value, entry.default):
                raise refused_field_error(name, value, entry)
        return kept
