"""Beam search (Phase 7): the same beams, text and order, as HF transformers' beam search on the same weights; the
beams, requests above the engine core, share their prefix through the prefix cache; the search's own rules on
numbers chosen by hand.

The oracle: `generate(num_beams=k, do_sample=False, num_return_sequences=k, length_penalty=..., early_stopping=...)`
on the default GGUF dequantized to float32 (tests/conftest.py's hf_model), against the engine on the same float32
weights (the `generator` fixture's engine). Three prompts, each with its own length penalty and early stopping; the
second one's beams end with <|im_end|>, so finished hypotheses and their length penalty are compared too.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.engine.beam_search import BeamSearch, BeamSearchParams
from tinyvllm.engine.llm_engine import LLMEngine

CASES = [  # prompt, beam_width, max_tokens, length_penalty, early_stopping
    ("The capital of France is", 3, 8, 1.0, False),
    ("<|im_start|>user\nWhat is 2+2? Reply with the number only.<|im_end|>\n<|im_start|>assistant\n", 4, 8, 0.5, True),
    ("def fibonacci(n):", 3, 8, 2.0, "never"),
]


def run_beam_search(engine: LLMEngine, prompt_ids: list[int], params: BeamSearchParams):
    engine.add_request("beams", prompt_ids, params)
    result, peak_blocks = None, 0
    bm = engine.scheduler.block_manager
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out
        peak_blocks = max(peak_blocks, bm.num_blocks - bm.num_free_blocks)
    return result, peak_blocks


@pytest.mark.oracle
@pytest.mark.parametrize("prompt,k,max_tokens,length_penalty,early_stopping", CASES)
def test_same_beams_as_hf_transformers(generator, hf_model, prompt, k, max_tokens, length_penalty, early_stopping):
    import torch

    engine = generator.engine
    tokenizer = engine.tokenizer
    eos = sorted(tokenizer.stop_token_ids)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([ids]), num_beams=k, do_sample=False, num_return_sequences=k,
                               length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=max_tokens,
                               eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                               return_dict_in_generate=True)
    hf_beams = []
    for row in hf.sequences.tolist():  # generated tokens up to the first eos (padding after it)
        generated = row[len(ids):]
        hf_beams.append(generated[:next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))])
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    out, _ = run_beam_search(engine, ids, params)
    ours = [c.token_ids for c in out.outputs]
    our_scores = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in out.outputs]
    assert ours == hf_beams, (f"beams differ: HF scores {hf.sequences_scores.tolist()} vs ours {our_scores}\n"
                              + "\n".join(f"{tokenizer.decode(a)!r} | {tokenizer.decode(b)!r}"
                                          for a, b in zip(hf_beams, ours)))
    np.testing.assert_allclose(our_scores, hf.sequences_scores.tolist(), atol=1e-4)
    assert [c.text for c in out.outputs] == [tokenizer.decode(b[:-1] if b[-1] in eos else b) for b in hf_beams]
    if early_stopping is True:  # this prompt's beams end with <|im_end|>: eos hypotheses are compared too
        assert any(b[-1] in eos for b in ours), [tokenizer.decode(b) for b in ours]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every beam's blocks back


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                     kv_cache_memory="16MiB", enable_prefix_caching=False)


def test_beams_share_their_prefix_through_the_cache(tiny_model_dir, tiny_engine):
    prompt = [(5 * i) % 300 + 7 for i in range(60)]  # 60 tokens: 3 full blocks and a partial one
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)

    def tokens_computed(engine) -> tuple[object, int]:
        schedule, computed = engine.scheduler.schedule, []

        def counting():
            out = schedule()
            computed.append(out.total_num_scheduled_tokens)
            return out

        engine.scheduler.schedule = counting
        try:
            return run_beam_search(engine, prompt, params)[0], sum(computed)
        finally:
            del engine.scheduler.schedule

    cached = LLMEngine(tiny_model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                       kv_cache_memory="16MiB")
    out, shared = tokens_computed(cached)
    alone, unshared = tokens_computed(tiny_engine)  # prefix caching off: every beam's request computes it all
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 10 for c in out.outputs)
    # each step's request of a beam computes only what its cached full blocks leave: fewer than a block and its
    # new token, against the whole prompt and the beam's tokens without the cache
    assert shared <= len(prompt) + 10 * 4 * 16 < unshared
    scores = [c.cumulative_logprob / 10 for c in out.outputs]
    assert scores == sorted(scores, reverse=True) and len({tuple(c.token_ids) for c in out.outputs}) == 4
    again, _ = run_beam_search(cached, prompt, params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # deterministic


def test_abort_frees_every_beam(tiny_engine):
    tiny_engine.add_request("a", list(range(5, 40)), BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        tiny_engine.step()
    tiny_engine.abort_request("a")
    bm = tiny_engine.scheduler.block_manager
    assert not tiny_engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def logprobs(rows: dict[int, float], vocab: int = 6) -> np.ndarray:
    """A log-probability row: the given tokens, the rest of the mass spread over the others."""
    out = np.full(vocab, np.log(1e-6))
    for token, p in rows.items():
        out[token] = np.log(p)
    return out


def test_search_rules_by_hand():
    """Eos 0. Step 1 from the prompt: tokens 1 (0.6), 2 (0.3), 0 (0.1). The eos candidate ranks third of the 2k = 4
    kept (k = 2), outside the top k: not a hypothesis. Step 2: beam "1" ends (eos 0.9) -> hypothesis
    log(0.54)/2; beam "2" goes on with 3. Early stopping True: done when k hypotheses exist."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5, early_stopping=True), {0}, 100)
    assert search.step([logprobs({1: 0.6, 2: 0.3, 0: 0.1})]) == [(0, 1), (0, 2)] and search.finished == []
    assert search.step([logprobs({0: 0.9, 4: 0.1}), logprobs({3: 0.9, 0: 0.1})]) == [(1, 3), (0, 4)]
    assert [h.tokens for h in search.finished] == [[1, 0]]
    assert np.isclose(search.finished[0].score, np.log(0.54) / 2)
    search.step([logprobs({0: 0.5, 5: 0.5}), logprobs({0: 1.0})])  # "2 3 0" ranks first: a second hypothesis, k reached
    assert search.done and [h.tokens for h in search.finished] == [[1, 0], [2, 3, 0]]


@pytest.mark.phase9  # through the OpenAI server (Phase 9)
def test_server_completions_with_use_beam_search(tiny_model_dir, tiny_engine):
    import httpx

    from api_helpers import serve

    prompt = [(3 * i) % 200 + 9 for i in range(21)]
    offline, _ = run_beam_search(tiny_engine, prompt, BeamSearchParams(beam_width=3, max_tokens=6,
                                                                       length_penalty=0.5))
    with serve(lambda: LLMEngine(tiny_model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                                 kv_cache_memory="16MiB")) as server:
        body = {"prompt": prompt, "n": 3, "max_tokens": 6, "use_beam_search": True, "length_penalty": 0.5}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["text"] for c in choices] == [c.text for c in offline.outputs]
        assert [c["index"] for c in choices] == [0, 1, 2]
        refused = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 2}, timeout=120)
        assert refused.status_code == 400 and "beam search" in refused.text
        # 9 beams on a server whose step holds 8: beams are ordinary requests above the engine core, so they
        # take turns (vLLM v1's beam search), and the answer is the same as offline
        wide, _ = run_beam_search(tiny_engine, prompt, BeamSearchParams(beam_width=9, max_tokens=6, length_penalty=0.5))
        nine = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 9}, timeout=120)
        assert nine.status_code == 200, nine.text
        assert [c["text"] for c in nine.json()["choices"]] == [c.text for c in wide.outputs]