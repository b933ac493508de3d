"""`POST /v1/completions`: a prompt in, its continuation out (OpenAI's legacy text API).

    CompletionRequest --tokenize, check, SamplingParams--> engine.generate() --cumulative outputs-->
        stream=true:  one chunk per new token(s), each the text added since the last chunk, then [DONE]
        stream=false: the last output, whole

Both paths read the same stream of `RequestOutput`s: the streaming one sends differences, the
other waits for the end. `echo` puts the prompt in front of the text; `logprobs=k` returns, per
token, its log-probability and the k most likely alternatives. `response_format`, `structured_outputs`
and the `guided_*` fields constrain the text as on the chat route (see `serving_engine.py`).
`use_beam_search=true` (vLLM's extra) returns the n best beams instead of n samples, ranked with
`length_penalty`; they arrive at once, when the search ends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tinyvllm.api.errors import bad_request
from tinyvllm.api.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                   CompletionResponseChoice, CompletionStreamResponse)
from tinyvllm.api.serving_engine import (SSE_DONE, OpenAIServing, base_request_id, choice_deltas, last_output, sse,
                                        sse_error, usage)
from tinyvllm.engine.beam_search import BeamSearchParams
from tinyvllm.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response | dict:
        model = self.check_model(request.model)
        self.check_limits(request)
        include_usage = self.check_stream_options(request)
        if request.suffix is not None:
            raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n (for the n best beams: use_beam_search=true)", "best_of")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which this engine does not compute",
                              "echo")
        prompt_ids, prompt_text = self.prompt(request.prompt)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_tokens, "prompt")
        if request.use_beam_search:
            params = self.beam_search_params(request, max_tokens)
        else:
            params = self.sampling_params(request, max_tokens, request.logprobs, self.structured_outputs(request))

        request_id, created = f"cmpl-{base_request_id(raw_request)}", int(time.time())
        stream = self.engine.add_request(request_id, prompt_ids, params, request.priority)  # 429 now, before any 200
        head = {"id": request_id, "created": created, "model": model}
        echo = prompt_text if request.echo else ""
        if request.stream:
            chunks = self.stream_chunks(stream, head, echo, request.logprobs, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        final = await last_output(raw_request, stream)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return self.full_response(final, head, echo, request.logprobs)

    def beam_search_params(self, request: CompletionRequest, max_tokens: int) -> BeamSearchParams:
        """n beams of up to max_tokens tokens (vLLM's `to_beam_search_params`); what beams cannot do is a 400."""
        for field in ("logprobs", "stop", "stop_token_ids", "logit_bias", "seed", "top_p", "top_k", "min_p",
                      "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if getattr(request, field) is not None:
                raise bad_request(f"{field} does not apply to beam search (use_beam_search=true)", field)
        if self.structured_outputs(request) is not None:
            raise bad_request("structured outputs do not apply to beam search (use_beam_search=true)",
                              "use_beam_search")
        return BeamSearchParams(beam_width=request.n, max_tokens=max_tokens, ignore_eos=bool(request.ignore_eos),
                                temperature=request.temperature or 0.0, length_penalty=request.length_penalty)

    def prompt(self, prompt: str | list) -> tuple[list[int], str]:
        """Token ids and text of the one prompt, given either way."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"a batch of {len(prompt)} prompts is not supported: send one request per prompt "
                                  "(they run batched in the engine all the same)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            self.check_prompt_chars(prompt, "prompt")
            return self.tokenizer.encode(prompt), prompt
        token_ids = self.check_token_ids(prompt, "prompt")
        return token_ids, self.tokenizer.decode(token_ids)

    def full_response(self, final: RequestOutput, head: dict, echo: str, num_logprobs: int | None) -> dict:
        choices = []
        for completion in final.outputs:
            logprobs = None
            if num_logprobs is not None:
                logprobs, _ = self.logprobs(completion.token_ids, completion.logprobs, num_logprobs, 0)
            choices.append(CompletionResponseChoice(index=completion.index, text=echo + completion.text,
                                                    logprobs=logprobs, finish_reason=completion.finish_reason))
        return CompletionResponse(**head, choices=choices, usage=usage(final)).model_dump()

    async def stream_chunks(self, stream: AsyncIterator[RequestOutput], head: dict, echo: str,
                            num_logprobs: int | None, include_usage: bool) -> AsyncIterator[str]:
        text_offset: dict[int, int] = {}  # choice index -> where its next token starts in its text
        final = None
        try:
            async for final, deltas in choice_deltas(stream):
                for delta in deltas:
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs, text_offset[delta.index] = self.logprobs(
                            delta.token_ids, delta.logprobs, num_logprobs, text_offset.get(delta.index, 0))
                    text = (echo if delta.first else "") + delta.text
                    choice = CompletionResponseChoice(index=delta.index, text=text, logprobs=logprobs,
                                                      finish_reason=delta.finish_reason)
                    yield sse(CompletionStreamResponse(**head, choices=[choice]))
            if include_usage and final is not None:
                yield sse(CompletionStreamResponse(**head, choices=[], usage=usage(final)))
        except Exception as e:  # after the 200: the error travels as an event
            yield sse_error(e)
        yield SSE_DONE

    def logprobs(self, token_ids: list[int], logprobs: list | None, num_top: int,
                 text_offset: int) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy logprobs: parallel lists, one entry per token; top_logprobs maps token text to
        logprob (the sampled token first, then the `num_top` most likely)."""
        result = CompletionLogProbs()
        for token_id, (logprob, top) in zip(token_ids, logprobs or []):
            token = self.token_text(token_id)
            alternatives = {token: logprob}
            for other_id, other_logprob in top[:num_top]:
                alternatives.setdefault(self.token_text(other_id), other_logprob)
            result.tokens.append(token)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(alternatives)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset
