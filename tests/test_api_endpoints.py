"""Phase 9: the endpoints and fields of vLLM's server beyond the two generation routes, through the official
client where it has them (docs/phases/09-appendix-endpoints.md has the table).

The server runs around `FakeLLMEngine` (tests/fake_engine.py): the real tokenizer and chat template, tokens by
a fixed rule, so answers are checked against the tokenizer itself or the same engine run offline.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from api_helpers import client, serve
from fake_engine import FakeLLMEngine

MODEL = "fake-smollm2"


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer():
    return FakeLLMEngine().tokenizer


def test_models_retrieve(server):
    model = client(server).models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.max_model_len == 256
    with pytest.raises(openai.NotFoundError) as e:
        client(server).models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_version_and_ping(server):
    assert httpx.get(f"{server.url}/version").json()["version"]
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200


def test_tokenize_prompt_equals_the_tokenizer(server, tokenizer):
    body = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                    "token_strs": [tokenizer.token_bytes(t).decode() for t in ids]}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    refused = httpx.post(f"{server.url}/detokenize", json={"tokens": [tokenizer.vocab_size]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404


def test_tokenize_messages_is_the_chat_prompt(server, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    template = tokenizer.apply_chat_template
    opened = httpx.post(f"{server.url}/tokenize", json={"messages": messages[:1]}).json()
    assert opened["tokens"] == tokenizer.encode(template(messages[:1]), add_special_tokens=False)
    # continue_final_message: the assistant's last message left open, no end of turn after it
    cont = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                      "continue_final_message": True}).json()
    text = tokenizer.decode(cont["tokens"])
    assert text.endswith("<|im_start|>assistant\nThe answer is") and text == template(messages, False)[
        :len(text)]
    both = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_x_request_id_is_echoed_and_used(server):
    response = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "trace-42"},
                          json={"prompt": "Hello", "max_tokens": 2})
    assert response.headers["x-request-id"] == "trace-42" and response.json()["id"] == "cmpl-trace-42"
    error = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "trace-43"}, json={"prompt": ""})
    assert error.status_code == 400 and error.headers["x-request-id"] == "trace-43"
    raw = client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_headers={"X-Request-Id": "c1"})
    assert raw.headers["x-request-id"] == "c1" and raw.parse().id == "chatcmpl-c1"


def test_cors_only_for_the_allowed_origins():
    from tinyvllm.api.server import BackgroundServer, CorsConfig, build_app
    from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

    app = build_app(AsyncLLMEngine(lambda: FakeLLMEngine()), api_key="sk-cors",
                    cors=CorsConfig(("https://app.example",), ("POST",), ("Authorization", "Content-Type")))
    with BackgroundServer(app) as server:
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(f"{server.url}/v1/completions", headers=preflight)  # no key: browsers send none here
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        other = httpx.options(f"{server.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                            headers={"Origin": "https://app.example", "Authorization": "Bearer sk-cors"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
        no_key = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"},
                            headers={"Origin": "https://app.example"})
        assert no_key.status_code == 401  # CORS lets the browser read the answer, never past the key
    with serve(lambda: FakeLLMEngine()) as default:  # no --allowed-origins: no CORS headers at all
        response = httpx.options(f"{default.url}/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
