"""Phase 7b: exact rejection sampling keeps the target's distribution, and sampled requests speculate correctly.

The distribution tests run the functions the engine runs (VerifyBatch -> rejection_sample on the device ->
emitted_tokens) on a 6-token vocabulary with known p and q, 20,000 independent verifications each, and check the
emitted tokens against p with Pearson's chi-square goodness-of-fit test: a test fails when its p-value is below
0.001 (a correct sampler fails one such test in 1,000 runs; the draws are seeded, so a run is reproducible).
The engine tests use the tiny random model with a scripted proposer: its drafts are the tokens a reference run
produced, with mistakes where a test wants rejections.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from tinygrad import Tensor

from chi2 import SIGNIFICANCE, chi2_pvalue, chi2_sf
from test_spec_decode import run as run_to_end
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.proposer import Draft, DraftRequest
from tinyvllm.spec_decode.rejection_sampler import VerifyBatch, emitted_tokens, rejection_sample

TRIALS = 20_000
P = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])  # the target's distribution at every position
Q_PEAKED = np.array([0.02, 0.03, 0.05, 0.1, 0.7, 0.1])  # a draft that is sure of a token the target finds unlikely
Q_FLAT = np.full(6, 1 / 6)


def test_chi2_sf_matches_tables():
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(20.515, 5) == pytest.approx(0.001, abs=1e-5)
    assert chi2_sf(16.812, 6) == pytest.approx(0.01, abs=1e-4)


def verify_many(p_rows: np.ndarray, q_rows: np.ndarray | None, temperature: float = 1.0, top_k: int = 0,
                seed: int = 0) -> list[tuple[list[int], int]]:
    """TRIALS independent verifications of k = len(p_rows) - 1 drafts: drafts drawn from q (one-hot: always token 4
    when q_rows is None), target logits log(p) at each of the k + 1 rows. Returns (emitted, accepted) per trial."""
    k = len(p_rows) - 1
    rng = np.random.default_rng(seed)
    vocab = p_rows.shape[1]
    batch = VerifyBatch(TRIALS * (k + 1), vocab)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    drafts = []
    for _ in range(TRIALS):
        d = [4] * k if q_rows is None else [int(rng.choice(vocab, p=q_rows[j])) for j in range(k)]
        drafts.append(d)
        batch.add(d, params, rng, None if q_rows is None else q_rows)
    logits = np.tile(np.log(p_rows), (TRIALS, 1)).astype(np.float32)
    inputs = [Tensor(a) for a in batch.inputs()]
    accepted, tokens = rejection_sample(Tensor(logits), *inputs[:7], draft_probs=inputs[7] if len(inputs) > 7 else None,
                                        use_filters=batch.use_filters)
    accepted, tokens = accepted.numpy(), tokens.numpy()
    return [emitted_tokens(d, accepted[first:first + k], tokens[first:first + k + 1])
            for d, (first, k) in zip(drafts, batch.spans)]


@pytest.mark.parametrize("q", ["peaked", "flat", "one-hot"])
def test_first_token_follows_p(q):
    """The first emitted token is the target's p whatever q proposed; so is the second, given the first draft
    was kept (then it is the second draft kept, or a resample at row 1)."""
    q_rows = {"peaked": np.vstack([Q_PEAKED, Q_FLAT]), "flat": np.vstack([Q_FLAT, Q_PEAKED]), "one-hot": None}[q]
    p2 = P[::-1].copy()  # the second position's target distribution differs from the first's
    results = verify_many(np.vstack([P, p2, P]), q_rows)
    first = [emitted[0] for emitted, _ in results]
    assert chi2_pvalue(first, P) > SIGNIFICANCE
    second = [emitted[1] for emitted, accepted in results if accepted >= 1]
    assert len(second) > 1000
    assert chi2_pvalue(second, p2) > SIGNIFICANCE
    rate = np.mean([accepted >= 1 for _, accepted in results])
    # P(first draft kept) = sum over x of min(p(x), q(x)): one-hot q at token 4 keeps it with probability p(4)
    expected = P[4] if q_rows is None else np.minimum(P, q_rows[0]).sum()
    assert rate == pytest.approx(expected, abs=0.015)


def test_bonus_token_follows_p_and_filters_apply():
    """k = 1 with q = p: every draft is kept and the bonus row samples from its p. Temperature and top-k shape p
    as the device sampler does: the tokens outside the top 3 are never emitted."""
    temperature, top_k = 0.7, 3
    scaled = np.log(P) / temperature
    filtered = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    p = np.exp(filtered - filtered.max())
    p /= p.sum()
    results = verify_many(np.vstack([P, P]), np.vstack([p]), temperature=temperature, top_k=top_k)
    assert np.mean([accepted for _, accepted in results]) > 0.99  # q = p: kept up to rounding
    bonus = [emitted[1] for emitted, accepted in results if accepted == 1]
    assert chi2_pvalue(bonus, p) > SIGNIFICANCE
    assert chi2_pvalue([emitted[0] for emitted, _ in results], p) > SIGNIFICANCE


def test_emitted_tokens():
    assert emitted_tokens([4, 9, 1], np.array([True, True, False]), np.array([0, 0, 7, 5])) == ([4, 9, 7], 2)
    assert emitted_tokens([4, 9], np.array([True, True]), np.array([0, 0, 5])) == ([4, 9, 5], 2)
    assert emitted_tokens([4, 9], np.array([False, True]), np.array([3, 0, 5])) == ([3], 0)


# ---- the engine: sampled requests that speculate ----

ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLMEngine(tiny_model_dir, **ARGS)


def engine_like(tiny, **kwargs):
    return LLMEngine(tiny.model, tokenizer=tiny.tokenizer, **{**ARGS, **kwargs})


run = functools.partial(run_to_end, max_steps=2000)  # these runs are short: a stall shows sooner


class ScriptedProposer:
    """Drafts for request r are script[r]'s tokens after the request's own, with every `wrong`-th draft replaced by
    a token that is never right; records which sequences it was told to free."""

    def __init__(self, k: int, script: dict, wrong: int = 0):
        self.k, self.script, self.wrong = k, script, wrong
        self.proposed, self.freed = set(), []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            tokens = self.script.get(r.seq.seq_id, [])
            n = r.seq.num_tokens
            guess = list(tokens[n:n + min(self.k, r.max_drafts)])
            if self.wrong:
                guess = [t if (n + j) % self.wrong else 3 for j, t in enumerate(guess)]
            self.proposed.add(r.seq.seq_id)
            drafts.append(Draft(guess))
        return drafts

    def free(self, seq_id):
        self.freed.append(seq_id)


def speculating(tiny, script, k=4, wrong=0, block_size=16, **kwargs):
    engine = engine_like(tiny, block_size=block_size,
                         speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                             "disable_by_batch_size": None, **kwargs})
    engine.model_runner.speculator.proposer = ScriptedProposer(k, script, wrong)
    return engine


def sampled(max_tokens=30, seed=7, **kw):
    # a low temperature: the tiny random model's distribution is peaked enough that scripted drafts are often kept
    return SamplingParams(temperature=0.05, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_sampled_request_reproduces_and_speculates(tiny):
    prompt = [11, 12, 13, 14, 15, 16]
    ref = run(tiny, {"r": (prompt, sampled())})["r"]
    script = {"r": prompt + ref.token_ids}
    first = speculating(tiny, script, wrong=3)
    a = run(first, {"r": (prompt, sampled())})["r"]
    b = run(speculating(tiny, script, wrong=3), {"r": (prompt, sampled())})["r"]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 30 and a.finish_reason == "length"
    stats = first.get_stats()
    # some drafts kept (the right ones, mostly), some rejected (the wrong ones): both paths ran
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_emitted_tokens"] == stats["spec_decode_num_accepted_tokens"] + stats[
        "spec_decode_num_verify_steps"]
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx(
        stats["spec_decode_num_emitted_tokens"] / stats["spec_decode_num_verify_steps"])
    assert first.model_runner.speculator.proposer.freed == ["r"]  # told once the request finished


def test_sampled_request_stops_exactly(tiny):
    """max_tokens and stop strings cut an accepted run where decoding stops; its blocks are freed (run checks)."""
    prompt = [21, 22, 23, 24, 25]
    ref = run(tiny, {"r": (prompt, sampled(40))})["r"]
    script = {"r": prompt + ref.token_ids}
    full = run(speculating(tiny, script), {"r": (prompt, sampled(40))})["r"]
    for max_tokens in (1, 2, 5, 13):  # fewer drafts near the end draw fewer numbers: the tokens may differ there
        engine = speculating(tiny, script)
        out = run(engine, {"r": (prompt, sampled(max_tokens))})["r"]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        assert engine.get_stats()["spec_decode_num_emitted_tokens"] <= max_tokens
    checked = 0
    for j in (4, 9, 17, 23):
        stop = tiny.tokenizer.decode(full.token_ids[j:j + 1]).strip()
        if not stop or stop not in full.text:
            continue
        checked += 1
        out = run(speculating(tiny, script), {"r": (prompt, sampled(40, stop=[stop]))})["r"]
        assert out.text == full.text[:full.text.index(stop)] and out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
        assert stop in tiny.tokenizer.decode(out.token_ids)  # cut right after the token that completed it
    assert checked >= 2


def test_disable_by_batch_size(tiny):
    prompts = {f"r{i}": ([30 + i, 31, 32, 33], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
               for i in range(3)}
    ref = run(tiny, prompts)
    script = {rid: prompts[rid][0] + out.token_ids for rid, out in ref.items()}
    off = speculating(tiny, script, disable_by_batch_size=3)  # 3 running: never speculates
    assert {rid: o.token_ids for rid, o in run(off, prompts).items()} == {rid: o.token_ids for rid, o in ref.items()}
    assert off.get_stats()["spec_decode_num_draft_tokens"] == 0
    on = speculating(tiny, script, disable_by_batch_size=4)
    assert {rid: o.token_ids for rid, o in run(on, prompts).items()} == {rid: o.token_ids for rid, o in ref.items()}
    assert on.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert sorted(on.model_runner.speculator.proposer.freed) == ["r0", "r1", "r2"]


def test_rollback_leaves_no_stale_slots(tiny):
    """After rejected drafts, the next steps' logits equal a run without speculation at every position: the
    rejected drafts' K/V, still in the cache slots, are never read (compare logits, not only tokens)."""
    prompt = [40, 41, 42, 43, 44, 45, 46]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def record(engine):
        """position -> the target's logits predicting the token at that position, from rows whose inputs are
        the request's real tokens (the last sampled token's row, and each draft's row while the drafts before
        it and itself are right)."""
        seen, execute = {}, engine.model_runner.compute_logits

        def execute_model(scheduler_output, *args):
            seq = scheduler_output.scheduled_seqs[0]
            n = seq.num_tokens
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(seq.seq_id, [])
            output = execute(scheduler_output, *args)
            if output.sampled_seqs:
                host = output.logits.numpy()
                seen[n] = host[0]
                for j, row in enumerate(output.spec_logits_rows.get(seq.seq_id, [])):
                    if drafts[:j + 1] != truth[n:n + j + 1]:
                        break
                    seen[n + j + 1] = host[row]
            return output
        engine.model_runner.compute_logits = execute_model
        return seen

    truth = prompt + run(tiny, {"r": (prompt, params)})["r"].token_ids
    off = engine_like(tiny)
    off_logits = record(off)
    run(off, {"r": (prompt, params)})
    on = speculating(tiny, {"r": truth}, k=4, wrong=3, block_size=4)  # every third draft wrong: runs of 0-2 kept
    on_logits = record(on)
    out = run(on, {"r": (prompt, params)})["r"]
    assert prompt + out.token_ids == truth
    stats = on.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert set(on_logits) <= set(off_logits) and len(on_logits) >= 20
    for pos, logits in on_logits.items():
        np.testing.assert_allclose(logits, off_logits[pos], rtol=0, atol=1e-4, err_msg=f"position {pos}")


class OneHotProposer(ScriptedProposer):
    """The scripted drafts with q given explicitly, one-hot at each draft (`probs` of the right shape): exact
    rejection sampling must then decide exactly as with q None (the same draws, the same tokens)."""

    def __init__(self, k, script, wrong, vocab, with_probs: set):
        super().__init__(k, script, wrong)
        self.vocab, self.with_probs = vocab, with_probs

    def propose(self, requests):
        drafts = super().propose(requests)
        for r, d in zip(requests, drafts):
            if r.seq.seq_id in self.with_probs and d.token_ids:
                q = np.zeros((len(d.token_ids), self.vocab), np.float32)  # (k, V)
                q[np.arange(len(d.token_ids)), d.token_ids] = 1.0
                d.probs = Tensor(q)
        return drafts


def test_mixed_batch_with_and_without_q_under_preemption(tiny):
    """Greedy and sampled requests speculate side by side, a sampled one with an explicit q; a small pool preempts.
    Greedy tokens equal speculation off; the sampled ones equal the same run with q None; every sequence the
    proposer saw is freed, the preempted ones included."""
    requests = {f"g{i}": ([50 + i, 51, 52, 53] * 3, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                for i in range(3)}
    requests.update({f"s{i}": ([60 + i, 61, 62] * 4, sampled(40, seed=i)) for i in range(3)})
    ref = run(tiny, requests)
    script = {rid: requests[rid][0] + out.token_ids for rid, out in ref.items()}
    outs = []
    for with_probs in (set(), {"s0", "s2"}):
        engine = engine_like(tiny, max_model_len=128, num_gpu_blocks_override=14,
                             speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                 "disable_by_batch_size": None})
        proposer = engine.model_runner.speculator.proposer = OneHotProposer(4, script, 3, tiny.model.config.vocab_size,
                                                                            with_probs)
        preempted = []  # (seq_id, whether the proposer had seen it by then)
        schedule = engine.scheduler.schedule

        def recording(schedule=schedule, preempted=preempted, proposer=proposer):
            out = schedule()
            preempted.extend((seq.seq_id, seq.seq_id in proposer.proposed) for seq in out.preempted_seqs)
            return out
        engine.scheduler.schedule = recording
        outs.append(run(engine, requests))
        assert any(seen for _, seen in preempted), "the small pool should have preempted a speculating request"
        assert set(proposer.freed) == proposer.proposed
        for seq_id, seen in preempted:  # freed when preempted, and again when it finished
            assert not seen or proposer.freed.count(seq_id) >= 2, seq_id
    for rid in requests:
        assert outs[0][rid].token_ids == outs[1][rid].token_ids, rid
        if rid.startswith("g"):
            assert outs[0][rid].token_ids == ref[rid].token_ids, rid
