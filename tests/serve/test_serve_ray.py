"""Phase 8: engine replicas on Ray Serve behind one OpenAI endpoint, on a local Ray cluster.

Ray is an optional extra of the package (`pip install tinyvllm[ray]`) and part of the `test` extra, so `make test`
installs it and these tests run in CI (one local cluster for the module); they skip, saying why, where Ray is absent.
The router's choice itself is tested without Ray below.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tinyvllm.serve.router import PrefixAffinityRouter, prefix_hashes

PORT = 8765


def test_router_prefers_the_longest_cached_prefix_then_the_least_loaded():
    router = PrefixAffinityRouter(2, block_chars=4)
    assert prefix_hashes("abcdefghij", 4) == prefix_hashes("abcdefgh", 4)  # whole blocks only
    assert router.choose("aaaabbbb") == 0  # nothing cached, nothing in flight: the lower index
    router.started(0, "aaaabbbb")
    assert router.choose("ccccdddd") == 1  # cold: the less loaded
    router.started(1, "ccccdddd")
    router.started(1, "eeee")
    assert router.choose("aaaabbbbzz") == 0 and router.choose("ccccxxxx") == 1  # affinity beats load
    router.mark_down(0)
    assert router.choose("aaaabbbb") == 1  # a replica down gets nothing
    router.mark_down(1)
    with pytest.raises(RuntimeError, match="no engine replica is up"):
        router.choose("x")
    rr = PrefixAffinityRouter(2, policy="round_robin")
    assert [rr.choose("same prompt") for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="routing policy"):
        PrefixAffinityRouter(2, policy="random")


@pytest.fixture(scope="module")
def ingress(tiny_model_dir):
    ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install tinyvllm[ray])")
    from ray import serve

    from tinyvllm.serve.ray import build_app

    ray.init(num_cpus=1, include_dashboard=False)  # one logical CPU: the deployments ask for none (num_cpus=0)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    server_args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "32",
                   "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
    serve.run(build_app(2, server_args), name="tinyvllm", route_prefix="/")
    yield f"http://127.0.0.1:{PORT}"
    serve.shutdown()
    ray.shutdown()


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = 8,
                 started: asyncio.Queue | None = None) -> dict:
    """One streamed greedy completion: its text, its replica, its finish_reason, and the error event if it ended
    with one. `started` (if given) receives the replica once the response has begun (its headers arrived)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, error, finish_reason = "", None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        replica = int(r.headers["x-tinyvllm-replica"])
        if started is not None:
            started.put_nowait(replica)
        if r.status_code != 200:  # the replica failed before its response began: the ingress's 502
            assert r.status_code == 502, (r.status_code, await r.aread())
            return {"text": "", "replica": replica, "error": json.loads(await r.aread())["error"], "finish": None}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    text += event["choices"][0]["text"]
                    finish_reason = event["choices"][0]["finish_reason"] or finish_reason
    return {"text": text, "replica": replica, "error": error, "finish": finish_reason}


async def many(url: str, prompts: list[str], max_tokens: int = 8) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*[stream(client, url, p, max_tokens) for p in prompts])


def test_32_streams_through_the_ingress_equal_one_engine(ingress, tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.sampling_params import SamplingParams

    prompts = [f"Request {i}: the weather in city number {i * 7} is" for i in range(32)]
    results = asyncio.run(many(ingress, prompts))
    assert {r["replica"] for r in results} == {0, 1}, "distinct prompts spread over both replicas"
    engine = LLMEngine(tiny_model_dir, max_num_seqs=32, kv_cache_memory="16MiB", max_model_len=256)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    expected = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                expected[int(out.request_id)] = out.outputs[0].text
    assert [r["text"] for r in results] == [expected[i] for i in range(32)]
    assert all(r["error"] is None for r in results)
    metrics = httpx.get(ingress + "/metrics").text
    assert 'tinyvllm:router_requests_total{replica="1"}' in metrics and 'replica="0",' in metrics


def test_shared_prefix_lands_on_one_replica(ingress):
    prefix = "You are a careful assistant. Answer in one short sentence, citing the manual. " * 2
    first = asyncio.run(many(ingress, [prefix + "Question 0?"]))[0]["replica"]
    results = asyncio.run(many(ingress, [prefix + f"Question {i}?" for i in range(1, 7)]))
    assert {r["replica"] for r in results} == {first}


def test_a_killed_replica_fails_only_its_own_streams(ingress):
    from ray import serve

    pid = serve.get_deployment_handle("engine-1", app_name="tinyvllm").info.remote().result()["pid"]

    async def scenario():
        async with httpx.AsyncClient(timeout=600) as client:
            started = asyncio.Queue()
            tasks = [asyncio.create_task(stream(client, ingress, f"Long story {i}:", max_tokens=200, started=started))
                     for i in range(8)]
            for _ in range(8):  # kill as soon as a response of replica 1 has begun (the ones after it are then under
                if await started.get() == 1:  # way or not yet sent); 200 tokens take well under a second
                    break
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    summary = [(r["replica"], r["error"], r["finish"]) for r in results]
    on_killed = [r for r in results if r["replica"] == 1]
    on_alive = [r for r in results if r["replica"] == 0]
    assert on_killed and on_alive, summary
    assert all(r["error"] is None and r["finish"] == "length" for r in on_alive), summary
    failed = [r for r in on_killed if r["error"] is not None]
    assert failed and all("replica 1" in r["error"]["message"] for r in failed), summary
    # a stream of the killed replica either ends with that error or had finished before the kill: none is cut
    # short without a word
    assert all(r["error"] is not None or r["finish"] == "length" for r in on_killed), summary
    after = asyncio.run(many(ingress, ["After the failure:"]))[0]  # the ingress keeps serving, on replica 0
    assert after["replica"] == 0 and after["error"] is None
    state = httpx.get(ingress + "/router").json()
    assert state["down"] == [1], (state, summary)


def test_a_replica_whose_engine_fails_to_load_raises_promptly(tiny_model_dir):
    from tinyvllm.serve.ray import EngineReplica

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1 before it was up"):
        EngineReplica.func_or_class(["--model", str(tiny_model_dir), "--max-model-len", "18192"])
    assert time.monotonic() - start < 120
