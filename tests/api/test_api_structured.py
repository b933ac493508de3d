"""Structured outputs through the server, prefix-cache usage and metrics, and request priority.

The constraints run on a tiny model with random weights: whatever it would say, every output must parse
and validate, on both routes, greedy and sampled, streamed and not, under each name the API gives the
constraint (OpenAI's response_format, vLLM's structured_outputs and guided_*). The real model then answers
a json_object request the way a user would send it.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

import httpx
import openai
import pytest
from api_helpers import client, metrics

from conftest import write_tiny_model
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
CHAT = [{"role": "user", "content": "Describe a user."}]
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 0}, {"temperature": 1.0, "seed": 1}]


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "role"} and isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["role"] in ("admin", "user", "guest")


@contextmanager
def serve_app(engine_factory):
    engine = AsyncLLMEngine(engine_factory)
    app = build_app(engine, served_model_names=["model"], enable_prompt_tokens_details=True)  # cached_tokens
    with BackgroundServer(app, timeout=600) as server:
        yield server


@pytest.fixture(scope="module")
def priorities() -> list[int]:
    return []  # the priority of every request the engine was given


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, priorities):
    from tinyvllm.engine.llm_engine import LLMEngine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-structured"), seed=3)

    def make_engine():
        engine = LLMEngine(path, max_model_len=512, kv_cache_memory="16MiB", max_num_seqs=4,
                           max_num_batched_tokens=64, scheduling_policy="priority")
        add_request = engine.add_request

        def recording_add_request(*args, priority: int = 0, **kwargs):
            priorities.append(priority)
            return add_request(*args, priority=priority, **kwargs)

        engine.add_request = recording_add_request
        return engine

    with serve_app(make_engine) as server:
        yield server


def complete(c: openai.OpenAI, route: str, stream: bool, **request) -> tuple[str, str]:
    """The text and finish_reason of one request, joined from the stream when streamed."""
    if route == "chat":
        response = c.chat.completions.create(model="model", messages=CHAT, stream=stream, **request)
        if not stream:
            return response.choices[0].message.content, response.choices[0].finish_reason
        chunks = list(response)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks), chunks[-1].choices[0].finish_reason
    extra_body = {**request.pop("extra_body", {}), **request.pop("fields", {})}
    response = c.completions.create(model="model", prompt="A user:", stream=stream, extra_body=extra_body, **request)
    if not stream:
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = list(response)
    return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason


SCHEMA_WAYS = {
    "response_format": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    "structured_outputs": {"extra_body": {"structured_outputs": {"json": PERSON}}},
    "guided_json": {"extra_body": {"guided_json": json.dumps(PERSON)}},
}


@pytest.mark.parametrize("way", SCHEMA_WAYS)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_json_schema_outputs_always_parse(tiny, route, way):
    c = client(tiny)
    for stream in (False, True):
        for sampling in SAMPLINGS:
            request = {**SCHEMA_WAYS[way], **sampling, "max_tokens": 100}
            if route == "completions" and "response_format" in request:
                request["fields"] = {"response_format": request.pop("response_format")}
            text, finish_reason = complete(c, route, stream, **request)
            assert finish_reason == "stop", text
            check_person(text)


# vLLM's guided_grammar example (examples/online_serving/openai_chat_completion_structured_outputs.py), in GBNF:
# llama.cpp's grammar format, converted by llguidance (before, refused as Lark that does not parse)
VLLM_SQL_GBNF = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""


@pytest.mark.parametrize("constraint, check", [
    ({"grammar": VLLM_SQL_GBNF},
     lambda text: re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text)),
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)),
    ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"grammar": 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[1-9]/'},
     lambda text: re.fullmatch(r"\([1-9](\+[1-9])*\)", text)),
])
def test_regex_choice_and_grammar_under_both_names(tiny, constraint, check):
    (kind, value), = constraint.items()
    c = client(tiny)
    for extra_body in ({"structured_outputs": constraint}, {f"guided_{kind}": value}):
        for route in ("chat", "completions"):
            for sampling in SAMPLINGS[:2]:
                text, finish_reason = complete(c, route, False, extra_body=extra_body, max_tokens=60, **sampling)
                assert finish_reason == "stop" and check(text), text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),  # GBNF naming a rule it lacks
    ({"guided_choice": []}, "guided_choice"),
    ({"priority": "high"}, "priority"),
])
def test_bad_constraints_are_400s_naming_the_field(tiny, body, param):
    for path, base in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        for stream in (False, True):  # refused before the 200 of a stream
            response = httpx.post(f"{tiny.url}{path}", json={**base, **body, "max_tokens": 4, "stream": stream},
                                  timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param, error
    if param == "guided_regex" and "a(b" in str(body):
        assert "unclosed group" in error["message"]


def test_cached_tokens_on_a_repeated_prompt_and_in_metrics(tiny):
    c = client(tiny)
    prompt = " ".join(f"item {i}," for i in range(60))  # > 100 tokens: several full blocks of 16
    before = metrics(tiny)
    first = c.completions.create(model="model", prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model="model", prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    chunks = list(c.chat.completions.create(model="model", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is not None
    after = metrics(tiny)
    assert after["tinyvllm:prefix_cache_hits_total"] - before["tinyvllm:prefix_cache_hits_total"] >= cached
    assert after["tinyvllm:prefix_cache_queries_total"] > after["tinyvllm:prefix_cache_hits_total"]


def test_priority_reaches_the_engine(tiny, priorities):
    c = client(tiny)
    c.completions.create(model="model", prompt="Hi", max_tokens=2, extra_body={"priority": -3})
    c.chat.completions.create(model="model", messages=CHAT, max_tokens=2, extra_body={"priority": 7})
    c.completions.create(model="model", prompt="Hi", max_tokens=2)
    assert priorities[-3:] == [-3, 7, 0]


# ---- the real model --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_real_model_answers_json_object_requests():
    from tinyvllm.engine.llm_engine import LLMEngine

    ask = [{"role": "user", "content": "Describe a person as a JSON object with the keys name and age."}]
    with serve_app(lambda: LLMEngine(max_model_len=512, max_num_seqs=2, max_num_batched_tokens=128,
                                     kv_cache_memory="32MiB")) as server:
        c = client(server)
        for stream in (False, True):
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 1}):
                response = c.chat.completions.create(model="model", messages=ask, max_tokens=60, stream=stream,
                                                     response_format={"type": "json_object"}, **sampling)
                if stream:
                    chunks = list(response)
                    text, finish_reason = "".join(ch.choices[0].delta.content or "" for ch in chunks), \
                        chunks[-1].choices[0].finish_reason
                else:
                    text, finish_reason = response.choices[0].message.content, response.choices[0].finish_reason
                assert finish_reason == "stop" and isinstance(json.loads(text), dict), text
