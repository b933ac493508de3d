"""Phase 1's whole engine, `generate` (tinyvllm/engine/contiguous_runner.py): greedy tokens equal HF transformers' on
the real model, and each way a generation ends (max_tokens, a stop token, a stop string, the end of the cache) on a
tiny random model."""

from __future__ import annotations

import pytest

from tinyvllm.engine.contiguous_runner import ContiguousModelRunner, generate
from tinyvllm.model.loader import load_model
from tinyvllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer, _ = load_model(tiny_model_dir)
    return ContiguousModelRunner(model, max_model_len=24), tokenizer


def run(runner, tokenizer, prompt_ids, **params) -> tuple[list[int], str]:
    out = list(generate(runner, tokenizer, prompt_ids, SamplingParams(**params)))
    return [token for token, _ in out], "".join(piece for _, piece in out)


@pytest.mark.oracle
@pytest.mark.slow
def test_greedy_tokens_equal_hf_transformers(hf_model):
    from test_generate import hf_greedy

    model, tokenizer, _ = load_model(quantization="none")  # the float32 weights HF runs
    runner = ContiguousModelRunner(model, max_model_len=128)
    ids = tokenizer.encode("The capital of France is")
    tokens, text = run(runner, tokenizer, ids, temperature=0, max_tokens=24, ignore_eos=True)
    assert tokens == hf_greedy(hf_model, ids, 24)[1]
    assert text == tokenizer.decode(tokens)


def test_max_tokens_and_the_text_of_each_token(tiny):
    runner, tokenizer = tiny
    tokens, text = run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=5, ignore_eos=True)
    assert len(tokens) == 5 and text == tokenizer.decode(tokens)
    # the runner keeps no state between generations: the same prompt gives the same tokens
    assert run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=5, ignore_eos=True)[0] == tokens


def test_a_stop_token_ends_the_output_unshown(tiny):
    runner, tokenizer = tiny
    tokens, _ = run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=5, ignore_eos=True)
    stop = tokens[2]
    first = tokens.index(stop)
    ended, text = run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=5, ignore_eos=True,
                      stop_token_ids=[stop])
    assert ended == tokens[:first + 1] and text == tokenizer.decode(tokens[:first])


def test_a_stop_string_ends_the_output(tiny):
    runner, tokenizer = tiny
    tokens, text = run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=8, ignore_eos=True)
    piece = tokenizer.decode(tokens[3:4])
    assert piece.strip(), "the tiny model's fourth token should have visible text"
    _, stopped = run(runner, tokenizer, [504, 3575], temperature=0, max_tokens=8, ignore_eos=True, stop=[piece])
    assert stopped == text[:text.index(piece)]


def test_the_end_of_the_cache_ends_the_output(tiny):
    runner, tokenizer = tiny
    tokens, _ = run(runner, tokenizer, list(range(100, 120)), temperature=0, max_tokens=None, ignore_eos=True)
    assert len(tokens) == runner.max_model_len - 20  # 20 prompt positions, then one per token until the cache is full


def test_a_seed_repeats_a_sampled_output(tiny):
    runner, tokenizer = tiny
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    first = run(runner, tokenizer, [504, 3575], seed=7, **params)[0]
    assert run(runner, tokenizer, [504, 3575], seed=7, **params)[0] == first
    assert any(run(runner, tokenizer, [504, 3575], seed=s, **params)[0] != first for s in (8, 9, 10))
