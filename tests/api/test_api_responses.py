"""Phase 9: the Responses API (`POST /v1/responses`) through the official client's `responses.create`.

The route is the chat route in other shapes (tinyvllm/api/serving_responses.py), so each answer is checked
against the chat answer `FakeLLMEngine` gives the equivalent messages, run offline; tool calls need an output we
choose (`FakeLLMEngine(reply=...)`). Structured outputs on a real model are in tests/api/test_api_embeddings.py.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from api_helpers import client, metrics, serve, wait_for
from fake_engine import FakeLLMEngine, run_offline

from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine
from tinyvllm.sampling_params import SamplingParams

MODEL = "fake-smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city.",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def caller():
    with serve(lambda: FakeLLMEngine(reply=f"Let me look.\n{CALL}")) as server:
        yield server


def prompt_ids(messages: list[dict]) -> list[int]:
    """The prompt the chat route makes of these messages."""
    tokenizer = FakeLLMEngine().tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def offline_chat(messages: list[dict], **params) -> str:
    """What the chat route's engine answers these messages, run alone."""
    return run_offline(FakeLLMEngine(), prompt_ids(messages), SamplingParams(**params)).outputs[0].text


@contextmanager
def serve_store(engine: FakeLLMEngine, max_stored_responses: int):
    """A server around `engine` (which the test may hold at its gate) keeping that many responses."""
    with BackgroundServer(build_app(AsyncLLMEngine(lambda: engine), max_stored_responses=max_stored_responses)) \
            as server:
        yield server


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/responses/{path}", timeout=60)


def test_text_input_and_instructions(server):
    response = client(server).responses.create(model=MODEL, input="What is 2+2?", instructions="Be brief.",
                                               temperature=0, max_output_tokens=8)
    expected = offline_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
                            temperature=0, max_tokens=8)
    assert response.output_text == expected and response.id.startswith("resp_") and response.object == "response"
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    short = client(server).responses.create(model=MODEL, input="Count", temperature=0, max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_items_become_the_conversation(server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    response = client(server).responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=6)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    from tinyvllm.api.tool_parser import with_default_tool_prompt

    assert response.output_text == offline_chat(with_default_tool_prompt(messages, None), temperature=0,
                                                max_tokens=6)


def test_streamed_events(server):
    events = list(client(server).responses.create(model=MODEL, input="Hello", temperature=0, max_output_tokens=5,
                                                  stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == offline_chat([{"role": "user", "content": "Hello"}], temperature=0,
                                                     max_tokens=5)
    assert final.usage.output_tokens == 5 and len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    assert client(server).responses.retrieve(final.id).output_text == text  # a streamed response is stored too


def test_function_calls_are_output_items(caller):
    response = client(caller).responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                               temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call"] and response.output[0].content[0].text.strip() == "Let me look."
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    events = list(client(caller).responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                                  temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["message", "function_call"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(arguments) == json.loads(done.arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed" and events[-1].response.output[1].name == "get_weather"


def test_refusals_name_the_field(server):
    with pytest.raises(openai.NotFoundError) as e:  # vLLM's 404 for a response not kept
        client(server).responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id" and "'resp_1' not found" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # not a response's id at all
        client(server).responses.create(model=MODEL, input="Hi", previous_response_id="chatcmpl-1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input="Hi", include=["file_search_call.results"])
    assert e.value.body["param"] == "include" and "message.output_text.logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's check: nothing to poll without store
        client(server).responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert e.value.body["param"] == "background" and "store" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input=[{"type": "web_search_call", "id": "x"}])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input="Hi", max_output_tokens=10_000)
    assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).responses.create(model="gpt-4o", input="Hi")


def test_reasoning_effort_reaches_the_chat_template(server):
    from tinyvllm.api.protocol import ChatCompletionRequest
    from tinyvllm.api.serving_chat import template_kwargs

    def kwargs(**fields):
        return template_kwargs(ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields))

    assert kwargs() is None
    assert kwargs(reasoning_effort="none") == {"enable_thinking": False, "reasoning_effort": "none"}
    assert kwargs(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == {
        "enable_thinking": False, "reasoning_effort": "low"}  # the request's own variable wins, as in vLLM
    done = client(server).responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"}, max_output_tokens=4)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"  # served
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input="Hi", reasoning={"effort": "low", "summary": "auto"})
    assert e.value.body["param"] == "reasoning" and "summar" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"


def test_response_messages_are_the_raw_prompt_and_output(server):
    tokenizer = FakeLLMEngine().tokenizer
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "temperature": 0}
    done = httpx.post(f"{server.url}/v1/responses", json={**body, "enable_response_messages": True}).json()
    (prompt,), (output,) = done["input_messages"], done["output_messages"]
    assert prompt["type"] == output["type"] == "raw_message_tokens" and len(output["tokens"]) == 3
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt["message"] == chat and prompt["tokens"] == tokenizer.encode(chat, add_special_tokens=False)
    assert output["message"] == tokenizer.decode(output["tokens"]) == done["output"][0]["content"][0]["text"]
    plain = httpx.post(f"{server.url}/v1/responses", json=body).json()
    assert plain["input_messages"] is None and plain["output_messages"] is None  # only when asked
    refused = httpx.post(f"{server.url}/v1/responses", json={**body, "enable_response_messages": True, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "enable_response_messages"


def test_legacy_functions_and_function_call(caller):
    """OpenAI's deprecated `functions` / `function_call` (tinyvllm/api/legacy_functions.py): served as tools."""
    function = {key: value for key, value in WEATHER.items() if key != "type"}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    response = client(caller).chat.completions.create(model=MODEL, messages=ask, functions=[function], temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments) == {"city": "Paris"}
    chunks = list(client(caller).chat.completions.create(model=MODEL, messages=ask, functions=[function],
                                                         function_call="auto", temperature=0, stream=True))
    arguments = "".join(c.choices[0].delta.function_call.arguments or "" for c in chunks
                        if c.choices and c.choices[0].delta.function_call)
    names = [c.choices[0].delta.function_call.name for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert "get_weather" in names and json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "function_call"
    with pytest.raises(openai.BadRequestError) as e:
        client(caller).chat.completions.create(model=MODEL, messages=ask, functions=[function],
                                               tools=[{"type": "function", "function": function}])
    assert e.value.body["param"] == "functions"


def test_reasoning_is_an_output_item():
    from tinyvllm.api.launcher import BackgroundServer
    from tinyvllm.api.server import build_app
    from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(lambda: FakeLLMEngine(reply="<think>Two and two.</think>It is 4."))
    with BackgroundServer(build_app(engine, reasoning_parser="think")) as server:
        response = client(server).responses.create(model=MODEL, input="2+2?", temperature=0)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "Two and two." and response.output_text == "It is 4."
        events = list(client(server).responses.create(model=MODEL, input="2+2?", temperature=0, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Two and two." and events[-1].response.output_text == "It is 4."
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


def test_previous_response_id_continues_the_stored_conversation(server):
    """vLLM's continuation: the new instructions, then the stored response's messages and its output as an
    assistant message, then the new input. Two continuations of one response are independent branches."""
    first = client(server).responses.create(model=MODEL, input="What is 2+2?", instructions="Be brief.",
                                            temperature=0, max_output_tokens=6)
    assert first.store is True  # the default, as vLLM's and OpenAI's
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
               {"role": "assistant", "content": first.output_text}]
    branches = {}
    for question in ("And 3+3?", "And 10+10?"):
        answer = client(server).responses.create(model=MODEL, input=question, previous_response_id=first.id,
                                                 temperature=0, max_output_tokens=6)
        expected = [*history, {"role": "user", "content": question}]
        assert answer.previous_response_id == first.id
        assert answer.usage.input_tokens == len(prompt_ids(expected))  # exactly this history, not the other branch
        assert answer.output_text == offline_chat(expected, temperature=0, max_tokens=6)
        branches[question] = (answer, expected)
    answer, expected = branches["And 3+3?"]
    third = client(server).responses.create(model=MODEL, input="Thanks", previous_response_id=answer.id,
                                            temperature=0, max_output_tokens=4)
    whole = [*expected, {"role": "assistant", "content": answer.output_text}, {"role": "user", "content": "Thanks"}]
    assert third.usage.input_tokens == len(prompt_ids(whole))
    assert third.output_text == offline_chat(whole, temperature=0, max_tokens=4)
    # a stored response reads back as it was answered
    stored = get(server, first.id)
    assert stored.status_code == 200 and stored.json()["output"][0]["content"][0]["text"] == first.output_text


def test_the_store_is_bounded_and_store_false_keeps_nothing():
    with serve_store(FakeLLMEngine(), max_stored_responses=2) as server:
        ids = [client(server).responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=2).id
               for i in range(3)]
        unstored = client(server).responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
        assert unstored.store is False and get(server, unstored.id).status_code == 404
        assert [get(server, i).status_code for i in ids] == [404, 200, 200]  # the oldest was forgotten
        with pytest.raises(openai.NotFoundError) as e:
            client(server).responses.create(model=MODEL, input="Go on", previous_response_id=ids[0])
        assert f"Response with id '{ids[0]}' not found" in e.value.body["message"]
        assert e.value.body["type"] == "NotFoundError"
        assert get(server, "chatcmpl-1").status_code == 400
    with serve_store(FakeLLMEngine(), max_stored_responses=0) as server:  # vLLM's default: keep nothing
        kept = client(server).responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert kept.store is False and get(server, kept.id).status_code == 404
        with pytest.raises(openai.BadRequestError) as e:
            client(server).responses.create(model=MODEL, input="Hi", background=True)
        assert e.value.body["param"] == "background" and "--max-stored-responses" in e.value.body["message"]


def test_background_responses_are_polled_and_cancelled():
    engine = FakeLLMEngine(step_time=0.01)
    with serve_store(engine, max_stored_responses=8) as server:
        engine.gate.clear()  # the engine holds: the response stays unfinished
        queued = client(server).responses.create(model=MODEL, input="Tell me a story", background=True,
                                                 max_output_tokens=100)
        assert queued.status == "queued" and queued.background is True and queued.output == []
        wait_for(engine.at_gate.is_set, what="the engine to take the request")
        assert get(server, queued.id).json()["status"] in ("queued", "in_progress")
        cancelled = httpx.post(f"{server.url}/v1/responses/{queued.id}/cancel", timeout=60)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        engine.gate.set()
        wait_for(lambda: len(engine.aborted) == 1, what="the engine request to be aborted")
        wait_for(lambda: metrics(server)["tinyvllm:num_kv_blocks_used"] == 0, what="the KV blocks to be freed")
        assert get(server, queued.id).json()["status"] == "cancelled"
        again = httpx.post(f"{server.url}/v1/responses/{queued.id}/cancel", timeout=60)
        assert again.status_code == 400 and "'cancelled'" in again.json()["error"]["message"]
        # one left to finish: polled until done, the same answer as in the foreground
        done = client(server).responses.create(model=MODEL, input="Hello", background=True, temperature=0,
                                               max_output_tokens=5)
        wait_for(lambda: get(server, done.id).json()["status"] in ("completed", "incomplete"), what="the answer")
        final = client(server).responses.retrieve(done.id)
        assert final.output_text == offline_chat([{"role": "user", "content": "Hello"}], temperature=0, max_tokens=5)
        assert final.usage.output_tokens == 5 and len(engine.aborted) == 1
        assert httpx.post(f"{server.url}/v1/responses/resp_nothing/cancel", timeout=60).status_code == 404


def test_output_text_logprobs_when_included(server):
    asked = {"model": MODEL, "input": "Hello", "temperature": 0, "max_output_tokens": 4}
    response = client(server).responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                  temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    assert [(p.token, p.logprob) for p in logprobs] == [(p.token, p.logprob) for p in chat.choices[0].logprobs.content]
    assert len(logprobs) == 4 and all(len(p.top_logprobs) == 2 for p in logprobs)
    assert "".join(p.token for p in logprobs) == response.output_text
    assert not client(server).responses.create(**asked).output[0].content[0].logprobs  # not asked: none
    events = list(client(server).responses.create(**asked, include=["message.output_text.logprobs"],
                                                  top_logprobs=2, stream=True))
    streamed = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    assert [p.token for p in streamed] == [p.token for p in logprobs]
    assert [p.token for p in events[-1].response.output[0].content[0].logprobs] == [p.token for p in logprobs]


def test_a_full_store_forgets_its_oldest_finished_response_never_a_running_one():
    from tinyvllm.api.protocol_responses import ResponsesResponse
    from tinyvllm.api.response_store import ResponseStore

    store = ResponseStore(max_entries=2)

    def put(response_id: str, status: str) -> None:
        store.put(ResponsesResponse(id=response_id, created_at=0, status=status, model=MODEL), [])

    put("resp_running", "in_progress")  # a background response its client polls
    put("resp_a", "completed")
    put("resp_b", "completed")
    assert list(store.entries) == ["resp_running", "resp_b"]
    store.save(ResponsesResponse(id="resp_running", created_at=0, status="completed", model=MODEL), [])
    put("resp_c", "completed")
    assert list(store.entries) == ["resp_b", "resp_c"]  # finished now: the oldest again
