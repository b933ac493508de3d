"""Async output processing (engine/async_output.py): the same outputs, in the same order, as the synchronous step."""

from __future__ import annotations

import threading

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from tinyvllm.engine.fault_injection import FaultInjector
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-async-output"), TINY_CONFIG, seed=3)


def make_engine(tiny_dir, async_output: bool) -> LLMEngine:
    return LLMEngine(tiny_dir, max_model_len=256, max_num_seqs=6, max_num_batched_tokens=48, kv_cache_memory="1MiB",
                     disable_async_output_proc=not async_output)


def stream(engine, requests, arrivals=None, faults=None):
    """Every RequestOutput each request got, in order: (text, token ids, finished, finish reason, stop reason, error)."""
    arrivals = arrivals or {}
    got, step = {}, 0
    while step == 0 or engine.has_unfinished_requests() or any(at >= step for at in arrivals.values()):
        for rid, (prompt, params) in requests.items():
            if arrivals.get(rid, 0) == step:
                engine.add_request(rid, prompt, params)
        for out in (faults or engine).step():
            completions = tuple((c.index, c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason)
                                for c in out.outputs)
            got.setdefault(out.request_id, []).append((completions, out.finished, out.error))
        step += 1
        assert step < 2000, "no progress"
    return got


def streamed(got):
    """What each completion showed, in order (each new text once), and each request's last output. Outputs of
    n > 1 merge their completions, so how many there are depends on which steps the completions share."""
    shown = {}
    for rid, outs in got.items():
        for completions, _, _ in outs:
            for index, text, token_ids, _, _ in completions:
                seen = shown.setdefault((rid, index), [])
                if not seen or seen[-1] != (text, token_ids):
                    seen.append((text, token_ids))
    return shown, {rid: outs[-1] for rid, outs in got.items()}


def workload(stops: dict[str, str]):
    requests = {}
    for i in range(10):
        params = SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=4 + 5 * i, ignore_eos=True,
                                stop=[stops[f"r{i}"]] if f"r{i}" in stops else None, n=2 if i == 4 else 1)
        requests[f"r{i}"] = (f"Request {i}: " + "tell me more " * (1 + 7 * (i % 4)), params)
    return requests


@pytest.fixture(scope="module")
def stop_strings(tiny_dir):
    """Stop strings that occur in the middle of the outputs, taken from a run without them."""
    plain = stream(make_engine(tiny_dir, False), workload({}))
    stops = {}
    for rid in ("r3", "r5", "r6", "r8"):
        text = plain[rid][-1][0][0][1]
        assert len(text) > 12, text
        stops[rid] = text[len(text) // 2:len(text) // 2 + 3]
    return stops


def test_same_outputs_in_the_same_order(tiny_dir, stop_strings):
    requests, arrivals = workload(stop_strings), {"r7": 3, "r8": 5, "r9": 9}
    sync = stream(make_engine(tiny_dir, False), requests, arrivals)
    engine = make_engine(tiny_dir, True)
    threads = []
    make_outputs = engine._make_outputs
    engine._make_outputs = lambda seqs: (threads.append(threading.current_thread().name), make_outputs(seqs))[1]
    overlapped = stream(engine, requests, arrivals)
    assert streamed(overlapped) == streamed(sync)
    assert sum(out[-1][0][0][3] == "stop" for out in sync.values()) == len(stop_strings)  # they did stop
    assert any(name.startswith("tinyvllm-output") for name in threads)  # made beside the forward pass
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert not engine.requests and not engine._pending_outputs


def test_a_failed_detokenization_reaches_its_request_alone(tiny_dir):
    requests = workload({})
    sync = stream(make_engine(tiny_dir, False), requests)
    engine = make_engine(tiny_dir, True)
    faults = FaultInjector(engine)
    faults.fail_detokenization("Request 3:")
    got = stream(engine, requests, faults=faults)
    (completions, finished, error), = got["r3"]  # its first token failed
    assert finished and completions[0][3] == "error" and "injected fault" in error
    del got["r3"], sync["r3"]
    assert streamed(got) == streamed(sync)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_not_with_speculative_decoding(tiny_dir):
    with pytest.raises(ValueError, match="disable_async_output_proc"):
        LLMEngine(tiny_dir, max_model_len=64, kv_cache_memory="1MiB", disable_async_output_proc=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})
