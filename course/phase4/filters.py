"""Phase 4, tasks apply_top_k and apply_top_p: the batch's sampling filters, on the device, each row its own value.

The engine calls them as `tinyvllm.sample.device_sampler.apply_top_k` and `.apply_top_p`, inside
`filter_thresholds`, the portable sampling graph the model runner replays every step (Phase 5's sampler kernel
takes over where the device has one). Both take and return (S, V) float32 logits; a token filtered out becomes
-inf, a token kept keeps its logit. No `.numpy()` inside: the filter is part of a captured graph, and only the
sampled token ids go back to the host. Chapter: docs/phases/04-batched-forward.md (section 6, "Build it").
Grade: make course P=4
"""

from __future__ import annotations

from tinygrad import Tensor


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """logits (S, V), top_k (S,) int32 -> logits with all but each row's k largest at -inf.

    A row keeps every logit >= its k-th largest finite logit (a tie at the k-th keeps all its members). top_k >=
    the row's number of finite logits means "off": the row is returned as it is. Hint: without a sort, find the
    k-th largest by bisection on the value v: "fewer than k logits are >= v" is false at or below the k-th largest
    and true above it; 32 halvings of [min, max + 1] are finer than float32's spacing, after which the smallest
    logit >= the low end is the k-th largest. `(logits >= v).sum(axis=-1, keepdim=True)`, `Tensor.where`,
    `.min(axis=-1, keepdim=True)` and `.isinf()` are all you need.
    """
    raise NotImplementedError("course/phase4/filters.py: apply_top_k is yours to write")


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """logits (S, V), top_p (S,) float32 in (0, 1] -> logits with all but each row's nucleus at -inf.

    The nucleus is the smallest set of most likely tokens whose probability (softmax of the row) reaches top_p:
    token t is kept when the mass of the tokens strictly more likely than t is < top_p (so the most likely token is
    always kept, and tokens tied with a kept token are kept too). top_p >= 1 means "off". Example: probabilities
    [0.5, 0.3, 0.2] with top_p 0.6 keep tokens 0 and 1 (the mass above token 2 is 0.8). Hint: as in apply_top_k, a
    bisection on the value finds the threshold, the smallest kept logit; keep `logits >= threshold`.
    """
    raise NotImplementedError("course/phase4/filters.py: apply_top_p is yours to write")
