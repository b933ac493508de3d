"""Phase 9: the server's limits, strict types, API key and Host checks, each tested with the exact request
that showed the defect (found by using the server as a new user and as a fuzzer would).

    n that can never be admitted      400 naming --max-waiting (was a 429 the client retried forever)
    n, stop strings, body size        400 naming --max-n / --max-stop-sequences / --max-stop-length,
                                      413 naming --max-request-body-bytes (was: no bound at all)
    lax types and ranges              400 with `param` naming the field (was: "2" taken for 2, 1e300 served)
    --api-key                         every path but /health, checked before the body is parsed
    Host                              a DNS name not in --allowed-hosts is a 421 (DNS rebinding)
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from api_helpers import client
from fake_engine import FakeLLMEngine, run_offline

from tinyvllm.api.cli_args import build_parser
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.api.serving_engine import ServerLimits
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm.sampling_params import SamplingParams

MODEL = "fake-smollm2"
CHAT = [{"role": "user", "content": "hi"}]


@contextmanager
def serve(fake: FakeLLMEngine | None = None, *, max_waiting: int | None = None, **app_options):
    """A live server around a fake engine, with `build_app`'s options (limits, api_key, allowed_hosts)."""
    fake = fake or FakeLLMEngine()
    engine = AsyncLLMEngine(lambda: fake, max_waiting=max_waiting)
    with BackgroundServer(build_app(engine, **app_options), timeout=120) as server:
        server.fake = fake
        yield server


@pytest.fixture(scope="module")
def server():
    """The default limits, and a waiting queue of 8: the server of a new user's first try."""
    with serve(max_waiting=8) as server:
        yield server


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# ---- 4: n -------------------------------------------------------------------------------------------


def test_n_over_max_waiting_is_400_not_a_429_forever(server):
    # before: 429 + Retry-After, which the openai client retried and then raised as RateLimitError
    retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=2, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        retrying.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=9)
    assert e.value.body["param"] == "n" and "--max-waiting" in e.value.body["message"]
    assert len(client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=8).choices) == 8


def test_n_has_an_upper_bound(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=ServerLimits().max_n + 1)
    assert e.value.body["param"] == "n" and "--max-n" in e.value.body["message"]
    with serve(limits=ServerLimits(max_n=2)) as small:
        assert_error(post(small, "/v1/chat/completions", {"messages": CHAT, "n": 3}), 400, "n", "at most 2", "--max-n")
        assert len(client(small).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=2).choices) == 2


# ---- 5: the right param and message ---------------------------------------------------------------


def test_top_logprobs_21_names_top_logprobs(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "20" in e.value.body["message"]


def test_largest_seed_with_n_2_is_served_and_reproducible(server):
    # before: 400 "seed must be ..., got 18446744073709551616": the second choice's seed + 1 overflowed
    request = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1, seed=2**64 - 1, n=2)
    first = client(server).completions.create(**request)
    again = client(server).completions.create(**request)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    for choice, child_seed in zip(first.choices, (2**64 - 1, 0)):  # the second child's seed wraps to 0
        alone = run_offline(FakeLLMEngine(), "Hello", SamplingParams(max_tokens=8, temperature=1, seed=child_seed))
        assert choice.text == alone.outputs[0].text


def test_logit_bias_key_that_is_not_an_integer_string(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=MODEL, prompt="Hi", logit_bias={"²": 1})
    message = e.value.body["message"]
    assert e.value.body["param"] == "logit_bias" and "integer strings" in message and "invalid literal" not in message
    with pytest.raises(openai.BadRequestError) as e:  # every bad key named at once, as vLLM does
        client(server).completions.create(model=MODEL, prompt="Hi", logit_bias={"bad1": 1, "7": 2, "bad2": 3})
    assert "'bad1', 'bad2'" in e.value.body["message"] and "'7'" not in e.value.body["message"]


# ---- 6: limits the operator sets ------------------------------------------------------------------


def test_8mb_token_id_prompt_is_413_before_it_is_parsed(server):
    body = json.dumps({"prompt": [1] * (8 * 2**20 // 3), "max_tokens": 1}).encode()  # "1, " per id: 8 MiB
    response = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    error = assert_error(response, 413, None, str(ServerLimits().max_request_body_bytes), "--max-request-body-bytes")
    assert error["code"] == 413


def test_body_without_content_length_is_counted_while_read(server):
    stop = json.dumps({"prompt": "Hi", "stop": ["x" * 100] * 126_000}).encode()  # the 12.6 MB stop list

    def chunks():  # no Content-Length: sent chunked, so only reading tells the size
        for start in range(0, len(stop), 2**16):
            yield stop[start:start + 2**16]

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                          headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, None, "--max-request-body-bytes")


def test_stop_strings_are_bounded(server):
    limits = ServerLimits()
    many = [f"<{i}>" for i in range(limits.max_stop_sequences + 1)]
    assert_error(post(server, "/v1/completions", {"prompt": "Hi", "stop": many}), 400, "stop", "--max-stop-sequences")
    long = "x" * (limits.max_stop_length + 1)
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "stop": long}), 400, "stop",
                 "--max-stop-length")
    ok = {"prompt": "Hi", "max_tokens": 2, "stop": ["y" * limits.max_stop_length] * limits.max_stop_sequences}
    assert post(server, "/v1/completions", ok).status_code == 200


def test_custom_limits_are_obeyed():
    limits = ServerLimits(max_request_body_bytes=1000, max_stop_sequences=2, max_stop_length=3)
    with serve(limits=limits) as small:
        assert_error(post(small, "/v1/completions", {"prompt": "x" * 1000}), 413, None, "1000 bytes")
        assert_error(post(small, "/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}), 400, "stop",
                     "at most 2")
        assert_error(post(small, "/v1/completions", {"prompt": "Hi", "stop": "abcd"}), 400, "stop", "at most 3")
        ok = {"prompt": "Hi", "max_tokens": 2, "stop": ["abc", "d"]}
        assert post(small, "/v1/completions", ok).status_code == 200


def test_cli_flags_and_their_defaults():
    args = build_parser().parse_args([])
    defaults = ServerLimits()
    assert (args.max_request_body_bytes, args.max_n, args.max_stop_sequences, args.max_stop_length) == (
        defaults.max_request_body_bytes, defaults.max_n, defaults.max_stop_sequences, defaults.max_stop_length)
    assert (defaults.max_request_body_bytes, defaults.max_n) == (4 * 2**20, 16) and args.allowed_hosts == []
    with pytest.raises(ValueError, match="max_n"):
        ServerLimits(max_n=0)


def test_prompt_over_the_context_is_refused_before_tokenizing(server, monkeypatch):
    tokenizer = server.fake.tokenizer
    calls = []
    for name in ("encode", "decode"):
        real = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    limit = server.fake.max_model_len
    text = post(server, "/v1/completions", {"prompt": "Hi " * 100 * limit})
    assert_error(text, 400, "prompt", "at least", f"{limit} tokens")
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi " * 100 * limit}]})
    assert_error(chat, 400, "messages", "at least")
    ids = post(server, "/v1/completions", {"prompt": [1] * (limit + 1)})
    assert_error(ids, 400, "prompt", f"{limit + 1} tokens")
    assert ids.json()["error"]["code"] == 400
    assert calls == []  # none of the three was tokenized or decoded


# ---- 7 (and 3): strict types, OpenAI's ranges -------------------------------------------------------


LAX = [  # (path, extra fields, the param named)
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"temperature": 1e300}, "temperature"),
    ("/v1/completions", {"temperature": 2.5}, "temperature"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"top_p": "0.5"}, "top_p"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"echo": 1}, "echo"),
    ("/v1/completions", {"seed": "7"}, "seed"),
    ("/v1/completions", {"stop": ["a", 1]}, "stop"),
    ("/v1/completions", {"logit_bias": {"5": "high"}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {"prompt": ["1", 2]}, "prompt"),
    ("/v1/chat/completions", {"logprobs": "maybe"}, "logprobs"),  # "true" is true, as vLLM's lax bool reads it
    ("/v1/chat/completions", {"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/chat/completions", {"response_format": {"type": "bogus"}}, "response_format"),
]


@pytest.mark.parametrize("path, extra, param", LAX, ids=[f"{p}-{json.dumps(e)}" for p, e, _ in LAX])
def test_lax_types_and_out_of_range_values_are_400(server, path, extra, param):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": CHAT}
    assert_error(post(server, path, {**body, "max_tokens": 2, **extra}), 400, param)


def test_response_format_names_the_valid_types(server):
    error = assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "bogus"}}),
                         400, "response_format")
    assert all(kind in error["message"] for kind in ("text", "json_object", "json_schema"))
    ok = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_integers_are_numbers_and_a_role_not_a_string_stays_400(server):
    # OpenAI takes 1 for 1.0: the openai client sends temperature=1 as it is
    response = client(server).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=1,
                                                      top_p=1, presence_penalty=0)
    assert response.choices[0].finish_reason == "length"
    wizard = post(server, "/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]})
    assert_error(wizard, 400, "messages", "role must be a string")


# ---- 8: the API key and the Host header -------------------------------------------------------------


def test_api_key_is_checked_first_and_everywhere_but_health():
    with serve(api_key="sesame") as server:
        key = {"Authorization": "Bearer sesame"}
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            response = httpx.get(f"{server.url}{path}")
            assert_error(response, 401, None, "Bearer")
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert httpx.get(f"{server.url}{path}", headers=key).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
        # before: malformed JSON got its 400 before the key was looked at
        bad_json = {"content": b"{not json", "headers": {"content-type": "application/json"}}
        assert httpx.post(f"{server.url}/v1/completions", **bad_json).status_code == 401
        bad_json["headers"].update(key)
        assert_error(httpx.post(f"{server.url}/v1/completions", **bad_json), 400, None, "not valid JSON")
        # a body over the limit without the key: 401 (the key comes before the body is read)
        assert httpx.post(f"{server.url}/v1/completions", content=b"x" * (5 * 2**20)).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").completions.create(model=MODEL, prompt="Hi")


def test_a_host_that_is_not_allowed_is_421(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "localhost.attacker.example"):
        response = httpx.get(f"{server.url}/v1/models", headers={"Host": host})
        error = assert_error(response, 421, None, "attacker.example", "--allowed-hosts")
        assert error["code"] == 421 and error["type"] == "Misdirected Request"
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}", "10.1.2.3", "localhost."):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host}).status_code == 200, host
    with serve(allowed_hosts=["api.example:8000"]) as named:
        assert httpx.get(f"{named.url}/v1/models", headers={"Host": "api.example"}).status_code == 200
        assert httpx.get(f"{named.url}/v1/models", headers={"Host": "other.example"}).status_code == 421
    with serve(allowed_hosts=["*"]) as anything:
        assert httpx.get(f"{anything.url}/v1/models", headers={"Host": "other.example"}).status_code == 200
