"""Greedy acceptance, vLLM's rejection sampler at temperature 0 (docs/phases/07b-speculative-decoding.md, section 3).

    drafts      d0  d1  d2  d3           target argmax   t0  t1  t2  t3  t4
    d0 = t0, d1 = t1, d2 != t2  ->  emitted: t0 t1 t2   (2 accepted, 3 tokens from one forward pass)
    all equal                   ->  emitted: t0 t1 t2 t3 t4   (4 accepted + the bonus)
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
