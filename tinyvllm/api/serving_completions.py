"""`POST /v1/completions`: a prompt in, its continuation out (OpenAI's legacy text API), streamed or joined.

Taught in docs/phases/09-api-server.md; the fields in 09-appendix-endpoints.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tinyvllm.api.errors import bad_request
from tinyvllm.api.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                   CompletionResponseChoice, CompletionStreamChoice, CompletionStreamResponse,
                                   UsageInfo)
from tinyvllm.api.serving_engine import (SSE_DONE, OpenAIServing, base_request_id, choice_deltas, last_output, sse,
                                        sse_error)
from tinyvllm.engine.beam_search import BeamSearchParams
from tinyvllm.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response | dict:
        model = self.check_model(request.model)
        self.check_limits(request)
        include_usage, continuous_usage = self.check_stream_options(request)
        width = self.best_of(request)  # samples per prompt
        num_logprobs = self.num_logprobs(request.logprobs, "logprobs")
        # vLLM's rule: the prompt's logprobs as asked, else with echo as many alternatives as the output's
        num_prompt_logprobs = self.num_prompt_logprobs(request, num_logprobs if request.echo else None)
        prompts = self.prompts(request.prompt, request.truncate_prompt_tokens, request.truncation_side)
        if len(prompts) > 1:  # all must be able to wait at once
            self.check_batch_width(len(prompts) * width)
        params_of = []
        for prompt_ids, _ in prompts:
            max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_tokens, "prompt")
            if request.use_beam_search:
                params_of.append(self.beam_search_params(request, max_tokens))
            else:  # best_of ranks by the samples' log-probabilities: the engine computes them
                logprobs = num_logprobs if width == request.n else (num_logprobs or 0)
                params_of.append(self.sampling_params(request, max_tokens, logprobs, self.structured_outputs(request),
                                                      prompt_logprobs=num_prompt_logprobs))
                if width != request.n:
                    params_of[-1] = dataclasses.replace(params_of[-1], n=width)

        request_id, created = f"cmpl-{base_request_id(raw_request)}", int(time.time())
        # 429 now, before any 200
        streams = [self.engine.add_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt_ids,
                                           params, request.priority)
                   for i, ((prompt_ids, _), params) in enumerate(zip(prompts, params_of))]
        stream = streams[0] if len(streams) == 1 else merged_outputs(request_id, streams, width)
        head = {"id": request_id, "created": created, "model": model}
        echo = [text if request.echo else "" for _, text in prompts]
        ends = list(itertools.accumulate(len(ids) for ids, _ in prompts))
        spans = list(zip([0, *ends[:-1]], ends))  # each prompt's place in the merged prompt_token_ids
        if request.stream:
            chunks = self.stream_chunks(stream, head, request, echo, spans, include_usage, continuous_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        final = await last_output(raw_request, stream)
        if final is None:  # the client left; nobody reads this
            return Response(status_code=499)
        billed = self.usage(final)  # every sample of best_of counts
        if width != request.n:
            final = best_of_choices(final, width, request.n)
        return self.full_response(final, head, request, echo, spans, billed)

    def best_of(self, request: CompletionRequest) -> int:
        """How many samples each prompt draws: best_of (>= n) where given, else n."""
        best_of = request.best_of
        if best_of is None or best_of == request.n:
            return request.n
        if best_of < request.n:
            raise bad_request(f"best_of must be at least n ({request.n}), got {best_of}", "best_of")
        if request.stream:
            raise bad_request("best_of cannot be streamed: the best samples are known only when all have finished",
                              "best_of")
        if request.use_beam_search:
            raise bad_request("best_of does not apply to beam search: n beams are already the n best", "best_of")
        if best_of > self.limits.max_n:
            raise bad_request(f"best_of must be at most {self.limits.max_n} on this server (--max-n), got {best_of}",
                              "best_of")
        return best_of

    def check_batch_width(self, total: int) -> None:
        max_waiting = self.engine.max_waiting
        if max_waiting is not None and total > max_waiting:
            raise bad_request(f"a batch of prompts x n = {total} requests can never be admitted: at most "
                              f"{max_waiting} requests may wait on this server (--max-waiting)", "prompt")
        self.engine.check_can_accept(total)

    def beam_search_params(self, request: CompletionRequest, max_tokens: int) -> BeamSearchParams:
        """n beams of up to max_tokens tokens (vLLM's `to_beam_search_params`); what beams cannot do is a 400."""
        for field in ("logprobs", "prompt_logprobs", "stop", "stop_token_ids", "logit_bias", "seed", "top_p", "top_k",
                      "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if getattr(request, field) is not None:
                raise bad_request(f"{field} does not apply to beam search (use_beam_search=true)", field)
        if self.structured_outputs(request) is not None:
            raise bad_request("structured outputs do not apply to beam search (use_beam_search=true)",
                              "use_beam_search")
        return BeamSearchParams(beam_width=request.n, max_tokens=max_tokens, ignore_eos=bool(request.ignore_eos),
                                temperature=request.temperature or 0.0, length_penalty=request.length_penalty)

    def prompts(self, prompt: str | list, keep: int | None = None, side: str | None = "left"
                ) -> list[tuple[list[int], str]]:
        """Token ids and text of each prompt: one text, one list of ids, or a batch (a list of either); `keep`,
        `side`: vLLM's truncate_prompt_tokens and truncation_side."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return [self.prompt(one, keep, side) for one in prompt]
        return [self.prompt(prompt, keep, side)]

    def prompt(self, prompt: str | list[int], keep: int | None = None, side: str | None = "left"
               ) -> tuple[list[int], str]:
        """Token ids and text of one prompt, given either way; only `keep` of its tokens when set."""
        if isinstance(prompt, str):
            if keep is None:  # a text too long for the context is refused before its tokenization
                self.check_prompt_chars(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            token_ids = prompt
        kept = self.check_token_ids(self.truncate_prompt(token_ids, keep, side), "prompt")
        if isinstance(prompt, str) and len(kept) == len(token_ids):
            return kept, prompt
        return kept, self.tokenizer.decode(kept)

    def full_response(self, final: RequestOutput, head: dict, request: CompletionRequest, echo: list[str],
                      spans: list[tuple[int, int]], billed: UsageInfo) -> dict:
        """`echo`: each prompt's text or ""; `spans`: each prompt's (start, end) in `final.prompt_token_ids`."""
        choices = []
        for completion in final.outputs:
            start, end = spans[completion.index // request.n]
            logprobs = None
            if request.logprobs is not None:
                logprobs, offset = self.echoed_logprobs(final, start, end, request)
                logprobs, _ = self.logprobs(completion.token_ids, completion.logprobs, request, offset, logprobs)
            prompt_logprobs = None
            if final.prompt_logprobs is not None:
                prompt_logprobs = self.prompt_logprobs(final.prompt_token_ids[start:end],
                                                       final.prompt_logprobs[start:end])
            ids = request.return_token_ids
            choices.append(CompletionResponseChoice(
                index=completion.index, text=echo[completion.index // request.n] + completion.text, logprobs=logprobs,
                finish_reason=completion.finish_reason, token_ids=list(completion.token_ids) if ids else None,
                prompt_logprobs=prompt_logprobs, prompt_token_ids=final.prompt_token_ids[start:end] if ids else None))
        return CompletionResponse(**head, choices=choices, usage=billed,
                                  metrics=self.request_metrics(final)).model_dump()

    async def stream_chunks(self, stream: AsyncIterator[RequestOutput], head: dict, request: CompletionRequest,
                            echo: list[str], spans: list[tuple[int, int]], include_usage: bool,
                            continuous_usage: bool) -> AsyncIterator[str]:
        text_offset: dict[int, int] = {}
        final = None
        ids = request.return_token_ids
        try:
            async for final, deltas in choice_deltas(stream):
                for delta in deltas:
                    start, end = spans[delta.index // request.n]
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = None
                        if delta.first:  # with echo: the prompt's logprobs open the choice, as its text does
                            logprobs, text_offset[delta.index] = self.echoed_logprobs(final, start, end, request)
                        logprobs, text_offset[delta.index] = self.logprobs(
                            delta.token_ids, delta.logprobs, request, text_offset.get(delta.index, 0), logprobs)
                    text = (echo[delta.index // request.n] if delta.first else "") + delta.text
                    choice = CompletionStreamChoice(
                        index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                        token_ids=delta.token_ids if ids else None,
                        prompt_token_ids=final.prompt_token_ids[start:end] if ids and delta.first else None)
                    so_far = self.usage(final) if continuous_usage else None
                    yield sse(CompletionStreamResponse(**head, choices=[choice], usage=so_far))
            if include_usage and final is not None:
                yield sse(CompletionStreamResponse(**head, choices=[], usage=self.usage(final),
                                                   metrics=self.request_metrics(final)))
        except Exception as e:  # after the 200: the error travels as an event
            yield sse_error(e)
        yield SSE_DONE

    def echoed_logprobs(self, final: RequestOutput, start: int, end: int,
                        request: CompletionRequest) -> tuple[CompletionLogProbs, int]:
        """With echo, the prompt's tokens and logprobs (the first one null; the prompt at `start:end` of the
        merged prompts), and the text offset after them; empty without echo."""
        if not request.echo:
            return CompletionLogProbs(), 0
        if final.prompt_logprobs is None:
            raise RuntimeError("the engine did not return the prompt logprobs it was asked for")
        return self.logprobs(final.prompt_token_ids[start:end], final.prompt_logprobs[start:end], request, 0)

    def logprobs(self, token_ids: list[int], logprobs: list | None, request: CompletionRequest, text_offset: int,
                 result: CompletionLogProbs | None = None) -> tuple[CompletionLogProbs, int]:
        """OpenAI's legacy logprobs, appended to `result`: parallel lists, one entry per token; top_logprobs maps
        token text to logprob, the sampled token first, `request.logprobs` alternatives."""
        result = CompletionLogProbs() if result is None else result
        as_id = bool(request.return_tokens_as_token_ids)
        for token_id, entry in zip(token_ids, logprobs or []):
            token = self.token_text(token_id, as_id)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(self.token_text(token_id))  # the offset counts the text, whatever the token shows
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            logprob, top = entry
            alternatives = {token: logprob}
            for other_id, other_logprob in top[:request.logprobs]:
                alternatives.setdefault(self.token_text(other_id, as_id), other_logprob)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(alternatives)
        return result, text_offset


def best_of_choices(final: RequestOutput, best_of: int, n: int) -> RequestOutput:
    """OpenAI's `best_of`: of each prompt's samples, the n of highest cumulative log-probability, best first."""
    chosen = []
    for start in range(0, len(final.outputs), best_of):
        samples = final.outputs[start:start + best_of]
        ranked = sorted(samples, key=lambda c: sum(logprob for logprob, _ in c.logprobs or []), reverse=True)
        chosen += [dataclasses.replace(c, index=start // best_of * n + k) for k, c in enumerate(ranked[:n])]
    return dataclasses.replace(final, outputs=chosen)


async def merged_outputs(request_id: str, streams: list[AsyncIterator[RequestOutput]],
                         n: int) -> AsyncIterator[RequestOutput]:
    """Several prompts' requests (n choices each) as one stream of cumulative outputs: completion k of prompt i
    becomes choice i * n + k, the prompts' ids one after another."""
    latest: list[RequestOutput | None] = [None] * len(streams)
    queue: asyncio.Queue = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))

    readers = [asyncio.ensure_future(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        while not all(output is not None and output.finished for output in latest):
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            latest[i] = item
            if any(output is None for output in latest):
                continue  # the prompts' ids line up only then
            outputs = [dataclasses.replace(c, index=j * n + c.index)
                       for j, output in enumerate(latest) if output is not None for c in output.outputs]
            prompt_logprobs = None
            if all(output.prompt_logprobs is not None for output in latest):
                prompt_logprobs = [entry for output in latest for entry in output.prompt_logprobs]
            yield RequestOutput(request_id, None, [t for output in latest for t in output.prompt_token_ids], outputs,
                                finished=all(output.finished for output in latest),
                                num_cached_tokens=sum(output.num_cached_tokens for output in latest),
                                prompt_logprobs=prompt_logprobs)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
