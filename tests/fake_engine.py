"""A stand-in for `LLMEngine` with the same contract and no model, for the server's fast tests.

It schedules like the real one (waiting -> running under `max_num_seqs` and free KV blocks, one token
per running request per step, cumulative `RequestOutput`s, blocks freed on finish and abort), uses
the real tokenizer and text path (`TextStream`: detokenizer + stop strings), and picks tokens by a
fixed rule instead of a forward pass:

    greedy:  the words of WORDS in turn, starting at sum(prompt ids) % len, then the eos token
             (with `reply`: the tokens of that text, then the eos token, whatever the prompt)
    sampled: a word drawn by numpy from the request's seed (random without one)
    pooling: (PoolingParams) one output at the next step, `pooled` a unit vector made from the prompt's ids

Hooks for the tests: `gate` (clear it to hold the engine thread inside `step()`; `at_gate` says it
is held), `step_time`
(seconds one step takes), `fail_next_step`, and a record of steps and aborts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.parent_request import ParentRequests
from tinyvllm.engine.text_stream import TextStream
from tinyvllm.model.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.model.weights import default_model_path
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

WORDS = " one two three four five six seven eight nine ten red green blue"

_TOKENIZER: Tokenizer | None = None


def shared_tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(default_model_path())
    return _TOKENIZER


@dataclass
class FakeRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextStream
    rng: np.random.Generator
    metrics: RequestMetrics
    output: CompletionOutput = field(default_factory=lambda: CompletionOutput(0, "", []))
    num_blocks: int = 0


class FakeLLMEngine:
    def __init__(self, *, max_model_len: int = 256, block_size: int = 16, num_blocks: int = 64,
                 max_num_seqs: int = 8, step_time: float = 0.0, reply: str | None = None):
        self.tokenizer = shared_tokenizer()
        self.reply_ids = None if reply is None else self.tokenizer.encode(reply, add_special_tokens=False)
        self.model_name = "fake-smollm2"
        self.max_model_len, self.block_size, self.num_total_blocks = max_model_len, block_size, num_blocks
        self.input_processor = InputProcessor(self.tokenizer, max_model_len)  # the real checks' limits
        self.num_free_blocks = num_blocks
        self.max_num_seqs, self.step_time = max_num_seqs, step_time
        self.word_ids = self.tokenizer.encode(WORDS)
        assert len(self.word_ids) == len(WORDS.split()), "each word should be one token"
        self.waiting: deque[FakeRequest] = deque()
        self.running: list[FakeRequest] = []
        self.gate = threading.Event()
        self.gate.set()
        self.at_gate = threading.Event()  # set while a step waits for the gate
        self.fail_next_step = False
        self.num_steps = 0
        self.max_num_running = 0  # the largest batch any step ran
        self.aborted: list[str] = []
        self.parent_requests = ParentRequests()  # n > 1, fanned out as the real engine does
        self.pooling: dict[str, list[int]] = {}  # pooling requests, answered at the next step

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0):
        params = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt):
                raise ValueError("a token-id prompt must be a non-empty list of ids in the vocabulary")
            prompt_ids = list(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, over the context length {self.max_model_len}")
        in_use = {r.request_id for r in [*self.waiting, *self.running]} | set(self.pooling)
        if not isinstance(params, SamplingParams):  # PoolingParams (Phase 9)
            if request_id in in_use:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.pooling[request_id] = prompt_ids
            return
        text = prompt if isinstance(prompt, str) else None
        self.parent_requests.add(request_id, params, in_use=in_use.__contains__,
                                 add_child=lambda rid, child: self._add_one(rid, text, prompt_ids, child))

    def _add_one(self, request_id: str, text: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self.waiting.append(FakeRequest(request_id, text, prompt_ids, params,
                                        TextStream(self.tokenizer, params, prompt_ids),
                                        np.random.default_rng(params.seed), RequestMetrics(time.monotonic())))

    def step(self) -> list[RequestOutput]:
        if not self.gate.is_set():
            self.at_gate.set()
            assert self.gate.wait(timeout=60), "the test never opened the gate"
            self.at_gate.clear()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        if self.step_time:
            time.sleep(self.step_time)
        self._admit()
        self.num_steps += 1
        self.max_num_running = max(self.max_num_running, len(self.running))
        pooled = [self._pool(request_id, ids) for request_id, ids in self.pooling.items()]
        self.pooling.clear()
        return pooled + self.parent_requests.merge([self._generate_one(request) for request in list(self.running)])

    def _pool(self, request_id: str, prompt_ids: list[int]) -> RequestOutput:
        vector = np.cos(np.arange(8) + sum(prompt_ids))  # (8,): some vector that depends on the prompt
        now = time.monotonic()
        metrics = RequestMetrics(now, first_scheduled_time=now, first_token_time=now, finished_time=now)
        return RequestOutput(request_id, None, prompt_ids, [], finished=True, metrics=metrics,
                             pooled=(vector / np.linalg.norm(vector)).tolist())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            limit = min(len(request.prompt_token_ids) + (request.params.max_tokens or self.max_model_len),
                        self.max_model_len)
            blocks = math.ceil(limit / self.block_size)  # reserved up front: no preemption in the fake
            if blocks > self.num_free_blocks:
                return
            self.waiting.popleft()
            request.metrics.first_scheduled_time = time.monotonic()
            request.num_blocks, self.num_free_blocks = blocks, self.num_free_blocks - blocks
            self.running.append(request)

    def next_token(self, request: FakeRequest) -> int:
        if not request.params.is_greedy:
            return int(request.rng.choice(self.word_ids))
        if self.reply_ids is not None:
            k = len(request.output.token_ids)
            return self.reply_ids[k] if k < len(self.reply_ids) else self.tokenizer.eos_token_id
        position = sum(request.prompt_token_ids) % len(self.word_ids) + len(request.output.token_ids)
        return self.word_ids[position] if position < len(self.word_ids) else self.tokenizer.eos_token_id

    def _generate_one(self, request: FakeRequest) -> RequestOutput:
        token, out, params = self.next_token(request), request.output, request.params
        out.token_ids.append(token)  # the same lists grow step after step, as an engine's may
        if params.logprobs is not None:
            top = [(t, -1.0 - 0.5 * j) for j, t in enumerate(self.word_ids[: params.logprobs])]
            out.logprobs = (out.logprobs or []) + [(-0.25, top)]
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()
        stop_ids = params.all_stop_token_ids(self.tokenizer.stop_token_ids)
        if token in stop_ids and len(out.token_ids) >= params.min_tokens:
            out.finish_reason, out.stop_reason = "stop", token
        else:
            delta, stopped = request.text.add(token)
            if stopped:
                out.finish_reason, out.stop_reason = "stop", request.text.stop_str
            elif len(out.token_ids) >= (params.max_tokens or self.max_model_len) or \
                    len(request.prompt_token_ids) + len(out.token_ids) >= self.max_model_len:
                out.finish_reason = "length"
        if out.finished and request.text.stop_str is None:
            request.text.finish()
        out.text = request.text.text
        if out.finished:
            request.metrics.finished_time = time.monotonic()
            self._free(request)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:  # the first token has none: nothing predicts it
            top = [(t, -1.0 - 0.5 * j) for j, t in enumerate(self.word_ids[: params.prompt_logprobs])]
            prompt_logprobs = [None] + [(-0.75, top)] * (len(request.prompt_token_ids) - 1)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [out], out.finished,
                             request.metrics, prompt_logprobs=prompt_logprobs)

    def _free(self, request: FakeRequest) -> None:
        self.running.remove(request)
        self.num_free_blocks += request.num_blocks

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        ids = set(self.parent_requests.request_ids(request_id))
        self.parent_requests.forget(request_id)
        for request in list(self.running):
            if request.request_id in ids:
                self._free(request)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self.pooling.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.pooling)

    def get_stats(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_free_blocks": self.num_free_blocks, "num_total_blocks": self.num_total_blocks}


def run_all(engine, requests: dict, max_steps: int = 3000) -> dict:
    """Every request ({request id: (prompt, params)}) added at once and stepped to its end -> {request id: its final
    RequestOutput}. No request may stall, and every block is back in the engine's pool afterwards."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked from the engine's pool"
    return finals


def run_offline(engine, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
    """One request alone, stepped to its end: the reference a server's answer must equal."""
    request_id = f"offline-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    final = None
    for _ in range(10_000):
        for output in engine.step():
            if output.request_id == request_id:
                final = output
        if final is not None and final.finished:
            return final
    raise AssertionError("the offline request never finished")
