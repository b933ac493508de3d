"""Phase 9: a server whose engine fails to load exits non-zero with the reason, as vLLM's does (a supervisor such as
systemd or Kubernetes restarts or alerts on the exit); in-process, BackgroundServer raises the cause at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("command", [[sys.executable, "-m", "tinyvllm.api.server"],
                                     [sys.executable, "-m", "tinyvllm.cli", "serve"]], ids=["api.server", "serve"])
def test_a_context_longer_than_the_model_exits_with_the_reason(command, tiny_model_dir):
    start = time.monotonic()
    done = subprocess.run([*command, "--model", str(tiny_model_dir), "--max-model-len", "18192", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "error: the engine failed to load" in done.stderr and "max_model_len" in done.stderr, done.stderr[-2000:]
    assert "18192" in done.stderr.splitlines()[-1]
    assert time.monotonic() - start < 120


def test_a_missing_model_exits_with_the_reason(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tinyvllm.api.server", "--model", str(tmp_path / "nothing.gguf"),
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "nothing.gguf" in done.stderr.splitlines()[-1], done.stderr[-2000:]


def test_background_server_raises_the_load_error_at_once():
    def factory():
        raise ValueError("max_model_len must be in [2, 8192], got 18192")

    app = build_app(AsyncLLMEngine(factory))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to load: max_model_len must be in"):
        BackgroundServer(app, timeout=600).start()
    assert time.monotonic() - start < 30


# ---- deployment flags: --enable-request-id-headers, --root-path, --uds ----

def test_request_id_headers_are_made_when_enabled():
    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    with serve(lambda: FakeLLMEngine(), enable_request_id_headers=True) as server:
        made = httpx.get(f"{server.url}/v1/models").headers["x-request-id"]
        assert len(made) == 32 and int(made, 16) >= 0  # a fresh uuid4, hex
        assert httpx.get(f"{server.url}/v1/models").headers["x-request-id"] != made
        sent = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "trace-7"})
        assert sent.headers["x-request-id"] == "trace-7"
    with serve(lambda: FakeLLMEngine()) as server:  # off: only the client's id is echoed
        assert "x-request-id" not in httpx.get(f"{server.url}/v1/models").headers


def test_root_path_serves_behind_a_proxy_prefix():
    from fake_engine import FakeLLMEngine

    app = build_app(AsyncLLMEngine(lambda: FakeLLMEngine()))
    with BackgroundServer(app, root_path="/llm") as server:
        # the proxy strips the prefix; the server writes it back into the URLs it gives (the OpenAPI servers)
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "fake-smollm2"
        # a proxy that keeps the prefix: the same routes under it, as vLLM serves them
        assert httpx.get(f"{server.url}/llm/v1/models").json()["data"][0]["id"] == "fake-smollm2"
        assert httpx.get(f"{server.url}/llm/health").status_code == 200
        assert httpx.get(f"{server.url}/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_uds_serves_on_a_unix_socket(tiny_model_dir, tmp_path):
    socket = tmp_path / "tinyvllm.sock"
    process = subprocess.Popen([sys.executable, "-m", "tinyvllm.api.server", "--model", str(tiny_model_dir),
                                "--uds", str(socket), "--max-model-len", "128"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://localhost") as http:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, process.stderr.read()[-2000:]
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no answer on the socket within 120 s"
                time.sleep(0.2)
            answer = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        # clients name the socket as the host (vLLM's tests: http://vllm.sock/...): no host check on a socket
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://tinyvllm.sock") as http:
            assert http.get("/health").status_code == 200
    finally:
        process.terminate()
        process.wait(30)


def test_tokenizer_info_only_when_enabled():
    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    with serve(lambda: FakeLLMEngine(), enable_tokenizer_info_endpoint=True) as server:
        info = httpx.get(f"{server.url}/tokenizer_info").json()
        tok = FakeLLMEngine().tokenizer
        assert info["tokenizer_class"] == type(tok).__name__ and info["vocab_size"] == tok.vocab_size
        assert info["model_max_length"] == 256 and info["chat_template"] == tok.chat_template
        assert info["eos_token"] == tok.token_string(tok.eos_token_id) == "<|im_end|>"
        assert info["added_tokens_decoder"][str(tok.eos_token_id)] == {"content": "<|im_end|>", "special": True}
    with serve(lambda: FakeLLMEngine()) as server:  # off by default: it shows the chat template
        assert httpx.get(f"{server.url}/tokenizer_info").status_code == 404


def test_server_load_counts_the_requests_in_flight():
    import threading

    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    fake = FakeLLMEngine()
    with serve(lambda: fake, enable_server_load_tracking=True) as server:
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
        fake.gate.clear()  # the engine holds the request inside its step
        body = {"prompt": "Hi", "max_tokens": 2}
        answer = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",), kwargs={"json": body})
        answer.start()
        assert fake.at_gate.wait(10)
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 1}
        fake.gate.set()
        answer.join(10)
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    with serve(lambda: FakeLLMEngine()) as server:  # not tracked: always 0, as vLLM answers
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}


def test_invocations_dispatches_by_the_body_as_sagemaker_calls_it():
    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    with serve(lambda: FakeLLMEngine()) as server:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        completion = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        for body, path, kind in [(chat, "/v1/chat/completions", "chat.completion"),
                                 (completion, "/v1/completions", "text_completion")]:
            via = httpx.post(f"{server.url}/invocations", json=body).json()
            direct = httpx.post(f"{server.url}{path}", json=body).json()
            assert via["object"] == kind and via["choices"] == direct["choices"] and via["usage"] == direct["usage"]
        refused = httpx.post(f"{server.url}/invocations", json={"prompt": "Hello", "max_tokens": "three"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
        unknown = httpx.post(f"{server.url}/invocations", json={"question": "?"})
        assert unknown.status_code == 400 and "messages" in unknown.json()["error"]["message"]


def test_orca_load_report_when_asked():
    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    with serve(lambda: FakeLLMEngine()) as server:
        body = {"prompt": "Hello", "max_tokens": 2}
        text = httpx.post(f"{server.url}/v1/completions", json=body, headers={"endpoint-load-metrics-format": "text"})
        report = text.headers["endpoint-load-metrics"]
        assert report.startswith("TEXT named_metrics.kv_cache_usage_perc=")
        assert "named_metrics.num_requests_waiting=" in report
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"endpoint-load-metrics-format": "JSON"},
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        kind, report = chat.headers["endpoint-load-metrics"].split(" ", 1)
        named = json.loads(report)["named_metrics"]
        assert kind == "JSON" and 0.0 <= named["kv_cache_usage_perc"] <= 1.0 and named["num_requests_waiting"] == 0.0
        assert "endpoint-load-metrics" not in httpx.post(f"{server.url}/v1/completions", json=body).headers


def test_chat_batch_answers_each_conversation_as_its_own_chat_request():
    from api_helpers import serve
    from fake_engine import FakeLLMEngine

    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Tell me a longer story"}]]
    with serve(lambda: FakeLLMEngine()) as server:
        batch = httpx.post(f"{server.url}/v1/chat/completions/batch",
                           json={"messages": conversations, "max_tokens": 4, "temperature": 0})
        assert batch.status_code == 200, batch.text
        batch = batch.json()
        singles = [httpx.post(f"{server.url}/v1/chat/completions", json={
            "messages": c, "max_tokens": 4, "temperature": 0}).json() for c in conversations]
        assert [c["index"] for c in batch["choices"]] == [0, 1]
        assert [c["message"] for c in batch["choices"]] == [s["choices"][0]["message"] for s in singles]
        assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
        for body, param in [({"messages": conversations, "stream": True}, "stream"),
                            ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
                            ({"messages": conversations, "max_tokens": "four"}, "max_tokens")]:
            refused = httpx.post(f"{server.url}/v1/chat/completions/batch", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
