"""The offline batch API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tqdm import tqdm

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyvllm.engine.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **engine_args):
        self.llm_engine = LLMEngine(model, **engine_args)

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's dict, images in "multi_modal_data"); returns one
        RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params: "
                             "give one SamplingParams, or one per prompt")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities: give one per prompt")
        requests = [(f"generate-{id(self)}-{i}", prompt, params, rank)
                    for i, (prompt, params, rank) in enumerate(zip(prompts, sampling_params, priority))]
        return self._run_to_completion(requests, "generating", use_tqdm and len(prompts) >= 8)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate for a conversation (or a list of them) through the model's chat template (vLLM's `LLM.chat`);
        content may be parts: text, `image_url` (data:, http(s):) and `image_pil` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template_kwargs or {}) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> dict:
        """The engine's prompt for one conversation: the rendered text's ids, each image's placeholder expanded."""
        from tinyvllm.model.chat_template import content_text, template_messages, validate_messages

        tokenizer, processor = self.get_tokenizer(), self.llm_engine.input_processor.multimodal
        validate_messages(messages)
        images, read_image = [], None
        if processor is not None:
            from tinyvllm.engine.multimodal import MediaConnector  # Phase 10

            read_image = functools.partial(processor.add_image, images, MediaConnector(allow_remote_media=True))
        conversation = [{**m, "content": content_text(m["content"], f"messages[{i}]", read_image, ("image_url",
                         "image_pil")) if isinstance(m.get("content"), list) else m.get("content") or ""}
                        for i, m in enumerate(messages)]
        if tokenizer.chat_template is not None:
            conversation = template_messages(tokenizer.chat_template, conversation,
                                             None if processor is None else processor.placeholder)
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt, **template_kwargs)
        if images:  # the template wrote the special tokens
            return processor.prompt_with_images(text, images, add_special_tokens=False)
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    def _run_to_completion(self, requests: list[tuple], desc: str, show_progress: bool) -> list[RequestOutput]:
        """Add every (request_id, prompt, params, priority), step the engine until all finish, and return their
        final outputs in order."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, params, rank in requests:
                engine.add_request(request_id, prompt, params, priority=rank)
            with tqdm(total=len(requests), desc=desc, disable=not show_progress) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            for request_id, *_ in requests:
                engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id, *_ in requests]

    def beam_search(self, prompts: Sequence[str | list[int] | dict], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """One BeamSearchOutput per prompt, its `beam_width` sequences best first (vLLM's `LLM.beam_search`)."""
        from tinyvllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # Phase 7a

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [p.get("prompt", p.get("prompt_token_ids")) if isinstance(p, dict) else p for p in prompts]
        requests = [(f"beam-{id(self)}-{i}", prompt, params, 0) for i, prompt in enumerate(prompts)]
        results = []
        for out in self._run_to_completion(requests, "beam search", use_tqdm):
            results.append(BeamSearchOutput([
                BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.cumulative_logprob,
                                   c.cumulative_logprob / len(c.token_ids) ** params.length_penalty, c.text,
                                   c.finish_reason) for c in out.outputs]))
        return results
