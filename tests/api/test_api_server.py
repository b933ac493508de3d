"""Phase 9: the OpenAI API, served by a real uvicorn server on 127.0.0.1 and read by the official client.

These tests run the server around `FakeLLMEngine` (tests/fake_engine.py): the engine's contract with
deterministic tokens and no model, so they take seconds. Each answer is checked against the same
engine run offline, the way `tests/api/test_api_real_engine.py` checks the real one. Errors, backpressure
and disconnects are in `tests/api/test_api_errors.py`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from api_helpers import async_client, client, histogram_count_above, metrics, serve, stream_json
from fake_engine import FakeLLMEngine, run_offline

from tinyvllm.sampling_params import SamplingParams

MODEL = "fake-smollm2"
PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "def f(x):", "Once upon a time"]


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine(step_time=0.002)) as server:
        yield server


def offline(prompt, **params) -> object:
    """What a fresh engine produces for the request alone."""
    return run_offline(FakeLLMEngine(), prompt, SamplingParams(**params))


def chat_prompt_ids(messages: list[dict]) -> list[int]:
    tokenizer = FakeLLMEngine().tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_offline(server, prompt):
    response = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    expected = offline(prompt, temperature=0, max_tokens=8).outputs[0]
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (expected.text, expected.finish_reason, 0)
    assert response.object == "text_completion" and response.model == MODEL and response.id.startswith("cmpl-")
    prompt_tokens = len(FakeLLMEngine().tokenizer.encode(prompt))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_completion_stream_equals_offline(server):
    expected = offline("Hello", temperature=0, max_tokens=12).outputs[0]
    chunks = list(client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_ends_with_done_and_has_usage_only_when_asked(server):
    events, raw = stream_json(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert raw[-1] == "[DONE]"
    assert all("usage" not in event for event in events)
    events, raw = stream_json(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                          "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens"] == 4 and events[-1]["choices"] == []


def test_chat_equals_offline(server):
    messages = [{"role": "user", "content": "What is the tallest mountain?"}]
    expected = offline(chat_prompt_ids(messages), temperature=0, max_tokens=10).outputs[0]
    response = client(server).chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                      temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.usage.prompt_tokens == len(chat_prompt_ids(messages))

    chunks = list(client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage.total_tokens == response.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_content_parts_and_system_message(server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    flat = [messages[0], {"role": "user", "content": "Hi there"}]
    expected = offline(chat_prompt_ids(flat), temperature=0, max_tokens=5).outputs[0]
    response = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert response.choices[0].message.content == expected.text


def test_stop_strings_and_finish_reasons(server):
    full = offline("Hello", temperature=0, max_tokens=6).outputs[0].text  # " five six seven ..."
    stop = full.split()[2]
    for stop_arg in (f" {stop}", [" nothing", f" {stop}"]):
        response = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                                      stop=stop_arg)
        assert response.choices[0].text == full[: full.index(f" {stop}")]
        assert response.choices[0].finish_reason == "stop"
    # the fake's greedy words run out into eos: finish_reason "stop" without a stop string
    response = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=50, temperature=0)
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens < 50


def test_seed_n_and_sampling_fields(server):
    c = client(server)
    fields = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0.8, top_p=0.9, presence_penalty=0.5,
                  frequency_penalty=0.1, logit_bias={"42": -5}, user="test-user",
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    a = c.completions.create(seed=7, n=3, **fields)
    b = c.completions.create(seed=7, n=3, **fields)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == 1
    # choice i is the request alone with seed + i (vLLM's n > 1: one child request per choice)
    for i, choice in enumerate(a.choices):
        expected = offline("Hello", seed=7 + i, max_tokens=8, temperature=0.8, top_p=0.9, presence_penalty=0.5,
                           frequency_penalty=0.1, logit_bias={42: -5}, top_k=20, min_p=0.05,
                           repetition_penalty=1.1).outputs[0]
        assert choice.text == expected.text


def test_n_streamed(server):
    events, _ = stream_json(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, "seed": 3})
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length"


def test_completion_logprobs_and_echo(server):
    response = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                                 logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the sampled token + 2 alternatives

    echoed = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + response.choices[0].text
    events, _ = stream_json(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                        "echo": True})
    assert events[0]["choices"][0]["text"].startswith("Hello")
    assert "".join(e["choices"][0]["text"] for e in events) == echoed.choices[0].text


def test_chat_logprobs(server):
    messages = [{"role": "user", "content": "hi"}]
    response = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                      logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    plain = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_token_id_prompt(server):
    ids = FakeLLMEngine().tokenizer.encode("Hello")
    by_ids = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_32_concurrent_streaming_clients(server):
    prompts = [f"Request number {i} says" for i in range(32)]
    expected = [offline(p, temperature=0, max_tokens=8).outputs[0] for p in prompts]
    before = metrics(server)

    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return "".join(ch.choices[0].text for ch in chunks[:-1]), chunks[-2].choices[0].finish_reason, chunks[-1].usage

    async def all_of_them():
        c = async_client(server)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(all_of_them())
    for (text, finish_reason, usage), want in zip(results, expected):
        assert (text, finish_reason, usage.completion_tokens) == (want.text, want.finish_reason, len(want.token_ids))
    after = metrics(server)
    # continuous batching: some engine steps ran more than one request
    assert histogram_count_above(after, "tinyvllm:num_running_per_step", 1) > \
        histogram_count_above(before, "tinyvllm:num_running_per_step", 1)
    generated = sum(len(w.token_ids) for w in expected)
    assert after["tinyvllm:generation_tokens_total"] - before["tinyvllm:generation_tokens_total"] == generated


def test_metrics_counts_and_histograms(server):
    before = metrics(server)
    client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    after = metrics(server)
    assert after["tinyvllm:prompt_tokens_total"] - before["tinyvllm:prompt_tokens_total"] == 1
    assert after["tinyvllm:generation_tokens_total"] - before["tinyvllm:generation_tokens_total"] == 4
    def grew(name: str) -> float:
        return after[f"tinyvllm:{name}"] - before[f"tinyvllm:{name}"]

    assert grew("time_to_first_token_seconds_count") == 1 and grew("e2e_request_latency_seconds_count") == 1
    assert grew("inter_token_latency_seconds_count") == 3  # 4 tokens, 3 gaps
    assert after['tinyvllm:request_success_total{finished_reason="length"}'] >= 1
    assert after["tinyvllm:num_requests_running"] == 0 and after["tinyvllm:num_kv_blocks_used"] == 0
    assert after["tinyvllm:num_kv_blocks_total"] == 64


def test_bench_serving_runs(server):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_serving import report, run_benchmark

    results, wall = asyncio.run(run_benchmark(server.url, concurrency=4, num_requests=8, max_tokens=6))
    assert len(results) == 8 and all(r.error is None and r.output_tokens == 6 for r in results)
    assert all(r.ttft > 0 and len(r.itl) >= 1 for r in results)
    report(results, wall, 4)


def test_cli_help():
    result = subprocess.run([sys.executable, "-m", "tinyvllm.api.server", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "--max-waiting" in result.stdout and "--api-key" in result.stdout
