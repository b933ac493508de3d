"""Phase 9 on the real shipped model: the server's greedy answers equal the engine's own offline ones.

One `LLMEngine` is built for the module; it first runs the prompts offline (all at once, which also
compiles the batch sizes the server will need), then serves them through a live server on 127.0.0.1
to the official `openai` client. Outputs are kept short: the model decodes tens of tokens per second
on a small CPU.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from api_helpers import async_client, client, histogram_count_above, metrics, serve, wait_for

from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(30)] + [
    "The capital of France is", "def fibonacci(n):\n   "]
CHAT = [{"role": "user", "content": "What is the tallest mountain in the world?"}]


def run_offline(engine, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    """All prompts at once through `add_request` / `step`, as `LLM.generate` does."""
    ids = [f"offline-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return [finished[request_id] for request_id in ids]


@pytest.fixture(scope="module")
def engine():
    from tinyvllm.engine.llm_engine import LLMEngine

    return LLMEngine(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def offline(engine):
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    results = run_offline(engine, [*PROMPTS, chat_ids], GREEDY)
    sampled = run_offline(engine, [PROMPTS[-2]], SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=8))[0]
    return {"prompts": results[:-1], "chat": results[-1], "sampled": sampled}


@pytest.fixture(scope="module")
def server(engine, offline):
    with serve(lambda: engine) as server:  # the engine moves to the server's engine thread
        yield server


def test_completions_equal_offline(server, engine, offline):
    c = client(server)
    for prompt, want in zip(PROMPTS[-2:], offline["prompts"][-2:]):
        response = c.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, temperature=0)
        choice, usage = response.choices[0], response.usage
        assert (choice.text, choice.finish_reason) == (want.outputs[0].text, want.outputs[0].finish_reason)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), 8)
        chunks = list(c.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        assert "".join(chunk.choices[0].text for chunk in chunks[:-1]) == want.outputs[0].text
        assert chunks[-1].usage.completion_tokens == 8


def test_chat_equals_offline(server, engine, offline):
    want = offline["chat"].outputs[0]
    c = client(server)
    response = c.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == want.text
    assert response.usage.prompt_tokens == len(offline["chat"].prompt_token_ids)
    chunks = list(c.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_n_with_seed_equals_offline(server, engine, offline):
    response = client(server).completions.create(model=engine.model_name, prompt=PROMPTS[-2], n=2, seed=5,
                                                 temperature=0.8, max_tokens=8)
    assert [choice.text for choice in response.choices] == [out.text for out in offline["sampled"].outputs]


def test_32_concurrent_streaming_clients(server, engine, offline):
    before = metrics(server)

    async def one(c, prompt):
        stream = await c.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return "".join(ch.choices[0].text for ch in chunks[:-1]), chunks[-2].choices[0].finish_reason, chunks[-1].usage

    async def all_at_once():
        c = async_client(server)
        return await asyncio.gather(*(one(c, prompt) for prompt in PROMPTS))

    results = asyncio.run(all_at_once())
    for (text, finish_reason, usage), want in zip(results, offline["prompts"]):
        assert (text, finish_reason) == (want.outputs[0].text, want.outputs[0].finish_reason)
        assert usage.completion_tokens == len(want.outputs[0].token_ids)
    after = metrics(server)
    # they shared forward passes: steps with more than 8 requests in the batch happened
    assert histogram_count_above(after, "tinyvllm:num_running_per_step", 8) > \
        histogram_count_above(before, "tinyvllm:num_running_per_step", 8)
    assert after["tinyvllm:num_kv_blocks_used"] == 0


def test_disconnect_frees_blocks(server, engine):
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(2):
            assert next(lines).startswith("data: ") and next(lines) == ""
        assert metrics(server)["tinyvllm:num_kv_blocks_used"] > 0
    wait_for(lambda: not engine.has_unfinished_requests(), timeout=60, what="the abort")
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_main_llm_and_server_give_the_same_greedy_text(server, engine):
    """One engine under every entry point: main.py (a process of its own), LLM.generate and the server."""
    import subprocess
    import sys
    from pathlib import Path

    from tinyvllm import LLM

    prompts = PROMPTS[-2:]
    llm = LLM(engine.model, tokenizer=engine.tokenizer, max_model_len=512, kv_cache_memory="64MiB")
    offline = [out.outputs[0].text for out in llm.generate(prompts, GREEDY)]
    served = [client(server).completions.create(model=engine.model_name, prompt=prompt, max_tokens=8,
                                                temperature=0).choices[0].text for prompt in prompts]
    root = Path(__file__).resolve().parents[2]
    printed = []
    for prompt in prompts:
        proc = subprocess.run([sys.executable, str(root / "main.py"), "--prompt", prompt, "--max-tokens", "8",
                               "--temperature", "0", "--max-model-len", "512"],
                              capture_output=True, text=True, timeout=600, cwd=root)
        assert proc.returncode == 0, proc.stderr
        printed.append(proc.stdout.removesuffix("\n"))
    assert offline == served == printed, (offline, served, printed)
