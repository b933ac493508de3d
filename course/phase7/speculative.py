"""Phase 7b, tasks accept_greedy and find_ngram_drafts: speculative decoding's verify step at temperature 0, and
prompt lookup, the proposer that drafts from the request's own tokens.

The engine calls them as `tinyvllm.spec_decode.verify.accept_greedy` (the speculator, for every greedy request
that drafted, after the target's forward pass) and `tinyvllm.spec_decode.ngram_proposer.find_ngram_drafts`
(`NgramProposer.propose`, each step, with `--speculative-config '{"method": "ngram", ...}'`). Plain Python lists
(numpy if you like). Chapter: docs/phases/07b-speculative-decoding.md (sections 3 and 5, "Build it").
Grade: make course P=7
"""

from __future__ import annotations


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> tuple[list[int], int]:
    """(the tokens emitted this step, how many drafts were accepted).

    target_token_ids[i] is the target model's argmax after the request's tokens and drafts 0..i-1, so it has one
    more entry than the drafts. Accept drafts while they equal the target's choice; the first that differs is
    replaced by the target's choice, and if every draft agrees, the target's last choice comes free (the bonus):

        drafts [5, 6, 7], targets [5, 6, 9, 4]  ->  ([5, 6, 9], 2)
        drafts [5, 6, 7], targets [5, 6, 7, 4]  ->  ([5, 6, 7, 4], 3)
        drafts [],        targets [8]           ->  ([8], 0)

    Emitted tokens always come from the target: the output is what greedy decoding without drafts gives.
    """
    raise NotImplementedError("course/phase7/speculative.py: accept_greedy is yours to write")


def find_ngram_drafts(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens to propose after `token_ids`, or [] when none.

    Take the longest suffix of token_ids, of n tokens with max_n >= n >= min_n (and n < len(token_ids)), that
    also occurs earlier in token_ids; at its earliest earlier occurrence, the (up to) k tokens that followed it
    are the draft. Longer suffixes first: the first n that recurs wins.

        token_ids [1, 2, 3, 4, 1, 2], k 2, n in [1, 3]  ->  [3, 4]   (the suffix [1, 2] recurs at 0)
        token_ids [7, 8, 9], k 2, n in [1, 2]           ->  []       (no suffix recurs)

    k <= 0 drafts nothing. An occurrence may overlap the suffix itself ([5, 5, 5], n 2: the [5, 5] at 0).
    """
    raise NotImplementedError("course/phase7/speculative.py: find_ngram_drafts is yours to write")
