"""Phase 1 end to end on the real shipped model, with HF transformers as the oracle."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = {
    "prose": "The capital of France is",
    "code": "def fibonacci(n):\n    ",
    "numbers": "1, 2, 3, 5, 8, 13, 21,",
    "unicode": "Le café coûte 3 € — 東京は日本の首都です。 Emoji: 🚀",
    "chat": None,  # filled from the chat template below
    "long": ("Paged attention stores the key-value cache in fixed-size blocks, much like an operating system "
             "stores a process's memory in pages. A block table maps each sequence's logical blocks to physical "
             "blocks, so memory is allocated on demand and almost nothing is wasted. Continuous batching then lets "
             "new requests join the running batch at every step. In summary,"),
}


def prompt_ids(generator, name: str) -> list[int]:
    if name == "chat":
        return generator.encode_prompt("What is the tallest mountain in the world?", chat=True)
    return generator.encode_prompt(PROMPTS[name])


def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """HF's last-position logits for the prompt, and its greedy continuation (no stop on eos)."""
    import torch

    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        first_logits = out.logits[0, -1].numpy().copy()
        past, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return first_logits, tokens


def first_token_logprobs(engine, ids: list[int]) -> tuple[float, list[tuple[int, float]]]:
    """The engine's (logprob of the greedy token, top-20 [(token, logprob)]) after the prompt."""
    engine.add_request("first-token-logprobs", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return outputs[0].outputs[0].logprobs[0]


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_and_greedy_tokens_match_hf(generator, hf_model, name):
    ids = prompt_ids(generator, name)
    hf_logits, hf_tokens = hf_greedy(hf_model, ids, 32)
    # the engine's first-token logprobs (the top 20, from its paged forward pass) against HF's log-softmax
    _, top = first_token_logprobs(generator.engine, ids)
    hf_logprobs = hf_logits - np.log(np.exp(hf_logits - hf_logits.max()).sum()) - hf_logits.max()
    max_diff = max(abs(lp - hf_logprobs[token]) for token, lp in top)
    print(f"{name}: {len(ids)} prompt tokens, first-token top-20 logprobs max |diff| = {max_diff:.2e}")
    assert max_diff < 1e-3 and top[0][0] == hf_tokens[0]
    result = generator.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert result.token_ids == hf_tokens


def test_capital_of_france(generator):
    result = generator.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in result.text
    assert result.finish_reason == "length" and len(result.token_ids) == 8


def test_stream_joins_to_generate(generator):
    params = SamplingParams(temperature=0, max_tokens=12)
    chunks = list(generator.stream("Once upon a time", params))
    result = generator.generate("Once upon a time", params)
    assert "".join(c.text for c in chunks) == result.text
    assert [c.token_id for c in chunks] == result.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_a_request_that_fails_in_the_step_raises_with_the_engines_message(generator, monkeypatch):
    # the engine finishes a request that failed inside a step with "error"; the stream says so, not an IndexError
    def failing(seq, *args):
        raise RuntimeError("injected sampler failure")
    monkeypatch.setattr(generator.engine.model_runner.sampler, "sample_on_host", failing)
    with pytest.raises(RuntimeError, match="failed in the engine step: .*injected sampler failure"):
        generator.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4, logprobs=1))
    bm = generator.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not generator.engine.has_unfinished_requests()
    monkeypatch.undo()
    assert len(generator.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4)).token_ids) == 4


def test_stop_string_is_not_emitted(generator):
    full = generator.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    assert "answer" in full.text
    cut = generator.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["answer"]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("answer")]
    kept = generator.generate("The capital of France is",
                              SamplingParams(temperature=0, max_tokens=12, stop=["answer"],
                                             include_stop_str_in_output=True))
    assert kept.text == full.text[: full.text.index("answer") + len("answer")]


def test_eos_stops_generation(generator):
    result = generator.generate("What is 2+2?", SamplingParams(temperature=0, max_tokens=64), chat=True)
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in generator.tokenizer.stop_token_ids
    assert "<|im_end|>" not in result.text and "4" in result.text


def test_seeded_sampling_reproduces(generator):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    a = generator.generate("Tell me a story about", params)
    b = generator.generate("Tell me a story about", params)
    c = generator.generate("Tell me a story about", SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                  max_tokens=10, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_prompt_longer_than_context_is_a_clear_error(generator):
    with pytest.raises(ValueError, match="max_model_len"):
        generator.generate([1] * generator.max_model_len, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt token ids"):
        generator.generate([10**9], SamplingParams(max_tokens=1))


def test_generation_stops_when_the_context_is_full(generator):
    n = generator.max_model_len - 3
    result = generator.generate([198] * n, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def run_main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)


def test_main_prints_paris_and_stats():
    proc = run_main("--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                    "--max-model-len", "256")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "time to first token" in proc.stderr and "tok/s" in proc.stderr and "generated 8 tokens" in proc.stderr
    # what the first token needs is compiled (or loaded) before the request is timed, and the line says what it took;
    # the decode step's graph comes at the second token, and the decode rate leaves that step out, saying so
    assert re.search(r"compiled \d+ kernels \(\d+ from the cache\) and \d+ graphs for the first token in",
                     proc.stderr)
    assert re.search(r"tok/s \(leaving out [\d.]+ s of getting 1 graph ready after the first token\)", proc.stderr)


def test_the_decode_rate_leaves_out_the_steps_that_built_a_graph(tiny_model_dir):
    from tinyvllm.engine.generator import Generator

    generator = Generator(tiny_model_dir, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=16,
                          max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = generator.generate(list(range(300, 310)), params)  # its second token builds the decode step's graph
    assert first.graphs_built >= 1 and first.build_tokens == 1 and 0 < first.build_time < first.decode_time
    assert first.decode_tokens_per_s == pytest.approx(4 / (first.decode_time - first.build_time))
    again = generator.generate(list(range(400, 410)), params)  # every graph there already
    assert again.graphs_built == again.build_tokens == 0 and again.build_time == 0.0
    assert again.decode_tokens_per_s == pytest.approx(5 / again.decode_time)


def test_warm_up_compiles_without_touching_the_request(tiny_model_dir):
    from tinyvllm.engine.generator import Generator

    generator = Generator(tiny_model_dir, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=16,
                          max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(300, 320))  # 20 tokens: one full block of 16 that a prefix-cache hit could reuse
    line = generator.warm_up(prompt, params)
    # a new runner: its graphs built or read ("compiled N kernels (K from the cache) and G graphs" from Phase 6 on)
    assert re.search(r"\b[1-9]\d* graphs for the first token in", line)
    manager = generator.engine.scheduler.block_manager
    hits = manager.prefix_cache_hits
    warmed = generator.generate(prompt, params)
    assert manager.prefix_cache_hits == hits  # the warm-up's prompt was other tokens: nothing cached is reused
    assert warmed.graphs_built == 1  # the decode step's, at the second token; the first token's were ready
    cold = Generator(tiny_model_dir, max_model_len=128, kv_cache_memory="1MiB", max_num_batched_tokens=16,
                     max_num_seqs=4)
    assert cold.generate(prompt, params).token_ids == warmed.token_ids


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--model", "/no/such/model.gguf"], "no checkpoint"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
])
def test_main_errors_are_one_clear_line(args, message):
    proc = run_main(*args)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
