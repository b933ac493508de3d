"""Phase 9: the server fuzzed from its own OpenAPI schema, with schemathesis.

schemathesis reads /openapi.json (the pydantic models of `protocol.py` as FastAPI writes them, plus
what `tinyvllm/api/openapi.py` adds: the errors, the rate-limit headers, the bearer key, messages and prompts
as served) and generates requests from it: valid ones ("positive": they must reach the engine, or be
refused with a documented 4xx when the server knows more than a schema can say, such as the context
length) and invalid ones ("negative": a wrong type, a value out of range, a missing field or key,
which must be refused with a 4xx). Every answer is checked: never a 5xx; a status, content type,
headers and body the schema documents. The fake engine answers in microseconds, so the few hundred
requests take seconds; the examples are bounded, and so is the time.

Not checked: schemathesis' `positive_data_acceptance` (every schema-valid request must succeed),
which a server with a context length and a vocabulary cannot meet; and the schema's "integer" takes
2.0 where the server's strict types refuse it (a 400, by design: `protocol.py`).
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import schemathesis
from fake_engine import FakeLLMEngine
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tinyvllm.api.keys import ApiKey, ApiKeys, sha256
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 30}  # per generation route
OTHER_EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 6}  # per other route
FIRST = ("POST /v1/completions", "POST /v1/chat/completions")  # fuzzed first, with the most examples
TIME_BUDGET_S = 40.0  # the whole run, on a slow machine; it takes a fraction of it
FIRST_SHARE = 0.3  # of the budget, at most, for each of FIRST; the other routes share the rest


class TimeBudgetSpent(Exception):
    """Raised inside a hypothesis run to stop its generating cases (which takes time too) once the route's share
    of the budget is spent; with no shrink phase, hypothesis passes it straight on."""


def fuzz_server(tmp_path) -> BackgroundServer:
    # limits so high that nothing is refused, but every answer goes through the x-ratelimit-* path;
    # the audit log is on, so every request goes through its record too
    keys = ApiKeys([ApiKey("fuzz", sha256(KEY), rpm=10**6, tpm=10**9)])
    engine = AsyncLLMEngine(lambda: FakeLLMEngine(max_model_len=256, num_blocks=512), max_waiting=64)
    return BackgroundServer(build_app(engine, api_keys=keys, audit_log=tmp_path / "audit.jsonl"), timeout=120)


def test_fuzz_the_openapi_schema(tmp_path):
    with fuzz_server(tmp_path) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
        statuses: Counter = Counter()  # (route, mode, status) -> cases
        failures: list[str] = []
        start = time.monotonic()
        operations = sorted((result.ok() for result in schema.get_all_operations()),
                            key=lambda operation: (FIRST.index(operation.label) if operation.label in FIRST
                                                   else len(FIRST), operation.label))
        num_others = len(operations) - len(FIRST)
        for operation in operations:
            if time.monotonic() - start > TIME_BUDGET_S:  # generating a case costs time too: stop generating
                break
            # its own share of the budget: a slow machine still fuzzes every route a little
            share = FIRST_SHARE if operation.label in FIRST else (1 - len(FIRST) * FIRST_SHARE) / num_others
            deadline = min(time.monotonic() + share * TIME_BUDGET_S, start + TIME_BUDGET_S)
            for mode, examples in (EXAMPLES if operation.label in FIRST else OTHER_EXAMPLES).items():

                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case):
                    if time.monotonic() > deadline:
                        raise TimeBudgetSpent
                    response = case.call(base_url=server.url, headers=AUTH, timeout=60)
                    statuses[(operation.label, mode.value, response.status_code)] += 1
                    try:
                        case.validate_response(response, headers=AUTH, excluded_checks=[positive_data_acceptance])
                    except (AssertionError, FailureGroup) as e:  # every failure, not only the first
                        failures.append(f"{operation.label} [{mode.value}] {response.status_code}: {e}\n"
                                        f"{case.as_curl_command(headers=AUTH, base_url=server.url)}")

                try:
                    run()
                except TimeBudgetSpent:
                    break
                except Unsatisfiable:  # negative: a GET with no parameter and no key has nothing to get wrong
                    assert mode is GenerationMode.NEGATIVE, operation.label
        elapsed = time.monotonic() - start
    cases = sum(statuses.values())
    server_errors = sum(n for (_, _, status), n in statuses.items() if status >= 500)
    summary = "\n".join(f"  {label} [{mode}] {status}: {n}" for (label, mode, status), n in sorted(statuses.items()))
    print(f"\nschemathesis: {cases} cases in {elapsed:.1f} s, {server_errors} answered 5xx, "
          f"{len(failures)} failed a check\n{summary}")
    assert server_errors == 0 and not failures, "\n\n".join(failures[:10])
    assert elapsed < TIME_BUDGET_S + 10
    # generated requests reached the engine and came back, for both endpoints
    served = {label for (label, mode, status) in statuses if status == 200 and mode == "positive"}
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= served, summary


def test_schema_is_the_servers(tmp_path):
    with fuzz_server(tmp_path) as server:
        schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
        # a method a path does not have: 405 naming the ones it has (found by schemathesis' coverage phase,
        # `st run --phases coverage`: the error handler dropped Starlette's Allow header)
        response = httpx.request("TRACE", f"{server.url}/v1/completions", headers=AUTH)
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        assert response.json()["error"]["type"] == "Method Not Allowed"  # vLLM's: the reason phrase
    completions = schema["paths"]["/v1/completions"]["post"]
    for path in ("/v1/responses", "/v1/embeddings", "/v1/models/{model}", "/tokenize", "/detokenize", "/version",
                 "/ping"):  # vLLM's other endpoints are in the schema, so the fuzzer sends them requests too
        assert path in schema["paths"], path
    assert "422" not in completions["responses"] and "HTTPValidationError" not in schema["components"]["schemas"]
    assert {"400", "401", "404", "413", "421", "429", "500", "503"} <= set(completions["responses"])
    assert completions["security"] == [{"bearer": []}] and "security" not in schema["paths"]["/health"]["get"]
    assert "Retry-After" in completions["responses"]["429"]["headers"]
    body = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/CompletionRequest")  # the pydantic model
