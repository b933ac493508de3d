"""Phase 9: the reliability suite, bounded (benchmarks/bench_reliability.py is the full one, with figures).

The same scenario functions as the benchmark, smaller, on engines that cost no model time: the fake engine
(tests/fake_engine.py: the engine's contract, deterministic tokens, the real tokenizer and stop strings) for
load, disconnects, overload, fuzzing and a restart; a tiny random model for the faults, which need the real
scheduler, block manager and detokenizer. Each one's invariant is asserted, so each can fail:

    soak         every stream ends with [DONE] and equals the same request sent alone
    disconnect   the kept streams finish; every KV block is free afterwards
    faults       the requests hit end with a clear error, the others equal their output alone, /health 200
    overload     only 200s and 429s with Retry-After; the retrying openai client finishes every request
    fuzz         no 5xx, no failed check
    restart      SIGTERM: every stream finishes or ends with an error event within the grace period, and
                 a new server on the same port serves while the old one drains
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fake_engine import FakeLLMEngine

from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_reliability as rel  # noqa: E402

MODEL = "fake-smollm2"


@contextmanager
def serve(engine_factory, max_waiting: int = 256):
    engine = AsyncLLMEngine(engine_factory, max_waiting=max_waiting)
    with BackgroundServer(build_app(engine), timeout=300) as server:
        yield server


def test_soak():
    with serve(lambda: FakeLLMEngine(step_time=0.002, max_num_seqs=64, num_blocks=1024)) as server:
        result = rel.soak(server.url, MODEL, clients=64, rounds=2, max_tokens=8, wide=False)  # the fake has no beams
    assert result["alone_finished"] == 64 and result["incomplete"] == 0
    assert result["mismatches_vs_alone"] == 0
    assert [r["completed_with_done"] for r in result["rounds"]] == [64, 64]
    assert all(r["ttft_p99_ms"] is not None for r in result["rounds"])
    assert result["kv_blocks_free_after_s"] is not None


def test_disconnect_storm():
    with serve(lambda: FakeLLMEngine(step_time=0.01, max_num_seqs=48, num_blocks=4096, max_model_len=1024)) as server:
        result = rel.disconnect_storm(server.url, MODEL, streams=32, timeouts=6, max_tokens=48)
    assert result["dropped"] == 16 and result["timed_out"] == 6
    assert result["kept_finished"] == result["kept"] == 16
    assert result["kv_blocks_used_after"] == 0 and result["seconds_to_free"] is not None


def test_faults(tiny_model_dir):
    from tinyvllm.engine.fault_injection import FaultInjector
    from tinyvllm.engine.llm_engine import LLMEngine

    injectors = []

    def make_engine():
        engine = LLMEngine(tiny_model_dir, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
                           num_gpu_blocks_override=256)
        injectors.append(FaultInjector(engine))
        return engine

    with serve(make_engine) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        result = rel.faults(server.url, model, injectors[0], max_tokens=12, victim_tokens=400, others=4)
    assert result["step"] == {"hit": 4, "hit_with_clear_error": 4, "others": 4, "others_equal_alone": 4}
    assert result["detokenization"] == {"hit_with_clear_error": 1, "others": 4, "others_equal_alone": 4}
    assert result["kv_pool_dry"] == {"hit": 4, "hit_with_clear_error": 4, "others": 4, "others_equal_alone": 4}
    assert result["healthy_after"] and result["kv_blocks_free_after_s"] is not None
    assert result["fired"]["step"] == 1 and result["fired"]["detokenization"] == 1


def test_overload():
    with serve(lambda: FakeLLMEngine(step_time=0.01, max_num_seqs=2), max_waiting=8) as server:
        result = rel.overload(server.url, MODEL, queue_limit=8, max_tokens=4)
    assert result["burst"] == 32 and result["status_200"] + result["status_429"] == 32
    assert result["status_429"] > 0 and result["status_5xx"] == 0 and result["other_statuses"] == 0
    assert result["retry_after_missing"] == 0
    assert result["retried_finished"] == 32


def test_fuzz_reports_cases_and_server_errors():
    with serve(lambda: FakeLLMEngine(max_model_len=256, num_blocks=512), max_waiting=64) as server:
        result = rel.fuzz(server.url, {}, positive=12, negative=6, budget_s=30)
    assert result["cases"] >= 40 and result["operations"] >= 6
    assert result["server_errors"] == 0 and result["check_failures"] == 0, result["first_failures"]


SERVER = """
import sys
sys.path.insert(0, sys.argv[3])
from fake_engine import FakeLLMEngine
from tinyvllm.api.launcher import serve
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine
engine = AsyncLLMEngine(lambda: FakeLLMEngine(step_time=0.02, max_model_len=4096, num_blocks=2048))
serve(build_app(engine), engine, port=int(sys.argv[1]), shutdown_timeout=float(sys.argv[2]), log_level="warning")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_restart_drains_within_the_grace_period():
    grace = 2.0

    def command(port: int) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port), str(grace), str(ROOT / "tests")]

    # 1 s after the start (50 steps of 20 ms) the signal comes: the short streams (100 tokens) finish within
    # the grace period, the long ones (2000) are ended by it
    result = rel.restart(command, grace, streams=8, short_tokens=100, long_tokens=2000)
    assert result["finished"] == 4 and result["ended_with_error_event"] == 4, result
    assert result["cut_without_done"] == 0 and result["new_requests_refused_while_draining"]
    assert grace - 0.5 <= result["drain_s"] <= grace + 2.0, result
    assert result["new_server_listening_s"] is not None and result["new_server_first_200_s"] is not None
