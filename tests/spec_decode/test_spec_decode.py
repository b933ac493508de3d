"""Phase 7b: speculative decoding (ngram) inside continuous batching gives greedy output token for token.

The oracle is the same engine with speculation off: every emitted token must be the one plain greedy decoding
produces, whatever the proposer guessed, in mixed batches, under preemption, chunked prefill and prefix caching.
Sampled requests (exact rejection sampling) are tested in test_rejection_sampler.py.
"""

from __future__ import annotations

import pytest
from fake_engine import run_all

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.config import SpeculativeConfig
from tinyvllm.spec_decode.ngram_proposer import find_ngram_drafts
from tinyvllm.spec_decode.verify import accept_greedy

# speculating at every batch size (the default turns it off from 4 running requests): the mixed batches verify too
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The speculation-off engine; others share its model."""
    return LLMEngine(tiny_model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                     kv_cache_memory="16MiB")


def engine_like(tiny, **kwargs):
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="16MiB")
    args.update(kwargs)
    return LLMEngine(tiny.model, tokenizer=tiny.tokenizer, **args)


def run(engine, requests, max_steps=3000):
    """Every request to its end ({request id: (prompt, params)}); their completions by request id. The speculative
    tests' one loop (test_rejection_sampler and test_spec_decode_draft import it): no request may stall, and no
    block of the engine's pool stays taken."""
    return {rid: out.outputs[0] for rid, out in run_all(engine, requests, max_steps).items()}


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def repeating_requests(n=5):
    """Prompts that repeat a pattern (the proposer finds matches), one sampled request beside them."""
    requests = {f"g{i}": ([11, 12, 13, 14, 15] * (i + 1) + [20 + i, 21], greedy(30 + 3 * i)) for i in range(n)}
    requests["sampled"] = ([9, 9, 9, 10, 9, 9], SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True))
    return requests


def same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        if rid == "sampled":  # its draws depend on its drafts once it speculates: the same length, not the tokens
            assert (len(a[rid].token_ids), a[rid].finish_reason) == (len(b[rid].token_ids), b[rid].finish_reason)
            continue
        assert a[rid].token_ids == b[rid].token_ids, rid
        assert (a[rid].text, a[rid].finish_reason, a[rid].stop_reason) == (b[rid].text, b[rid].finish_reason,
                                                                            b[rid].stop_reason), rid


def test_mixed_batch_same_tokens_and_no_leak(tiny):
    on = engine_like(tiny, speculative_config=NGRAM)
    same(run(tiny, repeating_requests()), run(on, repeating_requests()))
    stats = on.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert "spec_decode_num_draft_tokens" not in tiny.get_stats()  # off: no counters


def test_preemption_chunked_prefill_and_no_prefix_cache(tiny):
    requests = repeating_requests(6)
    requests["long"] = (list(range(100, 250)), greedy(20))  # 150 tokens: chunks of the 64-token budget
    off = engine_like(tiny, enable_prefix_caching=False)
    # 24 blocks of 16 slots for ~7 sequences of up to ~190 tokens: preemptions happen
    on = engine_like(tiny, num_gpu_blocks_override=24, speculative_config=NGRAM)
    on_preempts = []
    schedule = on.scheduler.schedule

    def recording():
        out = schedule()
        on_preempts.extend(out.preempted_seqs)
        return out
    on.scheduler.schedule = recording
    same(run(off, requests), run(on, requests))
    assert on_preempts, "the small pool should have preempted"
    cached = engine_like(tiny, speculative_config=NGRAM)  # prefix caching on: the second run hits the cache
    same(run(off, requests), run(cached, requests))
    same(run(off, requests), run(cached, requests))
    assert cached.get_stats()["prefix_cache_hits"] > 0


def test_stops_inside_an_accepted_run(tiny):
    """Stop token ids, stop strings and max_tokens cut a run where plain decoding stops."""
    prompt = [11, 12, 13, 14, 15] * 4 + [20, 21]
    base = run(tiny, {"base": (prompt, greedy(40))})["base"]
    on = engine_like(tiny, speculative_config=NGRAM)
    for j in (3, 7, 12, 20):
        token = base.token_ids[j]
        text = tiny.tokenizer.decode(base.token_ids[j:j + 1]).strip()
        cases = {"tok": (prompt, greedy(40, stop_token_ids=[token])),
                 "len": (prompt, greedy(j + 1))}
        if text:
            cases["str"] = (prompt, greedy(40, stop=[text]))
        same(run(tiny, cases), run(on, cases))


def replay_counts(k: int, min_n: int, max_n: int, prompt: list[int], output: list[int], max_tokens: int):
    """Drafts and accepted drafts that speculation must have had, from the plain output alone: at each verify step
    the proposer sees the tokens so far and the target agrees with a draft exactly when it equals the next token."""
    drafts = accepted = 0
    tokens, pos = prompt + output, len(prompt) + 1  # the first token comes from the prefill
    while pos < len(tokens):
        guess = find_ngram_drafts(tokens[:pos], min(k, max_tokens - (pos - len(prompt)) - 1), min_n, max_n)
        _, num_accepted = accept_greedy(guess, (tokens[pos:] + [0] * (len(guess) + 1))[:len(guess) + 1])
        drafts, accepted = drafts + len(guess), accepted + num_accepted
        pos += num_accepted + 1
    return drafts, accepted


def test_acceptance_counters_match_a_replay(tiny):
    prompt = [11, 12, 13, 14, 15] * 6 + [11, 12]
    base = run(tiny, {"base": (prompt, greedy(30))})["base"]
    on = engine_like(tiny, speculative_config=NGRAM)
    run(on, {"spec": (prompt, greedy(30))})
    stats = on.get_stats()
    expected = replay_counts(4, 1, 3, prompt, base.token_ids, 30)
    assert (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]) == expected
    assert stats["spec_decode_num_draft_tokens"] > 0
    # the names vLLM uses; one verify step per step after the prefill, each emitting accepted + 1 tokens
    drafts, accepted, steps = expected[0], expected[1], stats["spec_decode_num_verify_steps"]
    assert stats["spec_decode_num_emitted_tokens"] == accepted + steps
    assert stats["spec_decode_acceptance_rate"] == accepted / drafts
    assert stats["spec_decode_mean_accepted_length"] == (accepted + steps) / steps
    assert 0 < steps < 30 - 1


def test_verifying_k_drafts_runs_k_plus_1_tokens_unpadded(tiny):
    """One sequence verifying its k = 4 drafts is a step of 5 tokens: a graph of its own (5 tokens, 5 rows of
    logits), not the next power of two, whose 3 rows of padding would cost a row of every matmul."""
    on = engine_like(tiny, speculative_config=NGRAM)
    assert 5 in on.model_runner.token_buckets and on.model_runner.token_buckets == sorted(on.model_runner.token_buckets)
    run(on, {"r": ([11, 12, 13, 14, 15] * 6 + [11, 12], greedy(30))})
    graphs = set(on.model_runner._jits)
    assert (5, 5) in graphs and (8, 8) not in graphs, graphs


def test_rollback_frees_emptied_blocks(tiny):
    """After each step a speculating sequence holds exactly the blocks its computed tokens need."""
    on = engine_like(tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 8,
                                               "prompt_lookup_max": 2}, block_size=4)
    on.add_request("r", [5, 6, 7, 8] * 4, greedy(40))
    while on.has_unfinished_requests():
        on.step()
        for seq in on.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 4), seq
    assert on.scheduler.block_manager.num_free_blocks == on.scheduler.block_manager.num_blocks


def test_ngram_proposer():
    def p(tokens, k=3):
        return find_ngram_drafts(tokens, k, 1, 3)
    assert p([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]  # "1 2 3" seen at the start
    assert p([1, 2, 3, 4, 9, 1, 2, 3], k=1) == [4]
    assert p([7, 8, 9]) == []
    assert p([5, 1, 5, 2, 5]) == [1, 5, 2]  # only n = 1 matches: the earliest occurrence wins
    assert accept_greedy([4, 9, 1], [4, 9, 2, 7]) == ([4, 9, 2], 2)
    assert accept_greedy([4, 9, 1], [4, 9, 1, 7]) == ([4, 9, 1, 7], 3)
    assert accept_greedy([], [6]) == ([6], 0)


@pytest.mark.parametrize("config, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ("ngram", "dict"),
])
def test_bad_config_is_a_clear_error(config, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.from_dict(config)


def test_real_model_same_tokens_with_high_acceptance():
    """The shipped model editing code given in its prompt: same greedy tokens, many drafts accepted. Weights
    dequantized (float32): the quantized kernels' rounding depends on the rows of a step (one row at a time at
    M=1), so a verify step of 5 rows could flip a near-tie that a 1-row step does not."""
    from tinyvllm.llm import LLM

    passage = ("def area(radius):\n    return 3.14159 * radius * radius\n\n"
               "def perimeter(radius):\n    return 2 * 3.14159 * radius\n")
    args = dict(max_model_len=512, kv_cache_memory="32MiB", max_num_seqs=4, quantization="none")
    off = LLM(**args)
    on = LLM(off.llm_engine.model_path, **args, speculative_config=NGRAM)
    prompt = off.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Rename radius to r in this code:\n" + passage}], add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=48)
    a = off.generate([prompt, "The capital of France is"], params, use_tqdm=False)
    b = on.generate([prompt, "The capital of France is"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    stats = on.llm_engine.get_stats()
    # the code prompt copies well; the free-text one draws drafts that mostly miss: 28 of 103 in all when written
    assert stats["spec_decode_num_accepted_tokens"] > 0.2 * stats["spec_decode_num_draft_tokens"] > 0
