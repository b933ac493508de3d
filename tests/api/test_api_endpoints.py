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
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]  # vLLM's card: root, parent, permission
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 256
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    assert card["permission"][0]["id"].startswith("modelperm-")
    with pytest.raises(openai.NotFoundError) as e:
        client(server).models.retrieve("gpt-4")
    assert e.value.body["type"] == "NotFoundError" and MODEL in e.value.body["message"]


def test_version_and_ping(server):
    assert httpx.get(f"{server.url}/version").json()["version"]
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200


def test_tokenize_prompt_equals_the_tokenizer(server, tokenizer):
    body = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello world")
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                    "token_strs": [tokenizer.token_string(t) for t in ids]}
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
    from tinyvllm.api.launcher import BackgroundServer
    from tinyvllm.api.middleware import CorsConfig
    from tinyvllm.api.server import build_app
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


def offline(prompt, **params):
    from fake_engine import run_offline

    from tinyvllm.sampling_params import SamplingParams

    return run_offline(FakeLLMEngine(), prompt, SamplingParams(**params))


def test_batched_prompts_index_choices_across_prompts_and_n(server, tokenizer):
    prompts = ["Hello", "The capital of France is", "1, 2, 3,"]
    response = client(server).completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, seed=7,
                                                  temperature=1.0, echo=True)
    assert [c.index for c in response.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        expected = offline(prompt, n=2, max_tokens=4, seed=7, temperature=1.0)
        for k in range(2):
            assert response.choices[i * 2 + k].text == prompt + expected.outputs[k].text
    num_prompt = sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.prompt_tokens == num_prompt and response.usage.completion_tokens == 6 * 4
    ids = [tokenizer.encode(p) for p in prompts[:2]]  # a batch of token-id prompts, streamed
    chunks = list(client(server).completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                                    stream=True))
    for i, prompt in enumerate(ids):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == offline(
            prompt, max_tokens=3, temperature=0).outputs[0].text


def test_best_of_returns_the_most_likely_samples(server):
    # the fake engine gives each sampled token logprob -0.25: the most likely samples are the shortest ones
    params = dict(max_tokens=6, seed=3, temperature=1.0, stop=[" red", " blue"])
    expected = offline("Hello", n=5, logprobs=0, **params).outputs
    lengths = sorted(len(c.token_ids) for c in expected)
    assert lengths[0] < lengths[-1], "the samples should differ in length for this test to mean anything"
    response = client(server).completions.create(model=MODEL, prompt="Hello", n=2, best_of=5, **params)
    best = sorted(expected, key=lambda c: len(c.token_ids))[:2]
    assert [c.text for c in response.choices] == [c.text for c in best] and response.choices[0].logprobs is None
    assert response.usage.completion_tokens == sum(lengths)  # every sample is billed
    with pytest.raises(openai.BadRequestError, match="best_of must be at least n"):
        client(server).completions.create(model=MODEL, prompt="Hello", n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client(server).completions.create(model=MODEL, prompt="Hello", best_of=2, stream=True)


def test_suffix_is_refused_without_fim_tokens(server):
    with pytest.raises(openai.BadRequestError, match="<fim_prefix>") as e:
        client(server).completions.create(model=MODEL, prompt="def f(x):", suffix="    return y")
    assert e.value.body["param"] == "suffix"


def test_continuous_usage_stats(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                                    stream=True, stream_options=options))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]  # the usage so far, on every chunk
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    chat = list(client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=3, temperature=0, stream=True,
                                                       stream_options=options))
    counts = [c.usage.completion_tokens for c in chat if c.choices and c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == chat[-1].usage.completion_tokens


def test_per_request_metrics_on_the_answer_and_the_usage_chunk():
    timings = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}
    with serve(lambda: FakeLLMEngine(step_time=0.01), enable_per_request_metrics=True) as server:
        for path, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT_HI})):
            body = {**base, "max_tokens": 4, "temperature": 0}
            answer = post(server, path, body).json()
            metrics, gaps = answer["metrics"], answer["usage"]["completion_tokens"] - 1
            assert set(metrics) == timings and all(value >= 0 for value in metrics.values())
            assert metrics["generation_time_ms"] > 0 and metrics["tokens_per_second"] > 0  # steps take 10 ms
            assert abs(metrics["mean_itl_ms"] - metrics["generation_time_ms"] / gaps) < 1e-6
            chunks = streamed(server, path, {**body, "stream_options": {"include_usage": True}})
            assert all("metrics" not in c for c in chunks[:-1]) and set(chunks[-1]["metrics"]) == timings
            one = post(server, path, {**body, "max_tokens": 1}).json()["metrics"]
            assert set(one) == timings - {"mean_itl_ms"}  # one token: no gap to tell, left out as vLLM does
            assert post(server, path, {**body, "n": 2}).json()["metrics"] is None  # one request's, as in vLLM
    with serve(lambda: FakeLLMEngine()) as server:  # off by default
        assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).json()["metrics"] is None


def test_request_level_metrics_split_each_request_into_its_phases():
    from api_helpers import metrics

    with serve(lambda: FakeLLMEngine(step_time=0.01, max_num_seqs=1)) as slow:
        before = metrics(slow)
        with httpx.Client(timeout=60) as http:  # two at once on one slot: the second waits in the queue
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda _: http.post(f"{slow.url}/v1/completions",
                                                  json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}),
                              range(2)))
        after = metrics(slow)

    def grew(name: str) -> float:
        return after[f"tinyvllm:{name}"] - before.get(f"tinyvllm:{name}", 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"request_{phase}_time_seconds_count") == 2, phase
    assert grew("request_prompt_tokens_count") == 2 and grew("request_prompt_tokens_sum") == 2  # "Hello": 1 token
    assert grew("request_generation_tokens_sum") == 10 and grew("time_per_output_token_seconds_count") == 8
    assert grew("request_time_per_output_token_seconds_count") == 2
    # the phases add up: queue + inference is the engine's share of e2e; the queued one waited a request's time
    assert grew("request_queue_time_seconds_sum") + grew("request_inference_time_seconds_sum") <= \
        grew("e2e_request_latency_seconds_sum") + 1e-3
    assert grew("request_decode_time_seconds_sum") >= 2 * 4 * 0.01 and grew("request_queue_time_seconds_sum") >= 0.04
    assert after["tinyvllm:num_preemptions_total"] == 0
    assert grew("request_num_preemptions_count") == 2 and grew("request_num_preemptions_sum") == 0
    assert grew("request_params_n_count") == 2 and grew("request_params_max_tokens_sum") == 10


def test_echo_with_logprobs_streamed_and_batched(server, tokenizer):
    # the fake engine's prompt logprobs: None for the first token, -0.75 for the others (tests/fake_engine.py)
    prompts = ["Hello there", "The capital of France is"]
    response = client(server).completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=2,
                                                  temperature=0)
    for choice, prompt in zip(response.choices, prompts):
        ids = tokenizer.encode(prompt)
        assert choice.logprobs.tokens[:len(ids)] == [tokenizer.token_bytes(t).decode() for t in ids]
        assert choice.logprobs.token_logprobs[:len(ids)] == [None] + [-0.75] * (len(ids) - 1)
        assert choice.logprobs.token_logprobs[len(ids):] == [-0.25, -0.25]
    chunks = list(client(server).completions.create(model=MODEL, prompt=prompts[1], echo=True, logprobs=1,
                                                    max_tokens=2, temperature=0, stream=True))
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == response.choices[1].logprobs.token_logprobs


def test_chat_continues_the_final_message(server, tokenizer):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    text = text[:text.rindex("one two") + len("one two")]  # the last message left open: the model continues it
    expected = offline(tokenizer.encode(text, add_special_tokens=False), temperature=0, max_tokens=4)
    response = client(server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content == expected.outputs[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=messages,
                                               extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def streamed(server, path: str, body: dict) -> list[dict]:
    """The stream's chunks, parsed ([DONE] left out)."""
    import json

    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


CHAT_HI = [{"role": "user", "content": "Hi"}]


def test_return_token_ids_streamed_and_not(server, tokenizer):
    """vLLM's `return_token_ids`: each choice's generated ids (a stream's pieces add up to them), the prompt's ids
    on the choice (completions) or the response (chat), in a stream's first chunk."""
    prompt_ids = tokenizer.encode("Hello there")
    expected = offline(prompt_ids, max_tokens=3, temperature=0).outputs[0].token_ids
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert (choice["token_ids"], choice["prompt_token_ids"]) == (expected, prompt_ids)
    chunks = streamed(server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    plain = post(server, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # null unless asked, as vLLM's

    chat_body = {"messages": CHAT_HI, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    chat = post(server, "/v1/chat/completions", chat_body).json()
    chat_prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT_HI, add_generation_prompt=True),
                                   add_special_tokens=False)
    assert chat["prompt_token_ids"] == chat_prompt
    assert chat["choices"][0]["token_ids"] == offline(chat_prompt, max_tokens=3, temperature=0).outputs[0].token_ids
    chunks = streamed(server, "/v1/chat/completions", chat_body)
    assert chunks[0]["prompt_token_ids"] == chat_prompt and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == chat["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids_in_logprobs(server):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 1, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    for choice in (post(server, "/v1/completions", body).json()["choices"][0],
                   {"logprobs": {"tokens": [t for c in streamed(server, "/v1/completions", body)
                                            for t in c["choices"][0]["logprobs"]["tokens"]]},
                    "token_ids": post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]}):
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = post(server, "/v1/chat/completions", {"messages": CHAT_HI, "max_tokens": 2, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                                                 "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])


def test_prompt_logprobs_in_vllms_shape_and_refused_past_the_limit(server, tokenizer):
    # the fake engine's prompt logprobs: None for the first token, -0.75 for the others (tests/fake_engine.py)
    ids = tokenizer.encode("The capital of France is")
    got = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()[
        "choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for position in range(1, len(ids)):
        first = next(iter(got[position]))  # the prompt's own token comes first, then the alternatives
        assert int(first) == ids[position] and got[position][first]["logprob"] == -0.75
        assert got[position][first]["decoded_token"] == tokenizer.token_bytes(ids[position]).decode()
        assert [entry["rank"] for entry in got[position].values()] == [1, 2, 3]  # -0.75 beats the top -1.0
    chat = post(server, "/v1/chat/completions", {"messages": CHAT_HI, "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    for path, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT_HI})):
        for value, words in ((-1, "max allowed: 20"), (21, "max allowed: 20"), (-2, "positive value or -1")):
            error = post(server, path, {**base, "prompt_logprobs": value}).json()["error"]
            assert error["param"] == "prompt_logprobs" and words in error["message"], error
        refused = post(server, path, {**base, "prompt_logprobs": 1, "stream": True})
        assert refused.status_code == 400 and "not available when `stream=True`" in refused.json()["error"]["message"]


def test_chat_echo_opens_the_answer_with_the_last_message(server, tokenizer):
    """vLLM's chat `echo`: the last message's text comes first when its role is the answer's (an assistant
    message under add_generation_prompt), streamed as a chunk of its own after the role's."""
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "one two" + plain
    assert echoed["prompt_logprobs"][0] is None  # echo asks for the prompt's logprobs, as in vLLM
    chunks = streamed(server, "/v1/chat/completions", {**body, "echo": True})
    assert chunks[1]["choices"][0]["delta"] == {"content": "one two"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "one two" + plain
    user_last = post(server, "/v1/chat/completions", {"messages": CHAT_HI, "max_tokens": 3, "temperature": 0,
                                                      "echo": True}).json()
    assert user_last["choices"][0]["message"]["content"] == post(
        server, "/v1/chat/completions", {"messages": CHAT_HI, "max_tokens": 3, "temperature": 0}).json()[
        "choices"][0]["message"]["content"]  # a user's message is not the assistant's to continue


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, tokenizer):
    ids = tokenizer.encode("one two three four five six seven eight")
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "truncate_prompt_tokens": 3, "return_token_ids": True,
            "echo": True}
    response = post(server, "/v1/completions", body).json()
    assert response["usage"]["prompt_tokens"] == 3 and response["choices"][0]["prompt_token_ids"] == ids[-3:]
    assert response["choices"][0]["text"] == tokenizer.decode(ids[-3:]) + offline(
        ids[-3:], max_tokens=2, temperature=0).outputs[0].text
    right = post(server, "/v1/completions", {**body, "truncation_side": "right"}).json()  # vLLM's: the first ones
    assert right["choices"][0]["prompt_token_ids"] == ids[:3]
    assert post(server, "/v1/completions", {**body, "truncation_side": "middle"}).status_code == 400
    long_text = "word " * 400  # over the 256-token context: kept to its last 100 tokens instead of refused
    kept = post(server, "/v1/completions", {"prompt": long_text, "max_tokens": 2, "truncate_prompt_tokens": 100})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 100
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}],
                                                 "max_tokens": 2, "truncate_prompt_tokens": 50}).json()
    assert chat["usage"]["prompt_tokens"] == 50
    for path, base in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT_HI})):
        error = post(server, path, {**base, "truncate_prompt_tokens": 257}).json()["error"]
        assert error["message"].startswith("truncate_prompt_tokens value is greater than max_model_len. Please, "
                                           "select a smaller truncation size.")
        assert error["param"] == "truncate_prompt_tokens"
        for value in (0, -2):
            assert post(server, path, {**base, "truncate_prompt_tokens": value}).status_code == 400


def test_stream_usage_as_vllm_sends_it(server):
    chat = {"messages": CHAT_HI, "max_tokens": 3, "temperature": 0}
    for path, base in (("/v1/completions", {"prompt": "Hello", "max_tokens": 3}), ("/v1/chat/completions", chat)):
        assert "usage" not in streamed(server, path, base)[-1]  # not asked for
        assert "usage" not in streamed(server, path, {**base, "stream_options": {}})[-1]  # include_usage: false
        last = streamed(server, path, {**base, "stream_options": {"include_usage": True}})[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        assert last["usage"]["prompt_tokens_details"] is None  # only with --enable-prompt-tokens-details
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    chunks = streamed(server, "/v1/chat/completions", {**chat, "stream_options": continuous})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[0]["usage"]["prompt_tokens"] > 0
    assert all("usage" in c for c in chunks)
    coerced = post(server, "/v1/chat/completions", {**chat, "logprobs": "true"}).json()  # vLLM's lax bool
    assert len(coerced["choices"][0]["logprobs"]["content"]) == 3


def test_usage_flags_force_include_usage_and_prompt_tokens_details():
    with serve(lambda: FakeLLMEngine(), enable_force_include_usage=True, enable_prompt_tokens_details=True) as server:
        for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": CHAT_HI, "max_tokens": 2})):
            chunks = streamed(server, path, body)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert all(c["usage"] for c in chunks)  # forced: in every chunk too, as vLLM does
            assert post(server, path, body).json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
