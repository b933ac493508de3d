"""Phase 9: every error has OpenAI's shape and status, a client that leaves frees its blocks, and the
server keeps serving after each. Runs against `FakeLLMEngine`, whose hooks hold or break a step."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from api_helpers import client, metrics, serve, sse_events, stream_json, wait_for
from fake_engine import FakeLLMEngine

MODEL = "fake-smollm2"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine(max_model_len=64)) as server:
        yield server


# vLLM's names for the statuses its serving code answers; the others are the HTTP reason phrase
TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 429: "Too Many Requests",
         500: "InternalServerError", 503: "Service Unavailable"}


def assert_error(response: httpx.Response, status: int, param: str | None = None):
    """vLLM's error body: `code` is the status, `type` its name."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == status and error["type"] == TYPES[status], error
    return error


def still_serving(server) -> None:
    response = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason == "length"


BAD_REQUESTS = [  # (path, body, param, message)
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature", ""),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", ""),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, "top_p", ""),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n", ""),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, "logprobs", ""),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", ""),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"not-a-token": 1}}, "logit_bias", ""),
    ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop", ""),
    ("/v1/completions", {"temperature": 0}, "prompt", "Either prompt or prompt_embeds must be provided"),
    ("/v1/completions", {"prompt": None, "prompt_embeds": []}, "prompt", "Either prompt or prompt_embeds"),
    ("/v1/completions", {"prompt": ""}, "prompt", "The decoder prompt cannot be empty"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt", "Token id 99999999 is out of vocabulary"),
    # a batch with an empty prompt
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt", "The decoder prompt cannot be empty"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", ""),
    ("/v1/completions", {"prompt": "Hi " * 80}, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100}, "max_tokens", "maximum context length"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 100}, "max_completion_tokens",
     "maximum context length"),
    ("/v1/chat/completions", {"messages": []}, "messages", ""),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", ""),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", ""),
]


@pytest.mark.parametrize("path, body, param, message", BAD_REQUESTS,
                         ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_are_400(server, path, body, param, message):
    error = assert_error(httpx.post(f"{server.url}{path}", json=body), 400, param)
    assert message in error["message"]
    if param != "stream_options":  # the same request streamed is refused before its 200
        assert_error(httpx.post(f"{server.url}{path}", json={**body, "stream": True}), 400, param)


def test_invalid_json_and_unknown_route(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert_error(response, 400)
    unknown = httpx.get(f"{server.url}/v1/nowhere")  # Starlette's 404: vLLM's type is the reason phrase
    assert unknown.status_code == 404 and unknown.json()["error"] == {"message": "Not Found", "type": "Not Found",
                                                                     "param": None, "code": 404}
    still_serving(server)


def test_openai_client_raises_the_matching_exceptions(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        c.completions.create(model=MODEL, prompt="Hi " * 80)
    assert e.value.code == "400" and e.value.type == "BadRequestError"  # the client reads the code as text
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    assert e.value.code == "404" and e.value.type == "NotFoundError" and e.value.param == "model"
    still_serving(server)


def test_api_key():
    with serve(lambda: FakeLLMEngine(), api_key="sesame", served_model_names=["smol", "smol-alias"]) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"}, headers=headers)
            assert_error(response, 401)
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()
        assert [m.id for m in client(server, api_key="sesame").models.list().data] == ["smol", "smol-alias"]
        ok = client(server, api_key="sesame").completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
        assert ok.model == "smol-alias"
        assert httpx.get(f"{server.url}/health").status_code == 200  # a load balancer's probe needs no key
        key = {"Authorization": "Bearer sesame"}
        for path in ("/metrics", "/docs", "/openapi.json"):  # everything else does
            assert_error(httpx.get(f"{server.url}{path}"), 401)
            assert httpx.get(f"{server.url}{path}", headers=key).status_code == 200


def test_503_until_the_model_is_loaded():
    loaded = threading.Event()

    def slow_factory():
        assert loaded.wait(60)
        return FakeLLMEngine()

    with serve(slow_factory, wait_until_ready=False) as server:
        assert_error(httpx.get(f"{server.url}/health"), 503)
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"})
        assert_error(response, 503)
        assert int(response.headers["Retry-After"]) > 0
        assert_error(httpx.get(f"{server.url}/v1/models"), 503)
        loaded.set()
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, what="the model to load")
        still_serving(server)


def test_full_waiting_queue_is_429_with_retry_after():
    fake = FakeLLMEngine(max_num_seqs=1)
    with serve(lambda: fake, max_waiting=2) as server:
        engine = server.async_engine
        fake.gate.clear()  # the engine thread will hold inside its next step
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            first = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            wait_for(lambda: engine.stats["num_waiting"] == 1, what="the engine to take the first request")
            second = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            assert (first.status_code, second.status_code, engine.num_waiting()) == (200, 200, 2)
            for stream in (False, True):
                response = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream})
                assert_error(response, 429)
                assert int(response.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
            seen = metrics(server)
            assert seen["tinyvllm:num_requests_waiting"] == 2
            by_reason = 'vllm:num_requests_waiting_by_reason{model_name="fake-smollm2",engine="0",reason="capacity"}'
            assert seen[by_reason] == 2
            assert seen['tinyvllm:admission_rejections_total{reason="max_num_queued_reqs"}'] == 3  # the three 429s
            fake.gate.set()
            for response in (first, second):
                events = sse_events(response)
                assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
                response.close()
        still_serving(server)


def test_engine_failure_is_500_and_the_server_keeps_serving():
    fake = FakeLLMEngine()
    with serve(lambda: fake) as server:
        fake.fail_next_step = True
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert_error(response, 500)
        still_serving(server)

        fake.fail_next_step = True  # now mid-stream: the 200 is out, so the error comes as an event
        events, raw = stream_json(server, "/v1/chat/completions", CHAT)
        assert raw[-1] == "[DONE]" and events[-1]["error"]["code"] == 500
        still_serving(server)
        assert fake.num_free_blocks == fake.num_total_blocks


def test_disconnect_mid_stream_frees_the_blocks():
    fake = FakeLLMEngine(step_time=0.02, max_model_len=4096, num_blocks=512)
    with serve(lambda: fake) as server:
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):  # a few tokens in: the request holds blocks
                assert next(lines).startswith("data: ") and next(lines) == ""
            assert metrics(server)["tinyvllm:num_kv_blocks_used"] > 0
        # leaving the block closed the connection; the request had 40 s of tokens left
        # (that the abort comes within one step is tests/engine/test_async_llm_engine.py's business)
        wait_for(lambda: fake.aborted, timeout=10, what="the abort")
        wait_for(lambda: metrics(server)["tinyvllm:num_kv_blocks_used"] == 0, what="the metrics to show it")
        assert fake.num_free_blocks == fake.num_total_blocks and not fake.has_unfinished_requests()

        # the same for a non-streaming request whose client gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
        wait_for(lambda: len(fake.aborted) == 2, timeout=10, what="the second abort")
        wait_for(lambda: fake.num_free_blocks == fake.num_total_blocks, what="the blocks to come back")
        still_serving(server)


def test_event_loop_answers_while_the_engine_is_busy():
    fake = FakeLLMEngine()
    with serve(lambda: fake) as server:
        fake.gate.clear()  # a step that takes as long as the test likes: the device is busy
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "Hi", "stream": True}) as response:
            wait_for(lambda: server.async_engine.stats["num_waiting"] == 1, what="the step to start")
            start = time.monotonic()
            assert httpx.get(f"{server.url}/health").status_code == 200
            assert httpx.get(f"{server.url}/metrics").status_code == 200
            assert time.monotonic() - start < 2.0
            fake.gate.set()
            assert sse_events(response)[-1] == "[DONE]"


# ---- failures that used to come late (a 500, or a 200 then an error event): now 400s naming the field ----------

VOCAB = 49152
LATE_FAILURES = [  # (path, body as JSON text: a lone surrogate is valid JSON that json.dumps would not write, param)
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [VOCAB]}), "stop_token_ids"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "min_tokens": 1,
                                    "stop_token_ids": list(range(VOCAB))}), "stop_token_ids"),  # all masked
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "logit_bias": {"7" * 5000: 1.0}}), "logit_bias"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "top_p": 0}), "top_p"),  # vLLM: (0, 1]
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                                         "max_tokens": 2}), "messages"),
]


@pytest.mark.parametrize("path, body, param", LATE_FAILURES,
                         ids=["surrogate", "surrogate-chat", "oov-stop-id", "all-masked", "long-bias-key", "top-p-0",
                              "non-string-text-part"])
def test_late_failures_are_400s_before_any_200(server, path, body, param):
    for stream in (False, True):
        raw = body[:-1] + f', "stream": {"true" if stream else "false"}}}'
        response = httpx.post(f"{server.url}{path}", content=raw.encode(), timeout=60,
                              headers={"Content-Type": "application/json"})
        error = assert_error(response, 400, param)
        assert "Exceeds the limit" not in error["message"]  # Python's own words for a 5,000-digit int
    if param == "logit_bias":
        assert "(5000 characters)" in error["message"]
    still_serving(server)
