"""Tool calling on /v1/chat/completions, read by the official openai client (the reasoning split:
test_api_reasoning.py).

A forced call (tool_choice "required" or a named function) runs on a tiny model with random weights: it
has no idea what a tool is, so only the grammar makes its arguments parse, which is what is checked,
greedy and sampled, streamed (assembled by the client's own stream helper) and not. "auto" needs an output
we choose: `FakeLLMEngine(reply=...)` says a fixed text.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from enum import Enum
from types import SimpleNamespace

import httpx
import openai
import pytest
from api_helpers import client, serve, stream_json
from fake_engine import FakeLLMEngine, shared_tokenizer
from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Field

from conftest import TINY_CONFIG, write_tiny_model
from tinyvllm.api.serving_chat import OpenAIServingChat
from tinyvllm.api.tool_parser import HermesToolParser, Llama3JsonToolParser, ToolCallPolicy, tool_call_text

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                  "b": {"type": "boolean"}}}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
REPLY = f"<think>The user wants the weather.</think>I will check.\n{CALL}"


def check_arguments(name: str, arguments: str) -> None:
    """The arguments parse and validate against the function's parameters schema."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 12
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "add" and set(args) == {"a", "b"} and isinstance(args["b"], bool)
        assert isinstance(args["a"], int) and -99 <= args["a"] <= 99


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tinyvllm.engine.llm_engine import LLMEngine

    # a longer context than TINY_CONFIG's: the tools built from pydantic models take ~500 prompt tokens
    config = dataclasses.replace(TINY_CONFIG, max_position_embeddings=1536)
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-tools"), config, seed=3)
    with serve(lambda: LLMEngine(path, max_model_len=1536, kv_cache_memory="16MiB", max_num_seqs=4,
                                     max_num_batched_tokens=64), served_model_names=["model"]) as server:
        yield server


@pytest.fixture(scope="module")
def fake():
    with serve(lambda: FakeLLMEngine(reply=REPLY, max_model_len=1024, num_blocks=256, step_time=0.002),
                   reasoning_parser="qwen3") as server:  # vLLM's name for the <think> parser
        yield server


# ---- forced calls on the random model: always there, always parse ---------------------------------------

@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_always_parses_and_streams_the_same(tiny, tool_choice):
    c = client(tiny)
    names = {"get_weather", "add"} if tool_choice == "required" else {"add"}
    for temperature, seed in [(0, None), (1.0, 0), (1.0, 1), (1.0, 2)]:
        request = dict(model="model", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                       temperature=temperature, seed=seed, parallel_tool_calls=False)
        response = c.chat.completions.create(**request)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        check_arguments(call.function.name, call.function.arguments)
        with c.chat.completions.stream(**request) as stream:  # the client's own assembly of the deltas
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == \
            [(call.function.name, call.function.arguments)]


def test_tool_call_deltas_come_name_first_then_arguments(tiny):
    events, _ = stream_json(tiny, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 120,
                                                           "tool_choice": "required", "temperature": 0})
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"}  # no content: the reply is a call
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert pieces[0]["index"] == 0 and pieces[0]["type"] == "function" and pieces[0]["id"].startswith("call_")
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])
    check_arguments("get_weather", "".join(p["function"]["arguments"] for p in pieces))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- auto (and the reasoning beside a call), on a fixed reply --------------------------------------------------------

def test_auto_parses_the_call_and_splits_the_reasoning(fake):
    c = client(fake)
    response = c.chat.completions.create(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0)
    message, finish_reason = response.choices[0].message, response.choices[0].finish_reason
    assert message.reasoning == "The user wants the weather." and message.content == "I will check."
    assert "reasoning_content" not in message.model_dump()  # vLLM's current name only
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert finish_reason == "tool_calls"

    chunks = list(c.chat.completions.create(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0,
                                            stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert not any("reasoning_content" in d.model_dump() for d in deltas)
    assert "".join(d.content or "" for d in deltas) == message.content
    with c.chat.completions.stream(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.message.tool_calls[0].function.arguments == message.tool_calls[0].function.arguments
    assert streamed.finish_reason == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_call_stays_text(fake):
    c = client(fake)
    for options in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = c.chat.completions.create(model="fake-smollm2", messages=ASK, temperature=0, **options).choices[0]
        assert choice.message.content == f"I will check.\n{CALL}" and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


# ---- the prompt ----------------------------------------------------------------------------------------------

HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]


def serving_chat(tokenizer) -> OpenAIServingChat:
    engine = SimpleNamespace(get_tokenizer=lambda: tokenizer, max_model_len=2048)
    return OpenAIServingChat(engine)


def test_smollm2_gets_the_default_tool_prompt_and_history():
    text = serving_chat(shared_tokenizer()).render_text(HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in text
    assert f'<|im_start|>assistant\n{CALL}<|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in text


def test_a_template_with_tool_support_renders_the_tools_itself():
    tokenizer = copy.copy(shared_tokenizer())
    tokenizer.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                               "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
                               "{% endfor %}{% endfor %}")
    text = serving_chat(tokenizer).render_text(HISTORY, TOOLS)
    assert text == ("[get_weather][add]<user>What is the weather in Paris?<assistant>get_weather(Paris)"
                    "<tool>18 degrees, sunny")


# ---- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),  # auto
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": "get_weather"}]}, "messages"),
])
def test_bad_tools_are_400s_naming_the_field(fake, body, param):
    for stream in (False, True):
        response = httpx.post(f"{fake.url}/v1/chat/completions", json={"messages": ASK, **body, "stream": stream},
                              timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.json()


def test_the_openai_client_sees_a_bad_request(fake):
    with pytest.raises(openai.BadRequestError):
        client(fake).chat.completions.create(model="fake-smollm2", messages=ASK, tool_choice="required")


@pytest.mark.slow
def test_the_real_model_makes_forced_calls_that_parse():
    """SmolLM2 itself, greedy and sampled, streamed and not: a required or named call always parses."""
    from tinyvllm.engine.llm_engine import LLMEngine

    with serve(lambda: LLMEngine(max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=512,
                                     kv_cache_memory="64MiB")) as server:
        c = client(server)
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
                request = dict(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=ASK, tools=TOOLS,
                               tool_choice=tool_choice, max_tokens=80, parallel_tool_calls=False, **sampling)
                choice = c.chat.completions.create(**request).choices[0]
                assert choice.finish_reason == "tool_calls", choice
                (call,) = choice.message.tool_calls
                check_arguments(call.function.name, call.function.arguments)
                with c.chat.completions.stream(**request) as stream:
                    streamed = stream.get_final_completion().choices[0]
                assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == \
                    [(call.function.name, call.function.arguments)]


# ---- what the model writes is checked before it is a call: declared, one when parallel calls are off, valid ----

OTHER_CALLS = [  # after CALL: an undeclared tool, arguments that do not fit the schema, then a good call
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5, "unit": "kelvin"}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"b": true, "a": 3}}\n</tool_call>']


@pytest.fixture(scope="module")
def calls_server():
    reply = "\n".join([CALL, *OTHER_CALLS])
    with serve(lambda: FakeLLMEngine(reply=reply, max_model_len=1024, num_blocks=256)) as server:
        yield server


def calls_of(server, stream: bool, **request) -> tuple[list[tuple[str, dict]], str | None, str]:
    c = client(server)
    request = {"model": "fake-smollm2", "messages": ASK, "tools": TOOLS, "temperature": 0, **request}
    if stream:
        with c.chat.completions.stream(**request) as s:
            choice = s.get_final_completion().choices[0]
    else:
        choice = c.chat.completions.create(**request).choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []]
    return calls, choice.message.content, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_undeclared_invalid_and_parallel_calls(calls_server, stream):
    # before: every block was a call, the undeclared one and the invalid arguments included, parallel or not
    weather, add = ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"b": True, "a": 3})
    calls, content, finish_reason = calls_of(calls_server, stream)
    assert calls == [weather, add] and finish_reason == "tool_calls"
    assert "delete_everything" not in (content or "")  # dropped
    assert '"kelvin"' in content  # not a call: left as the text the model wrote
    calls, _, _ = calls_of(calls_server, stream, parallel_tool_calls=False)
    assert calls == [weather]
    calls, _, _ = calls_of(calls_server, stream, tool_choice="required")  # several calls under required too
    assert calls == [weather, add]


def test_required_with_parallel_calls_may_make_several(tiny):
    """The forced grammar lets a random model write one call or more, each parsing and validating."""
    c = client(tiny)
    counts = set()
    for seed in range(4):
        response = c.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=200, temperature=1.0, seed=seed)
        calls = response.choices[0].message.tool_calls
        for call in calls:
            check_arguments(call.function.name, call.function.arguments)
        counts.add(len(calls))
    assert min(counts) >= 1


def test_the_llama3_json_tool_call_parser():
    reply = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; '
             '{"name": "nope", "parameters": {}}')
    with serve(lambda: FakeLLMEngine(reply=reply, max_model_len=1024, num_blocks=256),
                   tool_call_parser="llama3_json") as server:
        for stream in (False, True):
            calls, content, finish_reason = calls_of(server, stream)
            assert calls == [("get_weather", {"city": "Oslo", "unit": "celsius"})] and finish_reason == "tool_calls"
            assert not content
    from tinyvllm.api.tool_parser import split_json_objects
    assert LLMatcher.validate_grammar(Llama3JsonToolParser.forced_grammar([WEATHER["function"]], True)) == ""
    assert split_json_objects('{"a": "}{\\"x"}; {"b": 1} tail') == ['{"a": "}{\\"x"}', '{"b": 1}', "tail"]


# ---- tools built from pydantic models: parameters with $defs and $refs ---------------------------------------

class Unit(str, Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Strict(BaseModel):
    # {"additionalProperties": false}, as OpenAI's strict tools have it; else a random model invents keys forever
    model_config = ConfigDict(extra="forbid")


class Options(Strict):
    unit: Unit
    days: int | None = Field(None, ge=0, le=9)  # Optional: {"anyOf": [integer, null]}


class Forecast(Strict):
    city: str = Field(max_length=8)
    options: Options  # a nested model: {"$ref": "#/$defs/Options"}
    more: list[Options] = Field(default_factory=list, max_length=2)  # a list of them


class Node(Strict):  # a recursive model: its own $defs entry refers to itself
    name: str = Field(max_length=6)
    children: list[Node] = Field(default_factory=list, max_length=1)


MODELS = {"forecast": Forecast, "tree": Node}
PYDANTIC_TOOLS = [{"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
                  for name, model in MODELS.items()]


def test_pydantic_tools_have_defs_and_refs():
    assert {"$defs", "properties"} <= set(Forecast.model_json_schema())
    assert Node.model_json_schema()["$ref"] == "#/$defs/Node"


def check_model_call(name: str, arguments: str) -> None:
    MODELS[name].model_validate_json(arguments)  # raises when the arguments do not fit the model


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "forecast"}},
                                         {"type": "function", "function": {"name": "tree"}}])
def test_forced_calls_to_pydantic_tools(tiny, tool_choice):
    # before: a 400, "Pointer '/$defs/Options' does not exist": the $defs were left inside the call schema's anyOf
    c = client(tiny)
    for temperature, seed in [(0, None), (1.0, 0), (1.0, 1)]:
        request = dict(model="model", messages=ASK, tools=PYDANTIC_TOOLS, tool_choice=tool_choice, max_tokens=200,
                       temperature=temperature, seed=seed, parallel_tool_calls=False)
        choice = c.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        if not isinstance(tool_choice, str):
            assert call.function.name == tool_choice["function"]["name"]
        check_model_call(call.function.name, call.function.arguments)
        with c.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == \
            [(call.function.name, call.function.arguments)]


def test_pydantic_tools_in_the_responses_api_and_legacy_functions(tiny):
    c = client(tiny)
    tools = [{"type": "function", **tool["function"]} for tool in PYDANTIC_TOOLS]
    response = c.responses.create(model="model", input="Weather?", tools=tools, tool_choice="required",
                                  max_output_tokens=200, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) >= 1
    for call in calls:
        check_model_call(call.name, call.arguments)
    functions = [tool["function"] for tool in PYDANTIC_TOOLS]
    choice = c.chat.completions.create(model="model", messages=ASK, functions=functions,
                                       function_call={"name": "forecast"}, max_tokens=200, temperature=0).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "forecast"
    check_model_call("forecast", choice.message.function_call.arguments)


def test_auto_calls_to_pydantic_tools():
    arguments = {"city": "Oslo", "options": {"unit": "celsius", "days": 2}, "more": [{"unit": "fahrenheit"}]}
    reply = tool_call_text("forecast", arguments)
    with serve(lambda: FakeLLMEngine(reply=reply, max_model_len=1024, num_blocks=256)) as server:
        for stream in (False, True):
            calls, content, finish_reason = calls_of(server, stream, tools=PYDANTIC_TOOLS)
            assert calls == [("forecast", arguments)] and not content and finish_reason == "tool_calls"


def test_the_forced_grammar_gives_each_tool_its_schema_whole(fake):
    grammar = HermesToolParser.forced_grammar([tool["function"] for tool in PYDANTIC_TOOLS], True)
    assert LLMatcher.validate_grammar(grammar) == ""
    # a $ref to nowhere is still a 400 naming the tools, whatever tool_choice
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"$ref": "#/$defs/Missing"}}}
    for tool_choice in ("auto", "required"):
        response = httpx.post(f"{fake.url}/v1/chat/completions",
                              json={"messages": ASK, "tools": [bad], "tool_choice": tool_choice}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "Missing" in response.json()["error"]["message"]


# ---- a forced call cut short by max_tokens ends clean -----------------------------------------------------

FORCED = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("tool_choice", FORCED)
def test_a_forced_call_cut_short_has_no_markup_and_no_calls(tiny, tool_choice):
    # before: content was the cut call's markup, '<tool_call>\n{"name": "get_w...'
    c = client(tiny)
    request = dict(model="model", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=8, temperature=0)
    choice = c.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None and choice.message.tool_calls is None
    events, _ = stream_json(tiny, "/v1/chat/completions", request)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant"}
    assert not any(d.get("content") or d.get("tool_calls") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    responses_choice = tool_choice if isinstance(tool_choice, str) else {"type": "function", "name": "get_weather"}
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    response = c.responses.create(model="model", input="Weather?", tools=tools, tool_choice=responses_choice,
                                  max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.output == []
    events = list(c.responses.create(model="model", input="Weather?", tools=tools, tool_choice=responses_choice,
                                     max_output_tokens=8, temperature=0, stream=True))
    assert not [e for e in events if e.type.startswith("response.output_")]
    assert events[-1].type == "response.incomplete" and events[-1].response.output == []
    function_call = "auto" if isinstance(tool_choice, str) else {"name": "get_weather"}
    if function_call != "auto":  # the legacy functions: no function_call, no markup
        legacy = c.chat.completions.create(model="model", messages=ASK, functions=[t["function"] for t in TOOLS],
                                           function_call=function_call, max_tokens=8, temperature=0).choices[0]
        assert legacy.finish_reason == "length" and legacy.message.function_call is None
        assert legacy.message.content is None


@pytest.mark.parametrize("parser, cut", [(HermesToolParser, '<tool_call>\n{"name": "get_weather", "argu'),
                                         (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"ci')])
def test_both_parsers_drop_a_cut_forced_call_and_keep_an_unforced_one_as_text(parser, cut):
    for forced, expected in ((True, ""), (False, cut)):
        tools = parser(ToolCallPolicy([WEATHER["function"]], forced=forced))
        content, calls = tools.feed(cut)
        more_content, more_calls = tools.finish()
        assert (content + more_content, calls + more_calls) == (expected, [])


# ---- any role a chat template knows ----------------------------------------------------------------------

def test_any_role_reaches_the_chat_template(fake):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "tool_result", "content": "18 C"},
                {"role": "Ada", "content": [{"type": "text", "text": "Hi"}]}]
    text = serving_chat(shared_tokenizer()).render_text(messages)
    assert ("<|im_start|>developer\nBe brief.<|im_end|>\n<|im_start|>tool_result\n18 C<|im_end|>\n"
            "<|im_start|>Ada\nHi<|im_end|>\n") in text
    response = httpx.post(f"{fake.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4},
                          timeout=60)
    assert response.status_code == 200, response.text
    for role in (None, 5, ""):
        response = httpx.post(f"{fake.url}/v1/chat/completions",
                              json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert "role must be a string" in response.json()["error"]["message"]
