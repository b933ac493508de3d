"""`n > 1`: one prompt, n completions, fanned out above the engine core (vLLM v1's `ParentRequest`).

    add_request("r", prompt, n=3)  -->  children "r-0", "r-1", "r-2"  (n=1 each)  -->  scheduler
    step() outputs of the children  -->  merge: RequestOutput("r", outputs=[c0, c1, c2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s own parameters: n=1, and seed + index when the request is seeded."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= 2**64:
            seed -= 2**64
    return dataclasses.replace(params, n=1, seed=seed)


@dataclasses.dataclass
class ParentRequest:
    request_id: str
    child_ids: list[str]
    latest: list[CompletionOutput]  # the newest output of each child

    error: str | None = None  # the first child's error: the whole request failed
    prompt_logprobs: list | None = None  # from the child that computed the prompt
    # (child id, params) added once the first has its prompt computed (prefix caching)
    pending: list[tuple[str, SamplingParams]] = dataclasses.field(default_factory=list)
    add_child: Callable[[str, SamplingParams], None] | None = None

    def merge(self, index: int, child: RequestOutput) -> RequestOutput:
        self.latest[index] = dataclasses.replace(child.outputs[0], index=index)
        self.error = self.error or child.error
        self.prompt_logprobs = self.prompt_logprobs or child.prompt_logprobs
        return RequestOutput(self.request_id, child.prompt, child.prompt_token_ids, list(self.latest),
                             finished=all(out.finished for out in self.latest), metrics=child.metrics,
                             error=self.error, num_cached_tokens=child.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs)


class ParentRequests:
    """The parents of fanned-out requests, found by their children's ids."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.child_of: dict[str, tuple[ParentRequest, int]] = {}  # child id -> (parent, index)

    def add(self, request_id: str, params: SamplingParams, add_child: Callable[[str, SamplingParams], None],
            in_use: Callable[[str], bool], share_prompt: bool = False) -> None:
        """Add a request through `add_child`: itself when n == 1, else its n children (`share_prompt`: the
        children after the first wait for its first output, then read the prompt from the cache)."""
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        if request_id in self.parents or any(in_use(rid) for rid in {request_id, *child_ids}):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n == 1:
            add_child(request_id, params)
            return
        parent = ParentRequest(request_id, child_ids, [CompletionOutput(i, "", []) for i in range(params.n)])
        self.parents[request_id] = parent
        for index, child_id in enumerate(child_ids):
            self.child_of[child_id] = (parent, index)
        children = [(child_id, child_params(params, index)) for index, child_id in enumerate(child_ids)]
        try:
            for child_id, child in children[:1] if share_prompt else children:
                add_child(child_id, child)
        except BaseException:
            self.forget(request_id)
            raise
        if share_prompt:
            parent.pending, parent.add_child = children[1:], add_child

    def request_ids(self, request_id: str) -> list[str]:
        """The engine-level ids behind a user's request id: its children added so far, or itself."""
        parent = self.parents.get(request_id)
        if parent is None:
            return [request_id]
        waiting = {child_id for child_id, _ in parent.pending}
        return [child_id for child_id in parent.child_ids if child_id not in waiting]

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs become their parent's (one merged output per parent per step)."""
        merged: dict[str, RequestOutput] = {}
        for output in outputs:
            found = self.child_of.get(output.request_id)
            if found is None:
                merged[output.request_id] = output
                continue
            parent, index = found
            self.release_pending(output.request_id)
            merged[parent.request_id] = parent.merge(index, output)
            if merged[parent.request_id].finished:
                self.forget(parent.request_id)
        return list(merged.values())

    def release_pending(self, child_id: str) -> None:
        """Add the children waiting for their parent's first child `child_id` (done, or aborted)."""
        found = self.child_of.get(child_id)
        if found is not None and found[1] == 0 and found[0].pending:
            parent = found[0]
            pending, parent.pending = parent.pending, []
            for pending_id, params in pending:
                parent.add_child(pending_id, params)

    def forget(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for child_id in parent.child_ids if parent is not None else []:
            self.child_of.pop(child_id, None)
