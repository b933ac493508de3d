"""Phase 9: the Responses API (`POST /v1/responses`) through the official client's `responses.create`.

The route is the chat route in other shapes (tinyvllm/api/serving_responses.py), so each answer is checked
against the chat answer `FakeLLMEngine` gives the equivalent messages, run offline; tool calls need an output we
choose (`FakeLLMEngine(reply=...)`). Structured outputs on a real model are in tests/api/test_api_embeddings.py.
"""

from __future__ import annotations

import json

import openai
import pytest
from api_helpers import client, serve
from fake_engine import FakeLLMEngine, run_offline

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


def offline_chat(messages: list[dict], **params) -> str:
    """What the chat route's engine answers these messages, run alone."""
    engine = FakeLLMEngine()
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return run_offline(engine, ids, SamplingParams(**params)).outputs[0].text


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
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input=[{"type": "web_search_call", "id": "x"}])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model=MODEL, input="Hi", max_output_tokens=10_000)
    assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client(server).responses.create(model="gpt-4o", input="Hi")


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
