"""Phase 9: what the engine computes at every prompt position, against HF transformers on the same weights.

A pooling request (`PoolingParams`, the server's /v1/embeddings) and prompt logprobs (`SamplingParams.
prompt_logprobs`, the server's `echo` with `logprobs`) both need the model's output at every position, not only
the last. The tiny random model (tests/conftest.py) is enough for the truth: the final hidden states and the
logits must equal HF's whatever the weights are. The prompts are longer than a step's token budget, so they are
computed in chunks, and the prefix cache holds them first, which such requests must not read.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from api_helpers import client, metrics, serve

from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
           "The capital of France is"]
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    # a budget of 16 tokens a step: the first prompt's prefill takes two chunks
    return LLMEngine(str(tiny_model_dir), max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=4,
                     max_num_batched_tokens=16, block_size=4)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)

    def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Final hidden states (T, D) (after the last norm: HF's hidden_states[-1]) and log-softmax (T, V)."""
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].double().numpy(), torch.log_softmax(out.logits[0].double(), -1).numpy()

    return run


def run_all(engine, requests: dict) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return finished


def expected_embedding(hidden: np.ndarray, pooling: PoolingParams) -> np.ndarray:
    vector = hidden.mean(axis=0) if pooling.pooling_type == "MEAN" else hidden[-1]
    return vector / np.linalg.norm(vector) if pooling.normalize else vector


def test_pooling_equals_hf_and_ignores_the_prefix_cache(engine, hf):
    run_all(engine, {"warm": (PROMPTS[0], SamplingParams(max_tokens=1))})  # its prompt's blocks are now cached
    poolings = [PoolingParams("MEAN"), PoolingParams("LAST"), PoolingParams("MEAN", normalize=False)]
    requests = {f"pool-{i}-{j}": (prompt, pooling) for i, prompt in enumerate(PROMPTS)
                for j, pooling in enumerate(poolings)}
    requests["beside"] = (PROMPTS[1], SamplingParams(max_tokens=4, temperature=0))  # a generation in the same steps
    outputs = run_all(engine, requests)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    for i, prompt in enumerate(PROMPTS):
        hidden, _ = hf(engine.tokenizer.encode(prompt))
        for j, pooling in enumerate(poolings):
            output = outputs[f"pool-{i}-{j}"]
            assert output.outputs == [] and output.num_cached_tokens == 0
            np.testing.assert_allclose(output.pooled, expected_embedding(hidden, pooling), rtol=1e-4, atol=1e-5)
    assert len(outputs["beside"].outputs[0].token_ids) == 4


def test_prompt_logprobs_equal_hf(engine, hf):
    ids = engine.tokenizer.encode(PROMPTS[0])
    output = run_all(engine, {"p": (ids, SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=1,
                                                        prompt_logprobs=3))})["p"]
    _, logprobs = hf(ids)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        logprob, top = output.prompt_logprobs[position]
        assert logprob == pytest.approx(logprobs[position - 1, ids[position]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-logprobs[position - 1], kind="stable")[:3])


@pytest.fixture(scope="module")
def server(engine, hf):
    with serve(lambda: engine, served_model_names=[MODEL]) as server:  # the engine moves to the server's thread
        yield server


def test_embeddings_through_the_openai_client(server, engine, hf):
    expected = [expected_embedding(hf(engine.tokenizer.encode(p))[0], PoolingParams()) for p in PROMPTS]
    response = client(server).embeddings.create(model=MODEL, input=PROMPTS)  # the client asks for base64
    assert [d.index for d in response.data] == [0, 1] and response.object == "list"
    for data, vector in zip(response.data, expected):
        np.testing.assert_allclose(data.embedding, vector, rtol=1e-4, atol=1e-5)
    assert response.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in PROMPTS)
    as_floats = client(server).embeddings.create(model=MODEL, input=engine.tokenizer.encode(PROMPTS[1]),
                                                 encoding_format="float")
    np.testing.assert_allclose(as_floats.data[0].embedding, expected[1], rtol=1e-4, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions") as e:
        client(server).embeddings.create(model=MODEL, input="Hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    floats = np.asarray(as_floats.data[0].embedding, dtype=np.float32)
    for dtype, endianness, numpy_type in [("float32", "big", ">f4"), ("float16", "little", "<f2"),
                                          ("float32", "native", "=f4")]:  # vLLM's embed_dtype and endianness
        body = httpx.post(f"{server.url}/v1/embeddings", json={
            "input": PROMPTS[1], "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}).json()
        got = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype=numpy_type)
        np.testing.assert_allclose(got, floats, rtol=1e-3 if dtype == "float16" else 1e-6, atol=1e-4)
    bf16 = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[1], "encoding_format": "base64",
                                                            "embed_dtype": "bfloat16", "endianness": "little"}).json()
    halves = np.frombuffer(base64.b64decode(bf16["data"][0]["embedding"]), dtype="<u2").astype(np.uint32) << 16
    np.testing.assert_allclose(halves.view(np.float32), floats, rtol=1 / 128, atol=1e-6)  # bfloat16: 8 bits kept
    ids = engine.tokenizer.encode(PROMPTS[1])
    cut = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[1], "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    np.testing.assert_allclose(cut["data"][0]["embedding"], expected_embedding(hf(ids[-3:])[0], PoolingParams()),
                               rtol=1e-4, atol=1e-5)
    conversation = [{"role": "user", "content": PROMPTS[1]}]
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=False),
                                       add_special_tokens=False)
    rendered = httpx.post(f"{server.url}/v1/embeddings", json={"messages": conversation, "encoding_format": "float"})
    assert rendered.json()["usage"]["prompt_tokens"] == len(chat_ids)  # vLLM's chat form: the template's tokens
    np.testing.assert_allclose(rendered.json()["data"][0]["embedding"],
                               expected_embedding(hf(chat_ids)[0], PoolingParams()), rtol=1e-4, atol=1e-5)
    both = httpx.post(f"{server.url}/v1/embeddings", json={"messages": conversation, "input": "x"})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    pooled = httpx.post(f"{server.url}/pooling", json={"input": PROMPTS[1], "encoding_format": "float"}).json()
    assert pooled["data"][0]["object"] == "pooling" and pooled["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(pooled["data"][0]["data"], expected[1], rtol=1e-4, atol=1e-5)
    samples = metrics(server)  # the real engine's step counts reach /metrics: every prompt token was computed
    assert samples["tinyvllm:iteration_tokens_total_sum"] >= response.usage.prompt_tokens
    assert samples["tinyvllm:num_preemptions_total"] == engine.scheduler.num_preemptions


def test_embeddings_as_bytes_with_their_metadata(server):
    import json

    floats = [np.asarray(httpx.post(f"{server.url}/v1/embeddings", json={"input": p}).json()["data"][0]["embedding"],
                         dtype=np.float32) for p in PROMPTS]
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS, "encoding_format": "bytes",
                                                              "embed_dtype": "float16", "endianness": "big"})
    assert answer.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(answer.headers["metadata"])  # vLLM's: where each vector lies in the body
    assert [item["index"] for item in metadata["data"]] == [0, 1] and metadata["usage"]["prompt_tokens"] > 0
    for item, expected in zip(metadata["data"], floats):
        assert item["shape"] == [len(expected)] and (item["embed_dtype"], item["endianness"]) == ("float16", "big")
        got = np.frombuffer(answer.content[item["start"]:item["end"]], dtype=">f2")
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    bare = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[0], "encoding_format": "bytes_only"})
    assert "metadata" not in bare.headers
    np.testing.assert_allclose(np.frombuffer(bare.content, dtype="=f4"), floats[0], rtol=1e-6, atol=1e-7)


def test_echo_with_logprobs_gives_the_prompt_logprobs(server, engine, hf):
    ids = engine.tokenizer.encode(PROMPTS[1])
    _, logprobs = hf(ids)
    response = client(server).completions.create(model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=2,
                                                  max_tokens=2, temperature=0)
    got = response.choices[0].logprobs
    assert response.choices[0].text.startswith(PROMPTS[1]) and len(got.tokens) == len(ids) + 2
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert got.token_logprobs[position] == pytest.approx(logprobs[position - 1, ids[position]], abs=1e-4)
        assert len(got.top_logprobs[position]) >= 2
    assert got.text_offset[len(ids)] == sum(len(t) for t in got.tokens[:len(ids)])  # the output starts after it


def test_prompt_logprobs_field_has_vllms_shape_and_hfs_values(server, engine, hf):
    """`prompt_logprobs` (vLLM's field): per prompt token {id: {logprob, rank, decoded_token}}, the prompt's token and
    the top alternatives, the same on a repeated prompt (whose blocks the prefix cache holds)."""
    import httpx

    ids = engine.tokenizer.encode(PROMPTS[0])
    _, logprobs = hf(ids)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    first, again = (httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json() for _ in range(2))
    got = first["choices"][0]["prompt_logprobs"]
    assert again["choices"][0]["prompt_logprobs"] == got and again["usage"]["prompt_tokens"] == len(ids)
    assert got[0] is None and len(got) == len(ids) and first["choices"][0]["logprobs"] is None
    for position in range(1, len(ids)):
        row = logprobs[position - 1]  # what the positions before predict here
        entries = {int(token): entry for token, entry in got[position].items()}
        top = [int(t) for t in np.argsort(-row, kind="stable")[:3]]
        assert list(entries)[0] == ids[position] and set(entries) == {ids[position], *top}
        for token, entry in entries.items():
            assert entry["logprob"] == pytest.approx(row[token], abs=1e-4)
            raw = engine.tokenizer.token_bytes(token)  # a token that is part of a character shows its bytes
            text = raw.decode("utf-8") if raw.isascii() else entry["decoded_token"]
            assert entry["decoded_token"] == text
            rank = 1 + int(np.sum(row > row[token] + 1e-6))
            assert entry["rank"] == (rank if rank <= 3 else None)
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 1, "prompt_logprobs": 0,
        "return_token_ids": True}).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # 0 alternatives: the prompt's token only


def test_responses_structured_output_follows_the_schema(server):
    # random weights know nothing of JSON: only the grammar from text.format makes the output parse
    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"enum": ["yes", "no"]}}}
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}}
    for stream in (False, True):
        response = client(server).responses.create(model=MODEL, input="Yes or no?", text=text, temperature=0,
                                                   max_output_tokens=40, stream=stream)
        if stream:
            response = list(response)[-1].response
        assert response.status == "completed", response.output_text
        assert json.loads(response.output_text)["answer"] in ("yes", "no")
