"""Beam search above the engine core, as in vLLM v1: one ordinary one-token request per running beam per step.

Taught in docs/phases/07a-prefix-caching.md, section 6; the rules and vLLM's differences in
07a-appendix-beam-search.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.core.outputs import EngineCoreOutput
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sample.sampler import full_logprobs
from tinyvllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, plus HF's `early_stopping` (True, False or "never"; False as in HF). `temperature`
    > 0 divides the logits before the log-softmax; 0 leaves them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    @property
    def n(self) -> int:
        """Completions returned: one per beam (what a server counts against its queue)."""
        return self.beam_width


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's): prompt and generated tokens, the cumulative log-probability, the text of the
    generated tokens (an ending eos left out), and its score."""

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Hypothesis:
    score: float  # cum_logprob / generated_length ** length_penalty
    tokens: list[int]  # generated tokens
    cum_logprob: float


class BeamSearch:
    """The beams of one prompt, as plain lists: `step` takes each running beam's log-probabilities and answers
    which (parent beam, token) pairs run on."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int], max_new_tokens: int):
        self.params, self.eos_token_ids = params, set() if params.ignore_eos else set(eos_token_ids)
        self.max_new_tokens = min(params.max_tokens, max_new_tokens)  # max_model_len may cap it
        self.running: list[tuple[list[int], float]] = [([], 0.0)]  # (generated tokens, cum_logprob); one at first
        self.finished: list[Hypothesis] = []  # the k best, best first (HF's `sequences` / `beam_scores`)
        self.improvement_possible = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(self, logprobs: list[np.ndarray]) -> list[tuple[int, int]]:
        """logprobs[b]: (vocab,) log-probabilities of running beam b's next token. Returns the new running beams as
        (parent beam index, token), best first; none once `done`."""
        k, lp, p = self.params.beam_width, self.params.length_penalty, self.params
        assert not self.done and len(logprobs) == len(self.running)
        scores = np.stack([cum + row.astype(np.float64) for (_, cum), row in zip(self.running, logprobs)])
        num_keep = min(max(2, 1 + len(self.eos_token_ids)) * k, scores.size)
        flat = scores.reshape(-1)
        top = np.argpartition(-flat, num_keep - 1)[:num_keep]
        top = top[np.lexsort((top, -flat[top]))]  # best first; ties by beam, then token (torch.topk: unspecified)
        vocab = scores.shape[1]
        gen_len = len(self.running[0][0]) + 1  # generated tokens once this step's token is added
        candidates = [(float(flat[i]), int(i // vocab), int(i % vocab)) for i in top]
        ends = [token in self.eos_token_ids or gen_len >= self.max_new_tokens for _, _, token in candidates]

        # finished hypotheses: candidates among the top k that end their beam (HF's _update_finished_beams)
        full = len(self.finished) == k and p.early_stopping is True
        if not full and self.improvement_possible:
            new = [Hypothesis(score / gen_len ** lp, self.running[b][0] + [token], score)
                   for rank, ((score, b, token), end) in enumerate(zip(candidates, ends)) if rank < k and end]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:k]  # stable: older first on ties

        # the running beams: the best k candidates that do not end (HF's _get_running_beams_for_next_iteration)
        order = sorted(range(len(candidates)), key=lambda i: (ends[i], i))[:k]
        next_running = [(self.running[candidates[i][1]][0] + [candidates[i][2]], candidates[i][0]) for i in order]
        chosen = [(candidates[i][1], candidates[i][2]) for i in order]

        # can the running beams still improve on the worst hypothesis? (HF's _check_early_stop_heuristic)
        best_len = self.max_new_tokens if p.early_stopping == "never" and lp > 0 else gen_len
        best_running = next_running[0][1] - (1e9 if ends[order[0]] else 0.0)
        if len(self.finished) == k:
            self.improvement_possible &= best_running / best_len ** lp > self.finished[-1].score
        self.done = (not self.improvement_possible or (len(self.finished) == k and p.early_stopping is True)
                     or all(ends))
        self.running = [] if self.done else next_running
        return [] if self.done else chosen


# what each beam's request asks of the core: one token (never used) and every token's logprobs
BEAM_STEP_PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=-1)


@dataclass
class BeamSearchRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    search: BeamSearch
    children: list[str]  # this step's requests, one per running beam, in the search's order
    logprobs: dict[str, np.ndarray] = field(default_factory=dict)  # child id -> its beam's next-token logprobs
    metrics: RequestMetrics | None = None


class BeamSearchRequests:
    """The engine's beam searches over the engine core's `add_request` and `abort_requests`."""

    def __init__(self, add_request: Callable[[str, list[int], SamplingParams], None],
                 abort_requests: Callable[[list[str]], None], tokenizer, max_model_len: int):
        self.add_request, self.abort_requests = add_request, abort_requests
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.requests: dict[str, BeamSearchRequest] = {}
        self.request_of: dict[str, BeamSearchRequest] = {}  # a beam's request id -> its search
        self._next_id = 0

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
            metrics: RequestMetrics) -> None:
        search = BeamSearch(params, set(self.tokenizer.stop_token_ids), self.max_model_len - len(prompt_token_ids))
        request = BeamSearchRequest(request_id, prompt, list(prompt_token_ids), search, [], metrics=metrics)
        self.requests[request_id] = request
        self._add_children(request)

    def _add_children(self, request: BeamSearchRequest) -> None:
        """One request per running beam: its prompt is the search's prompt and the beam's tokens."""
        request.children = []
        for tokens, _ in request.search.running:
            self._next_id += 1
            child_id = f"{request.request_id}#beam{self._next_id}"
            self.request_of[child_id] = request
            request.children.append(child_id)
            self.add_request(child_id, request.prompt_token_ids + tokens, BEAM_STEP_PARAMS)

    def owns(self, request_id: str) -> bool:
        return request_id in self.request_of

    def take(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """(the outputs that are not the beams', the RequestOutputs of the searches that finished this step)."""
        rest, finished = [], []
        for out in outputs:
            request = self.request_of.get(out.request_id)
            if request is None:
                rest.append(out)
            elif out.error is not None:
                finished.append(self.fail(request.request_id, out.error))
            elif out.new_logprobs:
                del self.request_of[out.request_id]
                request.logprobs[out.request_id] = self._beam_logprobs(request, out.new_logprobs[0])
                request.metrics.first_scheduled_time = (request.metrics.first_scheduled_time
                                                        or out.first_scheduled_time)
                if len(request.logprobs) == len(request.children):
                    finished += self._step(request)
        return rest, finished

    @staticmethod
    def _beam_logprobs(request: BeamSearchRequest, logprobs: np.ndarray) -> np.ndarray:
        """The beam's log-probabilities: with a temperature, those of logits / temperature (vLLM's)."""
        temperature = request.search.params.temperature
        return full_logprobs(logprobs / temperature) if temperature > 0 else logprobs

    def _step(self, request: BeamSearchRequest) -> list[RequestOutput]:
        """Every beam has its row: the search chooses the next beams, or ends."""
        request.metrics.first_token_time = request.metrics.first_token_time or time.monotonic()
        request.search.step([request.logprobs[child_id] for child_id in request.children])
        request.logprobs = {}
        if request.search.done:
            return [self._finish(request)]
        self._add_children(request)
        return []

    def _finish(self, request: BeamSearchRequest) -> RequestOutput:
        del self.requests[request.request_id]
        completions = []
        for index, hyp in enumerate(request.search.finished):
            ended_by_eos = bool(hyp.tokens) and hyp.tokens[-1] in request.search.eos_token_ids
            text_ids = hyp.tokens[:-1] if ended_by_eos else hyp.tokens
            completions.append(CompletionOutput(index, self.tokenizer.decode(text_ids), list(hyp.tokens),
                                                "stop" if ended_by_eos else "length",
                                                cumulative_logprob=hyp.cum_logprob))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished=True, metrics=request.metrics)

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """End a beam search with an error (its beams' requests aborted)."""
        request = self.requests[request_id]
        self.abort(request_id)
        request.metrics.finished_time = time.monotonic()
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [CompletionOutput(0, "", [], "error")], finished=True, metrics=request.metrics,
                             error=error)

    def abort(self, request_id: str) -> bool:
        """Drop a beam search and abort its beams' requests. False if there is no such search."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        waiting = [child_id for child_id in request.children if self.request_of.pop(child_id, None) is not None]
        self.abort_requests(waiting)
        return True
