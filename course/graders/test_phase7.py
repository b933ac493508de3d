"""Phase 7's graders: the prefix cache's chained block hashes (7a), greedy draft acceptance and prompt lookup (7b),
and the 8-bit KV cache's per-token scales (7c) (course/phase7/). Plain Python, and tiny tensors for 7c."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tinyvllm.attention import kv_quant, paged
from tinyvllm.attention.kv_cache import KV_CACHE_DTYPES
from tinyvllm.core import prefix_cache
from tinyvllm.core.prefix_cache import NONE_HASH, hash_block_tokens
from tinyvllm.core.sequence import Sequence
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode import ngram_proposer, verify
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.spec_decode.proposer import DraftRequest

# ---- block_hashes (7a) ----


@pytest.mark.task("block_hashes")
def test_full_blocks_are_hashed_and_chained():
    tokens = list(range(10, 20))  # 10 tokens, blocks of 4: two full blocks, the last 2 tokens not hashed
    got = prefix_cache.block_hashes(tokens, 4, [])
    h0 = hash_block_tokens(NONE_HASH, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    assert len(got) == 2, f"10 tokens in blocks of 4: 2 full blocks to hash (the third is partial), got {len(got)}"
    assert got[0] == h0, "block 0's parent is NONE_HASH: hash_block_tokens(NONE_HASH, tokens[0:4])"
    assert got[1] == h1, "block 1's parent is block 0's hash: hash_block_tokens(got[0], tokens[4:8])"


@pytest.mark.task("block_hashes")
def test_known_hashes_are_extended_not_recomputed():
    tokens = list(range(12))
    known = [b"an earlier block's hash"]
    got = prefix_cache.block_hashes(tokens, 4, known)
    assert got is known, "block_hashes extends `known` in place and returns it"
    assert got[0] == b"an earlier block's hash", "a hash in `known` is kept as it is, not computed again"
    assert got[1:] == [hash_block_tokens(known[0], tokens[4:8]), hash_block_tokens(got[1], tokens[8:12])], (
        "the hashes after the known ones chain from the last known hash")


@pytest.mark.task("block_hashes")
def test_extra_keys_and_the_sequence():
    tokens = list(range(8))
    plain, keyed = prefix_cache.block_hashes(tokens, 4, []), prefix_cache.block_hashes(tokens, 4, [], ("lora", 1))
    assert plain[0] != keyed[0], "extra_keys (an adapter, a salt) must go into every block's hash"
    seq = Sequence(0, tokens + [99])
    got = seq.block_hashes(4)
    assert got == plain, f"Sequence.block_hashes (what the block manager asks) should give {len(plain)} hashes"


# ---- accept_greedy (7b) ----

@pytest.mark.task("accept_greedy")
def test_drafts_are_accepted_until_the_first_miss():
    got = verify.accept_greedy([5, 6, 7], [5, 6, 9, 4])
    assert got == ([5, 6, 9], 2), f"drafts [5, 6, 7], targets [5, 6, 9, 4]: accept 5, 6, then the target's 9; got {got}"
    got = verify.accept_greedy([3, 6], [4, 6, 1])
    assert got == ([4], 0), f"drafts [3, 6], targets [4, 6, 1]: the first draft misses, emit the target's 4; got {got}"


@pytest.mark.task("accept_greedy")
def test_all_accepted_gives_the_bonus_token():
    got = verify.accept_greedy([5, 6, 7], [5, 6, 7, 4])
    assert got == ([5, 6, 7, 4], 3), f"every draft agrees: 3 accepted plus the target's bonus 4; got {got}"
    got = verify.accept_greedy([], [8])
    assert got == ([8], 0), f"no drafts: the target's token alone; got {got}"


# ---- find_ngram_drafts (7b) ----

@pytest.mark.task("find_ngram_drafts")
def test_the_longest_recurring_suffix_proposes():
    got = ngram_proposer.find_ngram_drafts([1, 2, 3, 4, 1, 2], 2, 1, 3)
    assert got == [3, 4], f"[1, 2, 3, 4, 1, 2]: the suffix [1, 2] recurs at 0, followed by 3, 4; got {got}"
    got = ngram_proposer.find_ngram_drafts([9, 1, 5, 2, 1, 2, 7, 1, 2], 3, 1, 2)
    assert got == [7, 1, 2], (f"[9, 1, 5, 2, 1, 2, 7, 1, 2], n up to 2: [1, 2] recurs first at 4 (followed by 7, 1, "
                              f"2); the 1-gram [2] would recur earlier, but longer suffixes win; got {got}")


@pytest.mark.task("find_ngram_drafts")
def test_the_earliest_occurrence_and_the_bounds():
    got = ngram_proposer.find_ngram_drafts([4, 8, 4, 9, 4], 1, 1, 1)
    assert got == [8], f"[4, 8, 4, 9, 4]: [4] recurs at 0 and 2, the earliest (0) proposes 8; got {got}"
    got = ngram_proposer.find_ngram_drafts([7, 8, 9], 2, 1, 2)
    assert got == [], f"[7, 8, 9]: no suffix recurs, nothing to propose; got {got}"
    got = ngram_proposer.find_ngram_drafts([1, 2, 3, 1, 2], 2, 3, 4)
    assert got == [], f"[1, 2, 3, 1, 2] with min_n 3: [1, 2] recurs but is shorter than min_n; got {got}"
    got = ngram_proposer.find_ngram_drafts([5, 5, 5], 4, 2, 2)
    assert got == [5], f"[5, 5, 5], n 2: [5, 5] at 0 overlaps the suffix, followed by one 5 (k 4, 1 left); got {got}"
    assert ngram_proposer.find_ngram_drafts([1, 2, 1, 2], 0, 1, 2) == [], "k 0 proposes nothing"


@pytest.mark.task("find_ngram_drafts")
def test_the_proposer_asks_it():
    seq = Sequence(0, [1, 2, 3, 4, 5, 1, 2])
    drafts = NgramProposer(3, 1, 4).propose([DraftRequest(seq, SamplingParams(temperature=0), None, 3)])
    assert drafts[0].token_ids == [3, 4, 5], f"NgramProposer(k=3) over [1, 2, 3, 4, 5, 1, 2]: got {drafts[0].token_ids}"


# ---- quantize_kv (7c) ----

INT8, FP8 = KV_CACHE_DTYPES["int8"], KV_CACHE_DTYPES["fp8"]


@pytest.mark.task("quantize_kv")
def test_int8_codes_and_scales_by_hand():
    x = np.array([[[1.0, -2.0, 0.5, 0.25]], [[0.0, 0.0, 0.0, 0.0]]], dtype=np.float32)  # (2 tokens, 1 head, 4)
    codes, scales = kv_quant.quantize(Tensor(x), INT8)
    assert codes.dtype == dtypes.int8 and scales.dtype == dtypes.float32, f"got {codes.dtype}, {scales.dtype}"
    assert codes.shape == (2, 1, 4) and scales.shape == (2, 1), f"codes {codes.shape}, scales {scales.shape}"
    c, s = codes.numpy(), scales.numpy()
    assert np.isclose(s[0, 0], 2 / 127), f"token 0's amax is 2: its scale 2/127 = {2 / 127:.5f}, got {s[0, 0]:.5f}"
    assert c[0, 0].tolist() == [64, -127, 32, 16], (
        f"x * 127 / 2 rounded: [63.5 -> 64, -127, 31.75 -> 32, 15.875 -> 16], got {c[0, 0].tolist()}")
    assert s[1, 0] == 0 and not c[1].any(), f"a zero vector: scale 0 and codes 0 (no division by 0), got {s[1, 0]}"


@pytest.mark.task("quantize_kv")
def test_int8_and_fp8_match_the_reference(learner_code):
    x = np.random.default_rng(7).standard_normal((3, 2, 8)).astype(np.float32)
    x[1, 1] = 0.0  # one token's head all zeros: scale 0, codes 0, no 0 / 0 anywhere
    x = Tensor(x)
    for spec in (INT8, FP8):
        codes, scales = (t.numpy() for t in kv_quant.quantize(x, spec))
        with learner_code():
            want_codes, want_scales = (t.numpy() for t in kv_quant.quantize(x, spec))
        assert np.isfinite(scales).all() and (codes[1, 1] == 0).all(), (
            f"{spec.name}: a vector of zeros should get scale 0 and codes 0, got scale {scales[1, 1]} and codes "
            f"{codes[1, 1].tolist()} (a division by amax = 0?)")
        assert np.allclose(scales, want_scales, rtol=1e-6), f"{spec.name}: the scales differ from amax / {spec.qmax}"
        assert (codes == want_codes).all(), (f"{spec.name}: {int((codes != want_codes).sum())} of {codes.size} codes "
                                             f"differ from the reference")


@pytest.mark.task("quantize_kv")
def test_reshape_and_cache_writes_the_codes():
    cache = Tensor.zeros(2, 2, 1, 4, dtype=dtypes.int8).contiguous().realize()  # 2 blocks of 2 slots, 1 head
    scale_cache = Tensor.zeros(2, 2, 1).contiguous().realize()
    x = Tensor(np.array([[[1.0, -2.0, 0.5, 0.25]]], dtype=np.float32))
    written, scales = paged.reshape_and_cache(x, cache, Tensor([3], dtype=dtypes.int32), scale_cache)
    got = written.numpy()[1, 1, 0].tolist()
    assert got == [64, -127, 32, 16], f"slot 3 (block 1, offset 1) of an int8 cache should hold the codes, got {got}"
    assert np.isclose(scales.numpy()[1, 1, 0], 2 / 127), "and its scale slot the scale 2/127"
