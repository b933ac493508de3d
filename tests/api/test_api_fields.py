"""Phase 9: every request field is honoured or refused (tinyvllm/api/fields.py).

The test data, tests/api/data/vllm_request_fields.json, holds the field names of vLLM's request models and of the
openai client's create() params (their sources are written in it). Against it:

    every vLLM and OpenAI field of each request        is in the table (SUPPORTED or Refused)
    every SUPPORTED field                              is a field of our pydantic model, and every model field
                                                       is SUPPORTED (a field added to a model must be entered)
    no Refused field                                   is a field of our model (flip it to SUPPORTED when it is)
    a Refused field at any other value than its default   400, `param` the field, the message naming it
    a Refused field at its default (vLLM's)            200: clients that send every default keep working
    a field in neither                                 400 naming it (unknown field)

When a field is implemented, its entry becomes SUPPORTED and it leaves the refusal walk by itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from api_helpers import serve
from fake_engine import FakeLLMEngine

from tinyvllm.api.fields import FIELDS, SUPPORTED, Refused, is_default
from tinyvllm.api.protocol import ChatCompletionRequest, CompletionRequest
from tinyvllm.api.protocol_responses import ResponsesRequest
from tinyvllm.api.serving_embeddings import EmbeddingRequest
from tinyvllm.api.serving_tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

DATA = json.loads((Path(__file__).parent / "data" / "vllm_request_fields.json").read_text())
VLLM, OPENAI = DATA["vllm"]["models"], DATA["openai"]["models"]
CHAT = [{"role": "user", "content": "hi"}]

# our request model -> the models of the same request in vLLM and the openai client, and a request that succeeds
REQUESTS = {
    CompletionRequest: (VLLM["CompletionRequest"] + OPENAI["CompletionCreateParams"],
                        "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ChatCompletionRequest: (VLLM["ChatCompletionRequest"] + OPENAI["ChatCompletionCreateParams"],
                            "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ResponsesRequest: (VLLM["ResponsesRequest"] + OPENAI["ResponseCreateParams"],
                       "/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    EmbeddingRequest: (VLLM["EmbeddingCompletionRequest"] + VLLM["EmbeddingChatRequest"]
                       + OPENAI["EmbeddingCreateParams"], "/v1/embeddings", {"input": "Hi"}),
    TokenizeCompletionRequest: (VLLM["TokenizeCompletionRequest"], "/tokenize", {"prompt": "Hi"}),
    TokenizeChatRequest: (VLLM["TokenizeChatRequest"], "/tokenize", {"messages": CHAT}),
    DetokenizeRequest: (VLLM["DetokenizeRequest"], "/detokenize", {"tokens": [1, 2]}),
}
MODELS = list(REQUESTS)


def table(model) -> dict:
    return FIELDS[model.__name__]


def refused_fields() -> list[tuple[type, str, Refused]]:
    return [(model, name, entry) for model in MODELS for name, entry in table(model).items()
            if isinstance(entry, Refused)]


REFUSED = refused_fields()
REFUSED_IDS = [f"{model.__name__}.{name}" for model, name, _ in REFUSED]


def other_than(default: object) -> object:
    """A JSON value that is not `default` (the refusal comes before the field's type would be checked)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return ["x"]
    return "x"


@pytest.fixture(scope="module")
def server():
    with serve(lambda: FakeLLMEngine()) as server:
        yield server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_the_test_data_has_every_request_model():
    assert set(VLLM) == {"CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "EmbeddingCompletionRequest",
                         "EmbeddingChatRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
                         "DetokenizeRequest"}
    assert all(len(names) == len(set(names)) > 0 for names in [*VLLM.values(), *OPENAI.values()])
    assert set(FIELDS) == {model.__name__ for model in MODELS}


def test_every_vllm_and_openai_field_is_in_the_table():
    missing = {model.__name__: sorted(set(theirs) - set(table(model))) for model, (theirs, _, _) in REQUESTS.items()}
    missing = {name: fields for name, fields in missing.items() if fields}
    assert not missing, f"enter these in tinyvllm/api/fields.py (SUPPORTED or Refused): {missing}"


def test_supported_fields_are_the_fields_of_our_models():
    for model in MODELS:
        supported = {name for name, entry in table(model).items() if entry == SUPPORTED}
        assert not supported - set(model.model_fields), f"{model.__name__}: SUPPORTED but not a field of the model"
        assert not set(model.model_fields) - supported, f"{model.__name__}: a field of the model missing from the table"


def test_no_refused_field_is_a_field_of_our_model():
    both = [f"{model.__name__}.{name}" for model, name, _ in REFUSED if name in model.model_fields]
    assert not both, f"implemented now: mark these SUPPORTED in tinyvllm/api/fields.py: {both}"


def test_every_entry_is_a_field_of_vllm_openai_or_ours():
    """No stale entries: a refusal for a field nobody sends is noise."""
    for model, (theirs, _, _) in REQUESTS.items():
        stale = set(table(model)) - set(theirs) - set(model.model_fields)
        assert not stale, f"{model.__name__}: {sorted(stale)}"


def test_every_entry_is_supported_or_refused_with_a_reason():
    for model in MODELS:
        for name, entry in table(model).items():
            assert entry == SUPPORTED or isinstance(entry, Refused) and entry.reason, (model.__name__, name)


@pytest.mark.parametrize("model, name, refused", REFUSED, ids=REFUSED_IDS)
def test_a_refused_field_is_400_naming_it(server, model, name, refused):
    _, path, body = REQUESTS[model]
    value = other_than(refused.default)
    response = post(server, path, {**body, name: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == 400, error
    assert error["message"].startswith(f"{name}={json.dumps(value)}: not supported"), error


@pytest.mark.parametrize("model, name, refused", REFUSED, ids=REFUSED_IDS)
def test_a_refused_field_at_its_default_is_accepted(server, model, name, refused):
    _, path, body = REQUESTS[model]
    response = post(server, path, {**body, name: refused.default})
    assert response.status_code == 200, response.text
    if refused.default is not None:  # null too: the field not sent
        assert post(server, path, {**body, name: None}).status_code == 200


@pytest.mark.parametrize("model", MODELS, ids=[model.__name__ for model in MODELS])
def test_an_unknown_field_is_400_naming_it(server, model):
    _, path, body = REQUESTS[model]
    assert post(server, path, body).status_code == 200
    response = post(server, path, {**body, "temprature": 0.5})  # a typo is not "the default temperature"
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "temprature" and error["code"] == 400, error
    assert error["message"].startswith("temprature: unknown field"), error


def test_a_default_is_the_same_json_value():
    assert is_default(1, 1.0) and is_default(None, 1.0) and is_default([], []) and is_default("auto", "auto")
    assert not is_default(True, 1) and not is_default(1, True) and not is_default(0, False)
    assert not is_default(["x"], []) and not is_default("", None) and not is_default(False, None)
