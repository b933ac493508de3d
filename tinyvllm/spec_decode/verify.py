"""Which draft tokens the target accepts (greedy): vLLM's rejection sampler with temperature 0.

The verify pass computes the request's last sampled token and its k draft tokens in one go, so the target's logits
at those 1 + k positions give its own choice for each of the next 1 + k tokens (argmax, as plain greedy decoding
would take). Draft j is kept while every draft before it was kept and it equals the target's choice at its
position; the first disagreement is replaced by the target's choice there (the run ends), and if all k agree
the target's choice after the last draft comes free (the bonus token):

    drafts      d0  d1  d2  d3           target argmax   t0  t1  t2  t3  t4
    d0 = t0, d1 = t1, d2 != t2  ->  emitted: t0 t1 t2   (2 accepted, 3 tokens from one forward pass)
    all equal                   ->  emitted: t0 t1 t2 t3 t4   (4 accepted + the bonus)

Every emitted token is what greedy decoding would have produced one step at a time, so the output is the same
token for token. Requests that sample (temperature > 0) take the exact rejection rule of Leviathan et al. 2023
instead, accept with min(1, p/q) (rejection_sampler.py); with temperature 0 it reduces to this comparison.
"""

from __future__ import annotations


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> tuple[list[int], int]:
    """(emitted tokens, number of drafts accepted). target_token_ids has one more entry than the drafts."""
    assert len(target_token_ids) == len(draft_token_ids) + 1, (
        f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} target tokens, got {len(target_token_ids)}")
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return list(target_token_ids[:accepted + 1]), accepted
