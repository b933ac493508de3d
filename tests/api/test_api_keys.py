"""Phase 9: API keys with limits (--api-keys-file), the audit log (--audit-log) and per-key metrics.

    the keys file        JSON, {"keys": [...]} or JSON lines; sha256 or key; typos and bad values refused
    token buckets        Retry-After is exact (a clock the test moves): one second earlier is still a 429
    RPM / TPM            a burst over the limit is a 429 with Retry-After and x-ratelimit-*; honouring it succeeds
    401                  an unknown key, a missing one, another scheme
    audit log            one JSON line per request (refusals and a client that left included), never the key
    /metrics             requests by key and status, prompt and generated tokens by key
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from api_helpers import client, parse_metrics, wait_for
from fake_engine import FakeLLMEngine

from tinyvllm.api import keys as keys_module
from tinyvllm.api.keys import ApiKey, ApiKeys, duration, load_api_keys, sha256
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app, main
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

MODEL = "fake-smollm2"
ALICE, BOB = "sk-alice-secret", "sk-bob-secret"


class Clock:
    """A clock the test moves by hand: Retry-After can be checked to the second without waiting."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keys_file(tmp_path: Path, *entries: dict) -> Path:
    path = tmp_path / "keys.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return path


@contextmanager
def serve(keys: ApiKeys | None = None, fake: FakeLLMEngine | None = None, **app_options):
    fake = fake or FakeLLMEngine()
    engine = AsyncLLMEngine(lambda: fake)
    with BackgroundServer(build_app(engine, api_keys=keys, **app_options), timeout=120) as server:
        server.fake = fake
        yield server


def complete(server, key: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=bearer(key), timeout=60)


def read_audit(path: Path, count: int) -> list[dict]:
    wait_for(lambda: path.exists() and len(path.read_text().splitlines()) >= count, what=f"{count} audit lines")
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- the keys file ---------------------------------------------------------------------------------


def test_keys_file_formats(tmp_path):
    entries = [{"id": "alice", "sha256": sha256(ALICE).hex(), "rpm": 60, "tpm": 1000}, {"id": "bob", "key": BOB}]
    expected = [ApiKey("alice", sha256(ALICE), 60, 1000), ApiKey("bob", sha256(BOB))]
    for text in (json.dumps(entries), json.dumps({"keys": entries}), "\n".join(map(json.dumps, entries)) + "\n\n"):
        (tmp_path / "keys").write_text(text)
        assert load_api_keys(tmp_path / "keys") == expected
    # --api-key is one more key, without limits
    keys = ApiKeys.build("sk-single", keys_file(tmp_path, *entries))
    assert keys.identify("Bearer sk-single") == ApiKey("default", sha256("sk-single"))
    assert keys.identify(f"bearer {ALICE}").id == "alice"  # the scheme's case does not matter


@pytest.mark.parametrize("entry, words", [
    ({"id": "a", "key": "k", "rmp": 5}, "unknown field"),  # a typo is not "no limit"
    ({"id": "a", "key": "k", "sha256": "00" * 32}, "exactly one"),
    ({"id": "a"}, "exactly one"),
    ({"id": "a b", "key": "k"}, "id must be"),
    ({"id": "a", "sha256": "abc"}, "64 hex"),
    ({"id": "a", "key": "k", "rpm": 0}, "rpm must be"),
    ({"id": "a", "key": "k", "tpm": True}, "tpm must be"),
    ({"id": "a", "key": "k", "tpm": 1.5}, "tpm must be"),
])
def test_keys_file_errors_name_the_field(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        load_api_keys(keys_file(tmp_path, entry))


def test_keys_file_duplicates_and_cli_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="same id"):
        ApiKeys.build(keys_file=keys_file(tmp_path, {"id": "a", "key": "k1"}, {"id": "a", "key": "k2"}))
    with pytest.raises(ValueError, match="same key"):
        ApiKeys.build(keys_file=keys_file(tmp_path, {"id": "a", "key": "k"}, {"id": "b", "key": "k"}))
    with pytest.raises(ValueError, match=":2: not a JSON object"):
        (tmp_path / "broken.jsonl").write_text('{"id": "a", "key": "k"}\n{"id": \n')
        load_api_keys(tmp_path / "broken.jsonl")
    # the server refuses a bad file before it loads the model
    with pytest.raises(SystemExit):
        main(["--api-keys-file", str(tmp_path / "missing.jsonl")])
    assert "--api-keys-file" in capsys.readouterr().err


def test_new_key_command_writes_only_the_hash(capsys):
    keys_module.main(["carol", "--rpm", "30"])
    out, err = capsys.readouterr()
    key = err.rsplit(" ", 1)[1].strip()
    entry = json.loads(out)
    assert entry == {"id": "carol", "sha256": hashlib.sha256(key.encode()).hexdigest(), "rpm": 30}
    assert key not in out and ApiKeys([keys_module.parse_key(entry, "new")]).identify(f"Bearer {key}").id == "carol"


# ---- the buckets, with a clock the test moves --------------------------------------------------------


def test_retry_after_is_exact_for_requests_and_tokens():
    clock = Clock()
    keys = ApiKeys([ApiKey("a", sha256("k"), rpm=2, tpm=60)], clock=clock)  # 1 request per 30 s, 1 token per s
    key = keys.by_id["a"]
    keys.admit_request(key)
    keys.admit_request(key)  # a burst of 2: the bucket's capacity
    with pytest.raises(Exception) as e:
        keys.admit_request(key)
    assert e.value.status == 429 and e.value.type == "requests" and e.value.headers["Retry-After"] == "30"
    clock.now += 29.9
    with pytest.raises(Exception) as e:
        keys.admit_request(key)
    assert e.value.headers["Retry-After"] == "1"  # 0.1 s left, rounded up: never early
    clock.now += 0.1
    keys.admit_request(key)  # exactly Retry-After later: admitted

    assert keys.reserve_tokens(key, 20, 40) == 60  # a prompt and its max_tokens x n: the whole budget
    assert keys.headers(key)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(Exception) as e:
        keys.admit_request(key)  # nothing left: refused before its body is read
    assert e.value.type == "tokens" and e.value.headers["Retry-After"] == "1"
    clock.now += 100  # the requests bucket refills; the tokens one too, to 60
    assert keys.reserve_tokens(key, 10, 30) == 40
    keys.settle_tokens(key, 40, 10 + 5)  # it ended having generated 5 of its 30: 25 go back
    assert keys.headers(key)["x-ratelimit-remaining-tokens"] == "45"
    with pytest.raises(Exception) as e:
        keys.reserve_tokens(key, 5, 50)  # 55 needed, 45 held: 10 s at 1 per s
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "10"
    clock.now += 10
    keys.reserve_tokens(key, 5, 50)
    clock.now += 100
    with pytest.raises(Exception) as e:
        keys.reserve_tokens(key, 1, 60)  # more than a minute's budget: a 429 would never clear
    assert e.value.status == 400 and "can never be served" in e.value.message and e.value.param == "max_tokens"


def test_rate_limit_headers():
    clock = Clock()
    keys = ApiKeys([ApiKey("a", sha256("k"), rpm=60, tpm=6000), ApiKey("free", sha256("f"))], clock=clock)
    keys.admit_request(keys.by_id["a"])
    keys.reserve_tokens(keys.by_id["a"], 50, 100)
    assert keys.headers(keys.by_id["a"]) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "5850", "x-ratelimit-reset-tokens": "1.5s"}
    assert keys.headers(keys.by_id["free"]) == {}
    assert [duration(s) for s in (0, 0.25, 1, 1.5, 60, 361.5)] == ["0s", "250ms", "1s", "1.5s", "1m0s", "6m1.5s"]


# ---- live: 401, RPM, TPM -------------------------------------------------------------------------------


def test_unknown_key_is_401(tmp_path):
    keys = ApiKeys.build(keys_file=keys_file(tmp_path, {"id": "alice", "sha256": sha256(ALICE).hex()}))
    with serve(keys) as server:
        for headers in (bearer("sk-nobody"), {}, {"Authorization": f"Basic {ALICE}"}, bearer(ALICE + "x")):
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi"}, headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            client(server, "sk-nobody").models.list()
        assert httpx.get(f"{server.url}/health").status_code == 200  # a probe needs no key
        response = complete(server, ALICE)
        assert response.status_code == 200
        assert not any(name.startswith("x-ratelimit") for name in response.headers)  # no limits, no headers


def test_single_api_key_still_works():
    engine = AsyncLLMEngine(lambda: FakeLLMEngine())
    with BackgroundServer(build_app(engine, api_key="sk-one"), timeout=120) as server:
        assert complete(server, "sk-one").status_code == 200
        assert complete(server, "sk-two").status_code == 401
    with pytest.raises(ValueError, match="not both"):
        build_app(AsyncLLMEngine(lambda: None), api_key="k", api_keys=ApiKeys.build("k"))


def test_burst_over_rpm_is_429_and_retry_after_is_honoured(tmp_path):
    clock = Clock()
    keys = ApiKeys([ApiKey("alice", sha256(ALICE), rpm=3), ApiKey("bob", sha256(BOB), rpm=3)], clock=clock)
    with serve(keys) as server:
        statuses = [complete(server, ALICE) for _ in range(5)]  # a burst of 5 in the same instant
        assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in statuses] == ["2", "1", "0", "0", "0"]
        refused = statuses[-1]
        assert refused.headers["retry-after"] == "20"  # 3 per minute: one more every 20 s
        assert (refused.headers["x-ratelimit-limit-requests"] == "3"
                and refused.headers["x-ratelimit-reset-requests"] == "1m0s")
        assert refused.json()["error"]["type"] == "requests" and refused.json()["error"]["code"] == 429
        assert complete(server, BOB).status_code == 200  # another key's budget is its own
        clock.now += 19
        assert complete(server, ALICE).status_code == 429  # a second before Retry-After: too early
        clock.now += 1
        assert complete(server, ALICE).status_code == 200  # the client that honours it succeeds
        assert complete(server, ALICE).status_code == 429


def test_openai_client_honours_retry_after_in_real_time(tmp_path):
    keys = ApiKeys.build(keys_file=keys_file(tmp_path, {"id": "alice", "key": ALICE, "rpm": 60}))
    with serve(keys) as server:
        with httpx.Client(headers=bearer(ALICE)) as http:  # drain the bucket: 60 at once, 1 more a second
            refused = next(r for _ in range(1000) if (r := http.get(f"{server.url}/v1/models")).status_code == 429)
        assert refused.headers["retry-after"] == "1"
        retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ALICE, max_retries=1, timeout=60)
        start = time.monotonic()
        raw = retrying.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert raw.http_response.status_code == 200 and raw.retries_taken == 1  # a 429 first, then waited
        assert time.monotonic() - start >= 0.5  # what is left of the second, at least


def test_tokens_per_minute_bound_what_is_spent(tmp_path):
    # the defect: only the prompt counted at admission, so concurrent requests with large max_tokens x n spent
    # many times the budget before any was refused. Now each reserves prompt + max_tokens x n, settled at its end.
    clock = Clock()
    keys = ApiKeys([ApiKey("alice", sha256(ALICE), tpm=60)], clock=clock)  # one token per second
    fake = FakeLLMEngine(step_time=0.02)
    with serve(keys, fake) as server:
        prompt = [fake.word_ids[0]] * 10
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "n": 2, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=bearer(ALICE)) as first:
            assert first.status_code == 200  # reserved 10 + 20 x 2 = 50 of 60
            lines = first.iter_lines()
            next(lines)
            refused = complete(server, ALICE, prompt=prompt, max_tokens=5, n=2)  # 20 more: 10 short
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
            assert refused.headers["retry-after"] == "10"
            assert list(lines)[-2] == "data: [DONE]"
        # settled: the first used all 50 (ignore_eos); a request that stops early gets the rest back
        clock.now += 60
        short = complete(server, ALICE, prompt=prompt, max_tokens=40, stop=[fake.tokenizer.decode([fake.word_ids[1]])])
        assert short.status_code == 200
        used = short.json()["usage"]["total_tokens"]
        assert short.headers["x-ratelimit-remaining-tokens"] == str(60 - used)  # the reservation of 50, settled
        clock.now += 60
        too_big = complete(server, ALICE, prompt=prompt, max_tokens=30, n=2)  # 70 > 60: never
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"
        assert "can never be served" in too_big.json()["error"]["message"]


# ---- audit log and metrics ----------------------------------------------------------------------------------


def test_audit_log_one_line_per_request(tmp_path):
    keys = ApiKeys([ApiKey("alice", sha256(ALICE), rpm=100), ApiKey("bob", sha256(BOB))])
    audit = tmp_path / "audit.jsonl"
    fake = FakeLLMEngine(step_time=0.02, max_model_len=4096, num_blocks=512)
    with serve(keys, fake, audit_log=audit) as server:
        ok = complete(server, ALICE, max_tokens=3, ignore_eos=True).json()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=bearer(BOB), timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
        assert complete(server, "sk-wrong").status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200  # not logged: a probe
        # a client that leaves mid-stream, and one that gives up waiting, are logged when the server notices
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=bearer(ALICE)) as response:
            lines = response.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ") and next(lines) == ""
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=bearer(BOB), timeout=0.3)
        lines = read_audit(audit, 5)
    assert ALICE not in audit.read_text() and BOB not in audit.read_text()
    assert len(lines) == 5 and all(set(line) == {"time", "key_id", "method", "route", "status", "prompt_tokens",
                                                 "completion_tokens", "latency_s", "disconnected", "request_id"}
                                   for line in lines)
    first, chat, unknown, left, gave_up = lines
    assert first["key_id"] == "alice" and first["route"] == "/v1/completions" and first["status"] == 200
    assert first["request_id"] == ok["id"] and first["time"].endswith("Z") and first["latency_s"] > 0
    assert (first["prompt_tokens"], first["completion_tokens"]) == (ok["usage"]["prompt_tokens"], 3)
    assert chat["key_id"] == "bob" and chat["completion_tokens"] == 2 and not chat["disconnected"]
    assert unknown["key_id"] is None and unknown["status"] == 401 and unknown["request_id"] is None
    assert left["status"] == 200 and left["disconnected"] and 3 <= left["completion_tokens"] < 2000
    assert gave_up["key_id"] == "bob" and gave_up["status"] == 499 and gave_up["disconnected"]


def test_metrics_per_key(tmp_path):
    clock = Clock()
    keys = ApiKeys([ApiKey("alice", sha256(ALICE), rpm=2), ApiKey("bob", sha256(BOB))], clock=clock)
    with serve(keys) as server:
        usages = {"alice": [], "bob": []}
        for key_id, key, max_tokens in (("alice", ALICE, 2), ("alice", ALICE, 5), ("bob", BOB, 3)):
            usages[key_id].append(complete(server, key, max_tokens=max_tokens, ignore_eos=True).json()["usage"])
        assert complete(server, ALICE).status_code == 429
        bob_metrics = httpx.get(f"{server.url}/metrics", headers=bearer(BOB))
        assert bob_metrics.status_code == 200
        samples = parse_metrics(bob_metrics.text)
    name = "tinyvllm:api_key_"
    assert samples[f'{name}requests_total{{key_id="alice",status="200"}}'] == 2
    assert samples[f'{name}requests_total{{key_id="alice",status="429"}}'] == 1
    assert samples[f'{name}requests_total{{key_id="bob",status="200"}}'] == 1  # the scrape itself counts when done
    for key_id in ("alice", "bob"):
        assert samples[f'{name}prompt_tokens_total{{key_id="{key_id}"}}'] == \
            sum(u["prompt_tokens"] for u in usages[key_id])
        assert samples[f'{name}generation_tokens_total{{key_id="{key_id}"}}'] == \
            sum(u["completion_tokens"] for u in usages[key_id])
    assert ALICE not in bob_metrics.text
