"""Phase 7b: the draft_model proposer (tinyvllm/spec_decode/draft_model.py).

Oracles: the target's own greedy decoding (a draft that is the target itself must propose exactly the target's next
tokens, whatever was rejected before), and the engine with speculation off (greedy output token for token).
Drafts here: the tiny model itself (everything accepted), a second tiny model with other weights (almost
everything rejected: rollback every step), and the tiny model with noise on its lm_head (some of each).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import write_tiny_model
from test_spec_decode import run
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.model.weights_hf import read_safetensors, save_hf_weights
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.config import SpeculativeConfig
from tinyvllm.spec_decode.draft_model import DraftModelProposer
from tinyvllm.spec_decode.proposer import DraftRequest

ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="16MiB")


def draft_config(path, k=4, **kw) -> dict:
    """Speculation on at every batch size (the mixed batches here would turn a default limit's switch)."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, "disable_by_batch_size": None,
            **kw}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The speculation-off engine: the oracle, and the model the others share."""
    return LLMEngine(tiny_model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A second tiny model, other random weights, the same tokenizer: its drafts are nearly all wrong."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)


@pytest.fixture(scope="module")
def near_draft_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with noise on its lm_head: it agrees with the target on some drafts and not on others."""
    out = tmp_path_factory.mktemp("tiny-near")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    weights = read_safetensors(tiny_model_dir / "model.safetensors")
    rng = np.random.default_rng(2)
    weights["lm_head.weight"] = weights["lm_head.weight"] + 0.0125 * rng.standard_normal(
        weights["lm_head.weight"].shape).astype(np.float32)
    save_hf_weights(weights, out)
    return out


def proposer(tiny, path, k=4, **kw) -> DraftModelProposer:
    config = SpeculativeConfig.from_dict(draft_config(path, k, **kw))
    return DraftModelProposer(config, tiny.model, tiny.tokenizer, runner_class=ModelRunner, num_blocks=64,
                              block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


def greedy(max_tokens=30, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- configuration and loading ----

def test_bad_configs_are_clear_errors(tiny, tiny_model_dir):
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="quantization"):
        SpeculativeConfig.from_dict(draft_config(tiny_model_dir, quantization="q5_k"))
    with pytest.raises(ValueError, match="for method 'draft_model'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "model": str(tiny_model_dir)})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict(draft_config(tiny_model_dir) | {"method": "eagle"})
    with pytest.raises(ValueError, match="max_model_len"):  # the draft's 512 positions cannot serve 1024
        DraftModelProposer(SpeculativeConfig.from_dict(draft_config(tiny_model_dir)), tiny.model, tiny.tokenizer,
                           runner_class=ModelRunner, num_blocks=64, block_size=16, max_model_len=1024,
                           max_num_batched_tokens=64, max_num_seqs=8)


def test_a_draft_with_another_tokenizer_is_refused(tiny, tmp_path):
    path = write_tiny_model(tmp_path / "other-tokenizer")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "hello", "world"  # the same strings, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the tokenizer") as error:
        proposer(tiny, path)
    assert "other-tokenizer" in str(error.value) and "(the target)" in str(error.value)


# ---- the proposer alone, against the target's greedy decoding ----

def target_greedy(tiny, prompts: dict, max_tokens: int) -> dict:
    return {rid: out.token_ids for rid, out in run(tiny, {rid: (p, greedy(max_tokens)) for rid, p in
                                                          prompts.items()}).items()}


def test_self_draft_proposes_the_targets_tokens_through_rollbacks(tiny, tiny_model_dir):
    """Draft = the target: each proposal is the target's next k tokens. After each proposal a random number of
    drafts is 'accepted' and one target token follows, so the draft must roll back the rest every time."""
    prompts = {"long": list(range(100, 190)), "short": [5, 6, 7], "mid": [40 + i % 7 for i in range(30)]}
    truth = target_greedy(tiny, prompts, 40)
    draft = proposer(tiny, tiny_model_dir, k=4)
    seqs = {rid: Sequence(rid, p) for rid, p in prompts.items()}
    rng = np.random.default_rng(0)
    rolled_back = 0
    while any(s.num_output_tokens < 36 for s in seqs.values()):
        live = [s for s in seqs.values() if s.num_output_tokens < 36]
        requests = [DraftRequest(s, greedy(), None, max_drafts=min(4, 36 - s.num_output_tokens)) for s in live]
        for request, proposed in zip(requests, draft.propose(requests)):
            seq, done = request.seq, request.seq.num_output_tokens
            assert proposed.probs is None and len(proposed.token_ids) == request.max_drafts
            assert proposed.token_ids == truth[seq.seq_id][done:done + request.max_drafts], seq.seq_id
            kept = int(rng.integers(0, len(proposed.token_ids) + 1))
            rolled_back += kept < len(proposed.token_ids) - 1
            seq.output_token_ids += truth[seq.seq_id][done:done + kept + 1]
    assert rolled_back > 5
    for rid in prompts:
        draft.free(rid)
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_changed_tokens_and_a_full_pool(tiny, tiny_model_dir):
    """Tokens that differ from what the draft fed (far back, as after a request was replaced) are fed again; a
    request the pool has no room for gets no drafts, and the K/V of requests that stopped speculating go first."""
    truth = target_greedy(tiny, {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7, 6, 5]}, 8)
    draft = proposer(tiny, tiny_model_dir, k=3)
    seq = Sequence("a", [9, 8, 7, 6, 5])  # first fed as b's prompt ...
    assert draft.propose([DraftRequest(seq, greedy(), None, 3)])[0].token_ids == truth["b"][:3]
    seq.prompt_token_ids = [1, 2, 3, 4, 5]  # ... then the tokens change from the first one on
    assert draft.propose([DraftRequest(seq, greedy(), None, 3)])[0].token_ids == truth["a"][:3]
    hog = Sequence("hog", list(range(1000, 1000 + 200)))  # 13 of the 64 blocks
    draft.propose([DraftRequest(hog, greedy(), None, 2)])
    big = [Sequence(f"big{i}", list(range(2000 + 250 * i, 2000 + 250 * i + 250))) for i in range(5)]  # 16 blocks each
    proposals = draft.propose([DraftRequest(s, greedy(), None, 2) for s in big])
    assert [len(p.token_ids) for p in proposals] == [2, 2, 2, 2, 0], "four fit once hog and a are evicted, not five"
    assert "hog" not in draft._seqs and "a" not in draft._seqs
    for s in big:
        draft.free(s.seq_id)
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_sampled_drafts_come_with_their_distribution(tiny, tiny_model_dir):
    """q is the draft's distribution at each draft position: for a self-draft at temperature 1, the target's own
    probabilities (its logprobs, from the host reference sampler, are the oracle). Seeded requests repeat."""
    draft = proposer(tiny, tiny_model_dir, k=3)
    prompt = [5, 6, 7, 8]

    def propose(seed):
        sampled = SamplingParams(temperature=1.0)
        requests = [DraftRequest(Sequence("s", prompt), sampled, np.random.default_rng(seed), 3),
                    DraftRequest(Sequence("g", prompt), greedy(), None, 2)]
        out = draft.propose(requests)
        draft.free("s"), draft.free("g")
        return out

    first, again = propose(1), propose(1)
    assert first[1].probs is None and len(first[1].token_ids) == 2
    q = first[0].probs.numpy()  # (3, vocab)
    assert q.shape == (3, tiny.model.config.vocab_size) and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert first[0].token_ids == again[0].token_ids and np.array_equal(q, again[0].probs.numpy())
    d0, d1, _ = first[0].token_ids
    target = run(tiny, {"at0": (prompt, greedy(1, logprobs=5)), "at1": (prompt + [d0], greedy(1, logprobs=5)),
                        "at2": (prompt + [d0, d1], greedy(1, logprobs=5))})
    for j, rid in enumerate(["at0", "at1", "at2"]):
        _, top = target[rid].logprobs[0]
        assert np.allclose([q[j, t] for t, _ in top], [np.exp(lp) for _, lp in top], rtol=1e-3), j


# ---- in the engine: greedy output with draft speculation equals without ----

def engine_like(tiny, **kwargs):
    return LLMEngine(tiny.model, tokenizer=tiny.tokenizer, **(ENGINE_ARGS | kwargs))


def mixed_requests(n=4):
    """Greedy requests of several lengths, beside a sampled one and one that asks for logprobs (never speculates)."""
    requests = {f"g{i}": ([30 + i, 31, 32, 33] * (i + 1), greedy(24 + 3 * i)) for i in range(n)}
    requests["sampled"] = ([9, 9, 10], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True))
    requests["logprobs"] = ([7, 8, 9, 10], greedy(15, logprobs=2))
    return requests


def same_greedy(off, on):
    assert off.keys() == on.keys()
    for rid in off:
        if rid != "sampled":  # sampled requests reproduce per seed, not across speculation on and off
            assert off[rid].token_ids == on[rid].token_ids, rid
            assert (off[rid].text, off[rid].finish_reason) == (on[rid].text, on[rid].finish_reason), rid
    assert len(on["sampled"].token_ids) == 20


def draft_blocks_free(engine) -> bool:
    bm = engine.model_runner.speculator.proposer.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("draft", ["self", "other", "near"])
def test_greedy_output_equals_speculation_off(tiny, tiny_model_dir, other_draft_dir, near_draft_dir, draft):
    path = {"self": tiny_model_dir, "other": other_draft_dir, "near": near_draft_dir}[draft]
    on = engine_like(tiny, speculative_config=draft_config(path, k=3))
    same_greedy(run(tiny, mixed_requests()), run(on, mixed_requests()))
    stats = on.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 50
    rate = stats["spec_decode_acceptance_rate"]
    assert {"self": rate > 0.9, "other": rate < 0.2, "near": 0.2 < rate < 0.9}[draft], rate
    assert draft_blocks_free(on), "draft blocks leaked"


def test_preemption_and_chunked_prefill(tiny, near_draft_dir):
    requests = mixed_requests(5)
    requests |= {f"g{i}": (prompt, greedy(70)) for i, (prompt, _) in enumerate(list(requests.values())[:5])}
    requests["long"] = (list(range(100, 250)), greedy(20))  # 150 tokens: chunks of the 64-token budget
    # 16 blocks of 16 slots for 5 sequences growing to 74-90 tokens and more: the target preempts, the draft's
    # pool fills
    on = engine_like(tiny, num_gpu_blocks_override=16, speculative_config=draft_config(near_draft_dir, k=4))
    num_preempted = 0
    schedule = on.scheduler.schedule

    def counting_schedule():
        nonlocal num_preempted
        output = schedule()
        num_preempted += len(output.preempted_seqs)
        return output

    on.scheduler.schedule = counting_schedule
    same_greedy(run(tiny, requests), run(on, requests))
    assert num_preempted > 0 and on.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert draft_blocks_free(on), "draft blocks leaked"


def test_an_engine_with_a_mismatched_draft_fails_at_load(tiny, tmp_path):
    path = write_tiny_model(tmp_path / "bad-draft")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = not config.get("add_bos_token", False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bad-draft"):
        engine_like(tiny, speculative_config=draft_config(path))


def test_real_model_float32_target_with_its_q4_1_self_as_draft(generator, default_gguf):
    """The issue's demonstration: SmolLM2-135M in float32 verifies drafts from its own GGUF's Q4_1 blocks. Same
    greedy tokens as the float32 model alone, most drafts accepted (23 of 27 here when written, k = 4)."""
    off = generator.engine
    on = LLMEngine(off.model, tokenizer=off.tokenizer, max_model_len=512, kv_cache_memory="32MiB",
                   speculative_config=draft_config(default_gguf, k=4, quantization="auto"))
    assert on.model_runner.speculator.proposer.model.quantization == "auto"
    assert "Q4_1" in on.model_runner.speculator.proposer.model.weight_formats()
    chat = off.tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    requests = {"chat": (chat, greedy(16)), "plain": ("The capital of France is", greedy(16))}
    expected = {rid: out.token_ids for rid, out in run(off, requests).items()}
    assert {rid: out.token_ids for rid, out in run(on, requests).items()} == expected
    stats = on.get_stats()
    assert stats["spec_decode_acceptance_rate"] > 0.7 and stats["spec_decode_num_verify_steps"] > 0, stats
    assert draft_blocks_free(on)
