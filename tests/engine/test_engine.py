"""Phases 3-4: continuous batching gives every request exactly what it gets alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY_CONFIG, write_tiny_model
from tinyvllm.attention.kv_cache import kv_cache_bytes_per_block, resolve_kv_cache_dtype
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.llm import LLM
from tinyvllm.sampling_params import SamplingParams

LONG_TINY = dataclasses.replace(TINY_CONFIG, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), LONG_TINY, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(tiny_dir, max_model_len=2600, max_num_seqs=16, max_num_batched_tokens=64,
                     kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def int8_engine(tiny_dir):
    """The same engine on an int8 KV cache (Phase 7c): scheduling must not notice."""
    return LLMEngine(tiny_dir, max_model_len=2600, max_num_seqs=16, max_num_batched_tokens=64,
                     kv_cache_memory="64MiB", kv_cache_dtype="int8")


def run_all(engine, requests, arrivals=None):
    """requests: {id: (prompt, params)}; arrivals: {id: step at which it is added} (default: all at step 0)."""
    arrivals = arrivals or {rid: 0 for rid in requests}
    outputs, step = {}, 0
    while len(outputs) < len(requests):
        for rid, at in arrivals.items():
            if at == step:
                engine.add_request(rid, *requests[rid])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return outputs


def alone(engine, rid, prompt, params):
    return run_all(engine, {rid + "-alone": (prompt, params)})[rid + "-alone"]


def make_requests(n=24, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 17, 500, 63, 64, 65, 3, 250, 7, 128, 31, 499, 9, 16, 33, 100, 5, 77, 200, 12, 1, 300, 45][:n]
    requests = {}
    for i, length in enumerate(lengths):
        prompt = [int(t) for t in rng.integers(100, 40000, size=length)]
        if i % 3 == 2:  # a sampled request in the mix: it shares the batch but is not compared
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=int(rng.integers(4, 12)))
        elif i % 4 == 3:  # greedy with a penalty and logprobs: sampled on the host, in the same batch
            params = SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2, ignore_eos=True,
                                    max_tokens=int(rng.integers(4, 12)))
        else:
            params = SamplingParams(temperature=0, max_tokens=int(rng.integers(4, 12)), ignore_eos=True)
        requests[f"r{i}"] = (prompt, params)
    return requests


def test_batched_equals_alone(engine):
    requests = make_requests()
    together = run_all(engine, requests)
    staggered = run_all(engine, {f"s{rid}": req for rid, req in requests.items()},
                        arrivals={f"s{rid}": int(i) % 7 * 3 for i, rid in enumerate(requests)})
    for rid, (prompt, params) in requests.items():
        out = together[rid].outputs[0]
        assert len(out.token_ids) == params.max_tokens and out.finish_reason == "length"
        if params.is_greedy:
            expected = alone(engine, rid, prompt, params).outputs[0].token_ids
            assert out.token_ids == expected, rid
            assert staggered[f"s{rid}"].outputs[0].token_ids == expected, rid
        else:  # seeded: reproducible however it was batched
            assert staggered[f"s{rid}"].outputs[0].token_ids == out.token_ids, rid
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# int8: Phase 7c's cache
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.phase7)])
def test_preemption_under_a_small_pool(tiny_dir, kv_cache_dtype):
    per_block = kv_cache_bytes_per_block(LONG_TINY, 16, resolve_kv_cache_dtype(kv_cache_dtype))
    small = LLMEngine(tiny_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                      kv_cache_memory=20 * per_block, kv_cache_dtype=kv_cache_dtype)  # 20 blocks of 16 tokens
    preemptions = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preemptions.append(seq.seq_id), original(seq))
    rng = np.random.default_rng(3)
    requests = {f"p{i}": ([int(t) for t in rng.integers(100, 40000, size=40 + 10 * i)],
                          SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for i in range(6)}
    together = run_all(small, requests)
    assert preemptions, "the pool was meant to be too small for all requests at once"
    for rid, (prompt, params) in requests.items():
        assert together[rid].outputs[0].token_ids == alone(small, rid, prompt, params).outputs[0].token_ids
    assert small.scheduler.block_manager.num_free_blocks == small.scheduler.block_manager.num_blocks


@pytest.mark.parametrize("engine_fixture", ["engine", pytest.param("int8_engine", marks=pytest.mark.phase7)])
def test_long_prompt_does_not_stall_decodes(request, engine_fixture):
    engine = request.getfixturevalue(engine_fixture)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"d{i}", [200 + i] * 5, params)
    while not all(len(engine.scheduler.requests[f"d{i}"].output_token_ids) >= 2 for i in range(3)):
        engine.step()
    engine.add_request("long", list(range(1000, 3000)), SamplingParams(temperature=0, max_tokens=2))
    prefill_steps = 0
    while engine.scheduler.requests["long"].num_output_tokens == 0:
        before = [engine.scheduler.requests[f"d{i}"].num_output_tokens for i in range(3)]
        engine.step()
        after = [engine.scheduler.requests[f"d{i}"].num_output_tokens for i in range(3)]
        assert all(a == b + 1 for a, b in zip(after, before)), "a decode stalled behind the long prompt"
        prefill_steps += 1
    assert prefill_steps >= 2000 // 64  # the prompt really was chunked
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_frees_blocks_immediately(engine):
    bm = engine.scheduler.block_manager
    engine.add_request("a", list(range(100, 180)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(200, 230)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort_request("a")
    held_by_b = len(engine.scheduler.requests["b"].block_table)
    assert bm.num_free_blocks == bm.num_blocks - held_by_b
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks and "a" not in engine.scheduler.requests


def test_no_recompilation_in_steady_state(engine):
    from tinygrad.engine import realize

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    run_all(engine, {f"w{i}": ([300 + i] * (3 + i), params) for i in range(4)})  # warm the buckets it needs
    compiled = len(realize.to_program_cache)
    jits = dict(engine.model_runner._jits)
    run_all(engine, {f"x{i}": ([400 + i] * (3 + i), params) for i in range(4)})
    assert len(realize.to_program_cache) == compiled
    assert engine.model_runner._jits == jits


def test_lm_head_computes_the_rows_a_step_samples(engine):
    # a step's graph is keyed by (token bucket, rows of logits): lm_head runs on the rows sampled this step, padded
    # to a bucket, not on one row per sequence the engine could hold (16 here)
    runner = engine.model_runner
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run_all(engine, {"rows-one": ([7] * 40, params)})  # one 40-token prefill (token bucket 64), then one decode
    run_all(engine, {f"rows-{i}": ([9 + i] * 5, params) for i in range(3)})  # 3 prompts, 15 tokens in one step
    assert (64, 1) in runner._jits and (1, 1) in runner._jits
    assert (16, 4) in runner._jits  # 3 rows of logits, bucket 4
    assert all(rows <= n for n, rows in filter(lambda k: isinstance(k[0], int), runner._jits))


def test_bad_requests_are_rejected_without_side_effects(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("too-long", [5] * engine.max_model_len)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad-ids", [-1, 5])
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6])
    run_all(engine, {})
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.scheduler.requests and not engine.output_processor.request_states


def test_llm_generate_matches_phase1_on_the_real_model(generator):
    llm = LLM(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="128MiB",
              quantization="none")  # the generator fixture's weights: dequantized
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, in a"]
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        expected = generator.generate(prompt, params)
        assert out.outputs[0].token_ids == expected.token_ids
        assert out.outputs[0].text == expected.text and out.finished
    assert "Paris" in outputs[0].outputs[0].text
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [params])


def test_n_completions_per_request(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = run_all(engine, {"n3": ([100, 200, 300], params)})["n3"]
    again = run_all(engine, {"n3-again": ([100, 200, 300], params)})["n3-again"]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # seed + index: the completions differ


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.phase7)])
def test_prefix_caching_reuses_a_prompt_and_gives_the_same_tokens(tiny_dir, kv_cache_dtype):
    """Turn 2 of a chat resends turn 1: its prompt's full blocks come from the cache, the output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    system = list(range(300, 340))  # 40 tokens: two full blocks of 16 shared by every request below
    outputs = {}
    for caching in (False, True):
        engine = LLMEngine(tiny_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                           kv_cache_memory="16MiB", enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype)
        first = run_all(engine, {"t1": (system + [5, 6, 7], params)})["t1"]
        second = run_all(engine, {"t2": (system + [5, 6, 7] + first.outputs[0].token_ids + [9], params)})["t2"]
        together = run_all(engine, {f"u{i}": (system + [i], params) for i in range(3)})
        outputs[caching] = (first, second, together, engine.get_stats())
    (first_off, second_off, together_off, stats_off), (first, second, together, stats) = outputs[False], outputs[True]
    assert first.outputs[0].token_ids == first_off.outputs[0].token_ids and first.num_cached_tokens == 0
    assert second.outputs[0].token_ids == second_off.outputs[0].token_ids
    assert second.num_cached_tokens == 48 and second_off.num_cached_tokens == 0  # 3 of its 4 blocks were full
    for i in range(3):
        assert together[f"u{i}"].outputs[0].token_ids == together_off[f"u{i}"].outputs[0].token_ids
        assert together[f"u{i}"].num_cached_tokens == 32
    assert stats["prefix_cache_hits"] == 48 + 3 * 32 and stats_off["prefix_cache_queries"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
