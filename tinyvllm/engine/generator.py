"""Phase 1's view of the engine: one prompt in, its text streamed out token by token.

    prompt --tokenize--> ids --LLMEngine.add_request--> step() --> step() --> ... --> finished
                                                          |          |
                                                          +----------+--> text deltas (StreamChunk)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tinyvllm.plugins import provided
from tinyvllm.sampling_params import SamplingParams


@dataclass
class StreamChunk:
    """What one engine step adds to the output."""

    text: str  # newly printable text; may be '' (half a character, or held back for a stop string)
    token_id: int  # the token this step sampled
    finish_reason: str | None = None  # "stop" | "length" on the last chunk


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    time_to_first_token: float = 0.0  # seconds from the call to the first sampled token
    decode_time: float = 0.0  # seconds spent after the first token
    # of the decode: the steps that built a graph (or read one from disk), their seconds and tokens; not decoding
    graphs_built: int = 0
    build_time: float = 0.0
    build_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first, the steps that built a graph left out: their time is compiling."""
        tokens, seconds = len(self.token_ids) - 1 - self.build_tokens, self.decode_time - self.build_time
        return tokens / seconds if tokens > 0 and seconds > 0 else 0.0


class Generator:
    """One request at a time on an `LLMEngine`."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_args):
        from tinyvllm.engine.llm_engine import LLMEngine  # Phase 3's engine: imported when a Generator is built

        self.engine = LLMEngine(model, **engine_args)
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model(self):
        return self.engine.model

    @property
    def model_path(self):
        return self.engine.model_path

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode_prompt(self, prompt: str | list[int] | dict, chat: bool = False,
                      images: list | None = None) -> list[int] | dict:
        """The prompt's token ids; chat=True first wraps a text prompt in the model's chat template as a user turn.
        With `images`: the engine's prompt dict, each image at the prompt's next placeholder (before the prompt if
        it has none, as llama.cpp's mtmd-cli puts them), its tokens expanded."""
        if isinstance(prompt, dict):
            return prompt  # the engine checks it
        if not isinstance(prompt, str):
            return list(prompt)
        processor = self.engine.input_processor.multimodal
        if images and processor is None:
            raise ValueError("this model takes no images: give --image with a vision-language model")
        if images and processor.placeholder not in prompt:
            prompt = processor.placeholder * len(images) + prompt
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        if images:  # a template writes its own special tokens
            return processor.prompt_with_images(text, images, add_special_tokens=not chat)
        return self.tokenizer.encode(text, add_special_tokens=not chat)

    @staticmethod
    def read_images(paths: list[str] | None) -> list | None:
        """Image files to images: a ValueError naming a file that is missing or not a PNG, JPEG or WebP image."""
        if not paths:
            return None
        from tinyvllm.engine.multimodal import decode_image  # Phase 10

        images = []
        for path in paths:
            try:
                images.append(decode_image(Path(path).read_bytes()))
            except (OSError, ValueError) as e:
                raise ValueError(f"--image {path}: {e}") from None
        return images

    def warm_up(self, prompt_token_ids: list[int], params: SamplingParams, log=None) -> str:
        """Compile what the first token of a request of this length and kind needs (its prefill graph, its sampler)
        before the request is timed, on a prompt of other tokens (no prefix-cache hit). Returns the line it logs.
        The decode step's graph is built at the request's second token, so the first token does not wait for it;
        `GenerationResult.decode_tokens_per_s` leaves that step out."""
        install = provided("program_cache")  # Phase 6 keeps kernels on disk and counts them
        cache, runner = install() if install is not None else None, self.engine.model_runner
        before = (cache.lowered, cache.hits) if cache is not None else (0, 0)
        graphs = runner.num_graphs
        start = time.perf_counter()
        vocab = self.engine.model.config.vocab_size
        dummy = [(t + 1) % vocab for t in prompt_token_ids]
        self.generate(dummy, dataclasses.replace(params, max_tokens=1, min_tokens=0, ignore_eos=True, stop=None))
        kernels = (f"{cache.lowered - before[0]} kernels ({cache.hits - before[1]} from the cache) and "
                   if cache is not None else "")
        line = (f"compiled {kernels}{runner.num_graphs - graphs} graphs for the first "
                f"token in {time.perf_counter() - start:.1f} s")
        if log is not None:
            log(line)
        return line

    def stream(self, prompt: str | list[int] | dict, sampling_params: SamplingParams | None = None, *,
               chat: bool = False, result: GenerationResult | None = None) -> Iterator[StreamChunk]:
        """Yield the output as it is generated. Pass `result` to have it filled in along the way."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"Generator streams one completion, got n={params.n}: use LLM.generate for n > 1")
        start = time.perf_counter()
        request_id = f"stream-{next(self._request_ids)}"
        self.engine.add_request(request_id, self.encode_prompt(prompt, chat), params)  # ValueError on bad input
        result = result if result is not None else GenerationResult([])
        runner = self.engine.model_runner
        first_token_time = last_token_time = None
        finished = False
        try:
            while not finished:
                graphs = runner.num_graphs
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    now = time.perf_counter()
                    if first_token_time is None:
                        first_token_time = now
                        result.time_to_first_token = now - start
                    completion, finished = output.outputs[0], output.finished
                    if completion.finish_reason == "error":  # this request failed inside a step (the others went on)
                        raise RuntimeError(f"request {request_id} failed in the engine step: {output.error}")
                    if last_token_time is not None and runner.num_graphs > graphs:  # a step that built a graph
                        result.graphs_built += runner.num_graphs - graphs
                        result.build_time += now - last_token_time
                        result.build_tokens += len(completion.token_ids) - len(result.token_ids)
                    last_token_time = now
                    delta = completion.text[len(result.text):]
                    result.prompt_token_ids, result.token_ids = output.prompt_token_ids, completion.token_ids
                    result.text, result.finish_reason = completion.text, completion.finish_reason
                    result.decode_time = now - first_token_time
                    yield StreamChunk(delta, completion.token_ids[-1], completion.finish_reason)
        finally:
            if not finished:  # the caller stopped reading, or a step raised: give the blocks back
                self.engine.abort_request(request_id)

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                 chat: bool = False) -> GenerationResult:
        """Blocking: run the stream to its end and return everything at once."""
        result = GenerationResult([])
        for _ in self.stream(prompt, sampling_params, chat=chat, result=result):
            pass
        return result
