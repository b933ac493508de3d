"""The server's parts on their own, without a server around them (the routes end to end are in test_api_server.py
and its neighbours): the request models and their ranges, errors in OpenAI's shape, the deprecated `functions`,
the documented answers of /openapi.json, `best_of`, the Responses API's streamed items, /tokenize, the audit log,
and the timeout on a request's headers."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from pydantic import ValidationError

from tinyvllm.api.audit import AuditLog, RequestRecord
from tinyvllm.api.errors import OpenAIError, bad_request, lone_surrogate_error, to_openai_error
from tinyvllm.api.legacy_functions import as_function_call, as_tools, uses_functions
from tinyvllm.api.openapi import RATE_LIMIT_HEADERS, responses
from tinyvllm.api.protocol import ChatCompletionRequest, CompletionRequest, DeltaFunctionCall, DeltaToolCall, ModelList
from tinyvllm.api.protocol_responses import ResponsesRequest
from tinyvllm.api.read_timeouts import read_timeout_protocol
from tinyvllm.api.serving_completions import best_of_choices
from tinyvllm.api.serving_embeddings import EmbeddingRequest
from tinyvllm.api.serving_responses import ItemStream, outcome, renamed
from tinyvllm.api.serving_tokenize import DetokenizeRequest, OpenAIServingTokenization, TokenizeCompletionRequest
from tinyvllm.engine.async_llm_engine import EngineOverloadedError
from tinyvllm.model.tokenizer import load_tokenizer
from tinyvllm.model.weights import default_model_path
from tinyvllm.outputs import CompletionOutput, RequestOutput


def test_the_request_models_keep_openais_ranges_and_types():
    assert CompletionRequest(prompt=[[1, 2], [3]]).max_tokens == 16  # a batch of token-id prompts
    for bad in ({"prompt": "hi", "temperature": 2.5}, {"prompt": "hi", "n": 0}, {"prompt": "hi", "top_p": 0.0},
                {"prompt": "hi", "seed": "7"}, {"prompt": 5}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    with pytest.raises(ValidationError):
        ResponsesRequest(input=[])  # at least one item
    with pytest.raises(ValidationError):
        ResponsesRequest(input="hi", temperature=3.0)
    delta = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}'))
    assert delta.model_dump() == {"index": 0, "function": {"arguments": '{"a": 1}'}}  # no nulls to overwrite
    assert ModelList(data=[]).model_dump()["object"] == "list"


def test_an_embedding_request_takes_text_or_ids_but_not_a_mix():
    for ok in ("one", ["one", "two"], [1, 2], [[1, 2], [3]]):
        EmbeddingRequest(input=ok)
    for bad in ([], ["one", 2], [[1, "2"]], 3):
        with pytest.raises(ValidationError):
            EmbeddingRequest(input=bad)


def test_errors_have_openais_shape_and_status():
    assert bad_request("n is too large", "n").body() == {"error": {
        "message": "n is too large", "type": "BadRequestError", "param": "n", "code": 400}}  # vLLM's body
    overloaded = to_openai_error(EngineOverloadedError("the queue is full", retry_after=3))
    assert (overloaded.status, overloaded.type, overloaded.headers["Retry-After"]) == (429, "Too Many Requests", "3")
    too_long = to_openai_error(ValueError("this model's maximum context length (max_model_len) is 8 tokens"))
    assert (too_long.status, too_long.param) == (400, "prompt")
    assert to_openai_error(RuntimeError("a bug")).body()["error"]["type"] == "InternalServerError"
    lone = lone_surrogate_error(b'{"messages": [{"content": "a \\ud800 b"}]}')
    assert lone is not None and lone.status == 400 and lone.param == "messages"
    assert "messages.0.content" in lone.message
    assert lone_surrogate_error(b'{"prompt": "\\ud83d\\ude00"}') is None  # a pair is a character


def test_the_deprecated_functions_are_served_as_tools():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}],
                                    functions=[{"name": "weather", "parameters": {"type": "object"}}],
                                    function_call={"name": "weather"})
    assert uses_functions(request)
    tools = as_tools(request)
    assert tools.tools[0].function.name == "weather" and tools.functions is None
    assert tools.tool_choice.function.name == "weather" and tools.parallel_tool_calls is False
    choice = {"finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": "c1", "function": {"name": "weather", "arguments": "{}"}}]}}
    as_function_call(choice, choice["message"])
    assert choice == {"finish_reason": "function_call",
                      "message": {"function_call": {"name": "weather", "arguments": "{}"}}}
    with pytest.raises(OpenAIError, match="not both"):
        as_tools(request.model_copy(update={"tools": tools.tools}))


def test_a_routes_documented_answers():
    documented = responses(ModelList, 400, 429, stream=True)
    assert set(documented) == {200, 400, 429}
    assert "text/event-stream" in documented[200]["content"]
    assert documented[429]["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    assert documented[200]["headers"] is RATE_LIMIT_HEADERS


def completion(index: int, logprobs: list[float]) -> CompletionOutput:
    return CompletionOutput(index, f"c{index}", [1] * len(logprobs), "stop", logprobs=[(lp, []) for lp in logprobs])


def test_best_of_keeps_each_prompts_n_most_likely_samples():
    samples = [completion(0, [-1.0, -1.0]), completion(1, [-0.1]), completion(2, [-3.0]),  # prompt 0
               completion(3, [-2.0]), completion(4, [-0.5]), completion(5, [-0.2])]  # prompt 1
    chosen = best_of_choices(RequestOutput("r", None, [1], samples, finished=True), best_of=3, n=2).outputs
    assert [(c.text, c.index) for c in chosen] == [("c1", 0), ("c0", 1), ("c5", 2), ("c4", 3)]


def test_a_streamed_chat_message_becomes_output_items():
    stream = ItemStream()
    events = stream.feed({"delta": {"reasoning": "think"}})
    events += stream.feed({"delta": {"content": "Hel"}})
    events += stream.feed({"delta": {"content": "lo"}, "finish_reason": "stop"})
    events += stream.close()
    names = [name for name, _ in events]
    assert names == ["response.output_item.added", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.output_item.done",  # reasoning closes for the text
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done"]
    assert stream.output[1].content[0].text == "Hello" and stream.finish_reason == "stop"
    assert outcome("length")["status"] == "incomplete" and outcome("stop") == {"status": "completed"}
    error = renamed(bad_request("max_completion_tokens must be at least 1", "max_completion_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens must be at least 1")


def test_tokenize_and_detokenize():
    tokenizer = load_tokenizer(default_model_path())
    chat = SimpleNamespace(tokenizer=tokenizer, engine=SimpleNamespace(max_model_len=2048),
                           check_model=lambda model: None, check_prompt_chars=lambda text, field: None,
                           token_text=lambda t: tokenizer.decode([t]))
    serving = OpenAIServingTokenization(chat)
    answer = serving.tokenize(TokenizeCompletionRequest(prompt="Hello world", return_token_strs=True))
    assert answer.tokens == tokenizer.encode("Hello world") and answer.count == len(answer.tokens)
    assert answer.token_strs == ["Hello", "Ġworld"] and answer.max_model_len == 2048  # the tokenizer's spelling
    assert serving.detokenize(DetokenizeRequest(tokens=answer.tokens)).prompt == "Hello world"
    with pytest.raises(OpenAIError, match="token ids"):
        serving.detokenize(DetokenizeRequest(tokens=[tokenizer.vocab_size]))


def test_the_audit_log_writes_one_line_per_request(tmp_path):
    record = RequestRecord("POST", "/v1/completions", arrival=0.0, key_id="team-a", status=200, prompt_tokens=5,
                           completion_tokens=7, latency_s=0.25, request_id="cmpl-1")
    log = AuditLog(tmp_path / "audit.log")
    log.write(record)
    log.write(RequestRecord("GET", "/v1/models", arrival=1.5))
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    assert lines[0] == {"time": "1970-01-01T00:00:00.000Z", "key_id": "team-a", "method": "POST",
                        "route": "/v1/completions", "status": 200, "prompt_tokens": 5, "completion_tokens": 7,
                        "latency_s": 0.25, "disconnected": False, "request_id": "cmpl-1"}
    assert lines[1]["route"] == "/v1/models" and lines[1]["status"] is None


async def hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_request_whose_headers_stall_is_answered_408():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, log_level="error",
                                           http=read_timeout_protocol(0.3)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as whole:  # headers in time: served
            whole.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert whole.recv(1024).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
            start = time.monotonic()
            answer = slow.recv(1024)
            assert answer.startswith(b"HTTP/1.1 408") and 0.2 < time.monotonic() - start < 4
    finally:
        server.should_exit = True
        thread.join(10)
