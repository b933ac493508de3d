"""Phase 9: `/metrics` under vLLM's names, so vLLM's Grafana dashboard reads this server unchanged
(tinyvllm/api/metrics.py).

The series the dashboard queries are saved in vllm_grafana_series.txt (beside this file; it says where they come
from). The server runs around `FakeLLMEngine`, whose steps we can hold (`gate`) to watch a request mid-way.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from api_helpers import metrics, serve, wait_for
from fake_engine import FakeLLMEngine

MODEL = "fake-smollm2"
VLLM_LABELS = f'model_name="{MODEL}",engine="0"'
DASHBOARD_SERIES = [line for line in (Path(__file__).parent / "vllm_grafana_series.txt").read_text().splitlines()
                    if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine()) as server:
        yield server


def complete(server, prompt: str, max_tokens: int) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_every_series_of_vllms_dashboard_exists_with_vllms_labels(server):
    complete(server, "Hello there", 4)
    samples = metrics(server)
    assert len(DASHBOARD_SERIES) >= 15
    for name in DASHBOARD_SERIES:  # each with the labels the dashboard filters on
        found = [key for key in samples if re.fullmatch(rf"{re.escape(name)}\{{{re.escape(VLLM_LABELS)}(,.*)?\}}",
                                                         key)]
        assert found, f"{name}{{{VLLM_LABELS}}} is missing from /metrics"
    # vLLM's other series the dashboard does not draw, under the same labels
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "iteration_tokens_total_count", "time_per_output_token_seconds_count",
                 "request_inference_time_seconds_sum", "request_params_n_count", "request_params_max_tokens_count"):
        assert f"vllm:{name}{{{VLLM_LABELS}}}" in samples, name
    # one count behind both names
    for name in ("generation_tokens_total", "prompt_tokens_total", "e2e_request_latency_seconds_count"):
        assert samples[f"vllm:{name}{{{VLLM_LABELS}}}"] == samples[f"tinyvllm:{name}"] > 0
    assert samples[f'vllm:request_success_total{{{VLLM_LABELS},finished_reason="length"}}'] >= 1
    assert samples[f'vllm:request_success_total{{{VLLM_LABELS},finished_reason="stop"}}'] >= 0
    # ours alone: vLLM has no name for it, so no vllm: copy
    assert "tinyvllm:num_kv_blocks_used" in samples and not any(k.startswith("vllm:num_kv_blocks") for k in samples)


def test_iteration_tokens_are_prompt_plus_generated_tokens_per_step(server):
    """vLLM counts a step's tokens as the prompt of each request whose first token it made, plus the tokens it
    generated; over a request's life that is prompt + generated (the prefill step's sampled token included)."""
    before = metrics(server)
    usage = complete(server, "The quick brown fox", 6)["usage"]
    after = metrics(server)

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("tinyvllm:iteration_tokens_total_sum") == usage["prompt_tokens"] + usage["completion_tokens"]
    assert grew("tinyvllm:iteration_tokens_total_sum") == grew("tinyvllm:prompt_tokens_total") + \
        grew("tinyvllm:generation_tokens_total")
    assert grew("tinyvllm:iteration_tokens_total_count") == usage["completion_tokens"]  # one step per token
    assert grew(f"vllm:iteration_tokens_total_sum{{{VLLM_LABELS}}}") == grew("tinyvllm:iteration_tokens_total_sum")
    assert grew(f"vllm:request_max_num_generation_tokens_sum{{{VLLM_LABELS}}}") == usage["completion_tokens"]


def test_a_request_the_client_leaves_counts_as_aborted():
    engine = FakeLLMEngine(step_time=0.05)
    with serve(lambda: engine) as server:
        before = metrics(server)
        engine.gate.clear()  # hold the steps: the request stays unfinished
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 50, "stream": True}) as response:
            assert response.status_code == 200
            wait_for(engine.at_gate.is_set, what="a step waiting at the gate")
        engine.gate.set()  # the client has left
        name = f'vllm:request_success_total{{{VLLM_LABELS},finished_reason="abort"}}'
        wait_for(lambda: metrics(server)[name] == before[name] + 1, what="the abort to be counted")
        assert metrics(server)["tinyvllm:num_kv_blocks_used"] == 0
