"""The server's isolation defects, each as the exact request that showed it, against a real (tiny) engine.

Eight streams run; then a bad request arrives. Before, it made the engine step raise: the sender got a
500 and every stream an `internal_error` event. Now a request the engine cannot serve is a 400 naming
its field before it reaches the engine, and one that can (a huge `top_k`) is served; the streams finish.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from api_helpers import serve

from conftest import write_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tinyvllm.engine.llm_engine import LLMEngine

    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny-isolation"), seed=3)
    with serve(lambda: LLMEngine(tiny, max_model_len=512, kv_cache_memory="16MiB", max_num_seqs=16,
                                 max_num_batched_tokens=64)) as server:
        yield server


async def stream_chat(c: httpx.AsyncClient, started: asyncio.Event, max_tokens: int) -> list[dict]:
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    events = []
    async with c.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    return events


@pytest.mark.parametrize("bad, status, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 2147483648}, 200, None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [49152]},
     400, "stop_token_ids"),
])
def test_a_bad_request_beside_eight_streams(server, bad, status, param):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.create_task(stream_chat(c, event, 40)) for event in started]
            await asyncio.gather(*(event.wait() for event in started))
            response = await c.post("/v1/chat/completions", json=bad)
            return response, await asyncio.gather(*streams)

    response, streams = asyncio.run(scenario())
    assert response.status_code == status, response.text
    if param is not None:
        assert param in response.json()["error"]["message"]
    for events in streams:
        assert not any("error" in event for event in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    stats = server.async_engine.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": None}],
    [{"role": "user"}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "4"}],
])
def test_messages_without_content_are_served(server, messages):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                          timeout=120)
    assert response.status_code == 200, response.text


def test_a_role_that_is_not_a_string_is_a_400(server):
    # any string is a role (the chat template decides); anything else is not
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": [{"role": 7, "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert response.status_code == 400
    assert "role must be a string" in response.json()["error"]["message"]
