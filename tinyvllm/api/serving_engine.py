"""What every endpoint shares: the model check, the limits, the context check, request -> SamplingParams, SSE.

Taught in docs/phases/09-api-server.md, sections 2, 3 and 6.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cached_property

from fastapi import Request
from pydantic import BaseModel

from tinyvllm.api.errors import bad_request, model_not_found, to_openai_error
from tinyvllm.api.protocol import (PerRequestMetrics, PromptLogprob, PromptLogprobs, PromptTokensDetails,
                                   SamplingFields, UsageInfo)
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

# request fields passed to SamplingParams under the same name, when the client set them
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                   "skip_special_tokens", "include_stop_str_in_output")


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server, each a flag; over one: a 400 (413 for the body) naming it."""

    # 4 MiB is 32 bytes per token of a 128k-token context: any model's longest prompt fits, as ids or as JSON
    # text; a bigger body, parsed on the event loop, would stall every connection
    max_request_body_bytes: int = 4 * 2**20
    # seconds for the body after the headers: 4 MiB in 60 s is 70 KB/s, slower than any client worth waiting for
    body_read_timeout: float = 60.0
    # each choice is a sequence in the batch: 16 fills at most half the default --max-num-seqs 32 (OpenAI: 128)
    max_n: int = 16
    # stop strings are searched in every new piece of text, on the engine thread (OpenAI allows 4)
    max_stop_sequences: int = 16
    max_stop_length: int = 256  # characters; the stream also holds back up to this many

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_n", "max_stop_sequences", "max_stop_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.body_read_timeout, (int, float)) or not self.body_read_timeout > 0:
            raise ValueError(f"body_read_timeout must be > 0 seconds, got {self.body_read_timeout!r}")


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str] | None = None,
                 limits: ServerLimits | None = None, *, enable_prompt_tokens_details: bool = False,
                 enable_force_include_usage: bool = False, enable_per_request_metrics: bool = False):
        """The last three are vLLM's server flags: `usage.prompt_tokens_details` (the prefix cache's share of the
        prompt) in every answer; a stream's usage chunk even when the client did not ask for it; a request's own
        timings (`metrics`) on its answer or its stream's usage chunk."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.limits = limits or ServerLimits()
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.enable_force_include_usage = enable_force_include_usage
        self.enable_per_request_metrics = enable_per_request_metrics

    @property
    def tokenizer(self):
        return self.engine.get_tokenizer()

    def model_names(self) -> list[str]:
        """The names clients may ask for; the engine's own model name unless told otherwise."""
        return self.served_model_names or [self.engine.model_name]

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        self.engine.check_ready()
        names = self.model_names()
        if model is not None and model not in names:
            raise model_not_found(model, names)
        return names[0] if model is None else model

    def check_limits(self, request: SamplingFields) -> None:
        """The operator's limits on n and the stop strings (the body's is checked before parsing)."""
        n, max_waiting = request.n, self.engine.max_waiting
        if n > self.limits.max_n:
            raise bad_request(f"n must be at most {self.limits.max_n} on this server (--max-n), got {n}", "n")
        if max_waiting is not None and n > max_waiting:  # a 429 would never clear: say so instead
            raise bad_request(f"n={n} can never be admitted: each choice is one request, and at most {max_waiting} "
                              "requests may wait on this server (--max-waiting)", "n")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stop) > self.limits.max_stop_sequences:
            raise bad_request(f"stop may hold at most {self.limits.max_stop_sequences} strings on this server "
                              f"(--max-stop-sequences), got {len(stop)}", "stop")
        longest = max(map(len, stop), default=0)
        if longest > self.limits.max_stop_length:
            raise bad_request(f"each stop string may be at most {self.limits.max_stop_length} characters on this "
                              f"server (--max-stop-length), got one of {longest}", "stop")

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes any one token stands for (added tokens such as "<|im_start|>" included)."""
        return max(len(self.tokenizer.token_bytes(t)) for t in range(self.tokenizer.vocab_size))

    def check_prompt_chars(self, text: str, prompt_param: str) -> None:
        """Refuse a text that can't fit the context before tokenizing it: no token stands for more than
        `longest_token_bytes` characters, so a text of C characters has at least C / longest tokens."""
        limit = self.engine.max_model_len
        at_least = math.ceil(len(text) / self.longest_token_bytes)
        if at_least >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {prompt_param} has at least "
                f"{at_least} tokens ({len(text)} characters, and no token is longer than "
                f"{self.longest_token_bytes}). Shorten the {prompt_param}.", prompt_param)

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        """Prompt ids as vLLM's engine checks them (its wording), before the context check."""
        if not token_ids:
            raise bad_request("The decoder prompt cannot be empty", param)
        vocab_size = self.tokenizer.vocab_size
        outside = [t for t in (max(token_ids), min(token_ids)) if not 0 <= t < vocab_size]
        if outside:
            raise bad_request(f"Token id {outside[0]} is out of vocabulary (this model's ids are 0 to "
                              f"{vocab_size - 1})", param)
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {param} has {len(token_ids)} "
                f"tokens, which leaves no room for output. Shorten the {param}.", param)
        return token_ids

    def truncate_prompt(self, token_ids: list[int], keep: int | None, side: str | None = "left") -> list[int]:
        """vLLM's `truncate_prompt_tokens`: only `keep` of the prompt's tokens (-1: the context length's worth), its
        last ones, or its first with `truncation_side` "right"."""
        if keep is None:
            return token_ids
        limit = self.engine.max_model_len
        if keep > limit:
            raise bad_request("truncate_prompt_tokens value is greater than max_model_len. Please, select a smaller "
                              f"truncation size. (max_model_len is {limit})", "truncate_prompt_tokens")
        if keep == 0 or keep < -1:
            raise bad_request(f"truncate_prompt_tokens must be at least 1, or -1 for the model's context length "
                              f"({limit}), got {keep}", "truncate_prompt_tokens")
        keep = limit if keep == -1 else keep
        return token_ids[:keep] if side == "right" else token_ids[-keep:]

    def num_prompt_logprobs(self, request: SamplingFields, default: int | None = None) -> int | None:
        """How many alternatives each prompt token's logprob comes with: the request's `prompt_logprobs`, else
        `default` (what echo asks for); None: no prompt logprobs. vLLM's checks and wording."""
        k = request.prompt_logprobs
        if k is None:
            return self.num_logprobs(default, "prompt_logprobs", "prompt")
        if k < -1:
            raise bad_request("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        if request.stream and k != 0:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        return self.num_logprobs(k, "prompt_logprobs", "prompt")

    def num_logprobs(self, k: int | None, param: str, kind: str = "sample") -> int | None:
        """A request's count of logprobs alternatives, -1 meaning the whole vocabulary; a 400 past --max-logprobs."""
        if k is not None and k < -1:
            raise bad_request(f"`{param}` must be a positive value or -1.", param)
        try:
            return self.engine.num_logprobs(kind, k)
        except ValueError as e:
            raise bad_request(str(e), param) from e

    def prompt_logprobs(self, token_ids: list[int], entries: list) -> PromptLogprobs:
        """The engine's prompt logprobs in vLLM's shape: None for the first token, then per token {id: logprob,
        rank, decoded_token} for the prompt's token and its top alternatives."""
        result: PromptLogprobs = []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                result.append(None)
                continue
            logprob, top = entry
            known = dict([(token_id, logprob), *top])  # every token whose logprob the engine returned here
            more_likely = sorted(-other for other in known.values())  # bisect: how many known ones beat a logprob
            lowest_top = min((other for _, other in top), default=math.inf)
            result.append({token: self.prompt_logprob(token, value, more_likely,
                                                      ranked=token != token_id or value >= lowest_top)
                           for token, value in known.items()})
        return result

    def prompt_logprob(self, token_id: int, logprob: float, more_likely: list[float], ranked: bool) -> PromptLogprob:
        """One entry; its rank counts the tokens more likely (vLLM's rule). Those are all known for a top
        alternative, and for the prompt's token unless it falls below every top alternative (rank None then)."""
        rank = 1 + bisect.bisect_left(more_likely, -logprob) if ranked else None
        # -9999 for -inf, as vLLM's clamp_prompt_logprobs: JSON has no infinity
        return PromptLogprob(logprob=max(logprob, -9999.0), rank=rank, decoded_token=self.token_text(token_id))

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int:
        """Check that prompt + output fit the context; None means all the room that is left."""
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {prompt_param} has "
                f"{num_prompt_tokens} tokens, which leaves no room for output. Shorten the {prompt_param}.",
                prompt_param)
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens < 1:
            raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the {prompt_param}, {max_tokens} for the output). "
                f"Shorten the {prompt_param} or lower {max_tokens_param}.", max_tokens_param)
        return max_tokens

    def sampling_params(self, request: SamplingFields, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None, prompt_logprobs: int | None = None,
                        **defaults) -> SamplingParams:
        """`defaults`: values the server picks for fields the client left unset."""
        fields = {name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None}
        if request.logit_bias:
            fields["logit_bias"] = self.parse_logit_bias(request.logit_bias)
        try:
            params = SamplingParams(**{**defaults, **fields}, max_tokens=max_tokens, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs)
        except ValueError as e:
            field = re.match(r"\w+", str(e))
            raise bad_request(str(e), field.group() if field else None) from e
        self.check_stop_token_ids(params)
        return params

    def check_stop_token_ids(self, params: SamplingParams) -> None:
        """400s the engine would find only after a 200: stop ids outside the vocabulary, or covering all of it
        while min_tokens holds stop tokens back."""
        vocab_size = self.tokenizer.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}) for this model, got {bad[:5]}",
                              "stop_token_ids")
        if params.min_tokens > 0 and len(params.all_stop_token_ids(self.tokenizer.stop_token_ids)) >= vocab_size:
            raise bad_request(f"stop_token_ids (with the model's end-of-sequence tokens) cover every token of the "
                              f"vocabulary, so none could be sampled while min_tokens ({params.min_tokens}) holds "
                              "stop tokens back: remove some stop_token_ids, or set min_tokens to 0", "stop_token_ids")

    def structured_outputs(self, request: SamplingFields,
                           forced: tuple[str, StructuredOutputsParams] | None = None) -> StructuredOutputsParams | None:
        """The request's one output constraint, checked to compile, or None; `forced`: the server's own (a forced
        tool call), with its field's name."""
        given = []
        for field, kwargs in self._constraints(request):
            try:
                given.append((field, StructuredOutputsParams(**kwargs)))
            except ValueError as e:
                raise bad_request(str(e), field) from e
        if forced is not None:
            given.append(forced)
        if len(given) > 1:
            names = ", ".join(field for field, _ in given)
            raise bad_request(f"only one output constraint may be given, got {names}", given[1][0])
        if not given:
            return None
        field, params = given[0]
        error = grammar_error(params)
        if error:
            raise bad_request(f"{field} does not compile: {error}", field)
        return params

    @staticmethod
    def _constraints(request: SamplingFields) -> list[tuple[str, dict]]:
        """(field, StructuredOutputsParams' arguments) for each constraint the request sets."""
        found = []
        response_format = request.response_format
        if response_format is not None and response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        if response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise bad_request('response_format of type "json_schema" needs "json_schema": {"name", "schema"}',
                                  "response_format")
            schema = response_format.json_schema.schema_
            found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        if request.structured_outputs is not None:
            so = request.structured_outputs
            found.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                                 "grammar": so.grammar, "json_object": so.json_object}))
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(request, field) is not None:
                found.append((field, {kind: getattr(request, field)}))
        return found

    def parse_logit_bias(self, logit_bias: dict[str, float]) -> dict[int, float]:
        """{"1234": bias} -> {1234: bias}; a 400 naming every key that is not a token id (at most 5 shown)."""
        vocab = self.tokenizer.vocab_size
        bad = [key for key in logit_bias if re.fullmatch(r"[0-9]+", key) is None or len(key) > len(str(vocab))
               or int(key) >= vocab]
        if bad:
            shown = ", ".join(repr(k if len(k) <= 20 else f"{k[:20]}... ({len(k)} characters)") for k in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise bad_request(f"logit_bias keys must be token ids written as integer strings, in [0, {vocab}) "
                              f"(e.g. {{\"1234\": -100}}), got {shown}{more}", "logit_bias")
        return {int(key): bias for key, bias in logit_bias.items()}

    def check_stream_options(self, request: SamplingFields) -> tuple[bool, bool]:
        """Whether the stream ends with a usage chunk, and whether every chunk carries the usage so far (vLLM's
        `continuous_usage_stats`); --enable-force-include-usage turns both on, as in vLLM."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        options = request.stream_options
        if self.enable_force_include_usage:
            return request.stream, request.stream
        if options is None:
            return False, False
        include = bool(options.include_usage)
        return include, include and bool(options.continuous_usage_stats)

    def request_metrics(self, final: RequestOutput) -> PerRequestMetrics | None:
        """vLLM's per-request timings for a finished request of one choice; None unless the server asks for them."""
        times = final.metrics
        if not self.enable_per_request_metrics or len(final.outputs) != 1 or times is None:
            return None
        scheduled, first, last = times.first_scheduled_time, times.first_token_time, times.finished_time
        tokens = len(final.outputs[0].token_ids)
        metrics = PerRequestMetrics()
        if scheduled is not None:
            metrics.queue_time_ms = max(scheduled - times.arrival_time, 0.0) * 1000
        if scheduled is not None and first is not None:
            metrics.time_to_first_token_ms = max(first - scheduled, 0.0) * 1000
        if first is not None and last is not None:
            metrics.generation_time_ms = max(last - first, 0.0) * 1000
            if tokens > 1:
                metrics.mean_itl_ms = metrics.generation_time_ms / (tokens - 1)
        if scheduled is not None and last is not None and last > scheduled:
            metrics.tokens_per_second = tokens / (last - scheduled)
        return metrics

    def usage(self, output: RequestOutput, opening: bool = False) -> UsageInfo:
        """The prompt counted once however many choices share it, as OpenAI bills it; `opening`: before the first
        token (a stream's first chunk). The prefix cache's share with --enable-prompt-tokens-details."""
        prompt_tokens = len(output.prompt_token_ids)
        completion_tokens = 0 if opening else sum(len(completion.token_ids) for completion in output.outputs)
        details = None
        if self.enable_prompt_tokens_details:
            details = PromptTokensDetails(cached_tokens=output.num_cached_tokens)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """A token as text for logprobs; a token that is part of a character shows its bytes; `as_id`: vLLM's
        `return_tokens_as_token_ids`, "token_id:123"."""
        if as_id:
            return f"token_id:{token_id}"
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" for b in raw)


@dataclass
class ChoiceDelta:
    """What one choice gained since the previous output: what a stream chunk carries."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list  # (logprob, top alternatives) per new token
    finish_reason: str | None
    first: bool


async def choice_deltas(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[RequestOutput, list[ChoiceDelta]]]:
    """Cumulative outputs in, differences out (a choice with nothing new is left out)."""
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    async for output in stream:
        deltas = []
        for completion in output.outputs:
            i, start = completion.index, sent_tokens.get(completion.index, 0)
            if i in finished or (i in sent_tokens and start == len(completion.token_ids) and not completion.finished):
                continue
            deltas.append(ChoiceDelta(i, completion.text[sent_chars.get(i, 0):], completion.token_ids[start:],
                                      (completion.logprobs or [])[start:], completion.finish_reason,
                                      i not in sent_tokens))
            sent_chars[i], sent_tokens[i] = len(completion.text), len(completion.token_ids)
            if completion.finished:
                finished.add(i)
        yield output, deltas


def grammar_error(params: StructuredOutputsParams) -> str:
    """Why the constraint's grammar does not compile, or "" when it does."""
    from llguidance import LLMatcher

    from tinyvllm.sample.structured_output import grammar_limits, grammar_of

    try:
        return LLMatcher.validate_grammar(grammar_of(params), limits=grammar_limits())
    except ValueError as e:
        return str(e)


def base_request_id(raw_request: Request | None) -> str:
    """The client's `X-Request-Id` where it sent one (vLLM's rule), else a fresh one."""
    header = None if raw_request is None else raw_request.headers.get("x-request-id")
    return header or uuid.uuid4().hex


def sse(chunk: BaseModel | dict | str) -> str:
    """One server-sent event."""
    if isinstance(chunk, BaseModel):
        exclude = {"usage"} if getattr(chunk, "usage", 0) is None else None
        chunk = chunk.model_dump_json(exclude=exclude)
    elif isinstance(chunk, dict):
        chunk = json.dumps(chunk)
    return f"data: {chunk}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    """An error after the 200 and the first chunks went out: the status can't change, so it is an event."""
    return sse(to_openai_error(e).body())


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def last_output(request: Request, stream) -> RequestOutput | None:
    """The non-streaming path joins the stream: its last output, or None if the client left first (aborted)."""

    async def consume() -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        return final

    consumer = asyncio.ensure_future(consume())
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not consumer.done():
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
    return None if consumer.cancelled() else consumer.result()
