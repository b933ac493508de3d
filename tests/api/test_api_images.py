"""Chat `image_url` parts on the server (Phase 10): data URLs served as the offline engine answers them, bad or
disallowed images a 400 that names the fault."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("transformers")
from api_helpers import client, serve, sse_events, wait_for  # noqa: E402
from vision_models import draw_image  # noqa: E402

from tinyvllm.engine.multimodal import MediaConnector  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def engine(idefics3_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    return LLMEngine(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=128,
                     limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def offline(engine):
    """The greedy answer to the chat prompt, rendered as the chat route renders it, with its image, offline."""
    image = draw_image(50, 40, seed=3)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "<image>What is this?"}])
    engine.add_request("offline", {"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return image, outputs[-1]


@pytest.fixture(scope="module")
def server(engine, offline, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    draw_image(50, 40, seed=3).save(media / "a.png")
    with serve(lambda: engine, media=MediaConnector(allowed_local_media_path=str(media)),
               enable_prompt_tokens_details=True) as server:
        server.media = media
        yield server


def chat(server, content: list, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"model": server.async_engine.model_name, "messages": [{"role": "user", "content": content}],
                            "temperature": 0, "max_tokens": GREEDY.max_tokens, **fields})


def encoded(image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def b64(raw: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(raw).decode()


def test_a_data_url_image_is_answered_as_offline(server, offline):
    image, expected = offline
    reply = client(server).chat.completions.create(
        model=server.async_engine.model_name, temperature=0, max_tokens=GREEDY.max_tokens,
        messages=[{"role": "user", "content": [image_part(data_url(image)),
                                               {"type": "text", "text": "What is this?"}]}])
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_a_local_file_under_the_allowed_path_is_read(server, offline):
    reply = chat(server, [image_part(f"file://{server.media}/a.png"), {"type": "text", "text": "What is this?"}])
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == offline[1].outputs[0].text


@pytest.mark.parametrize("url,error", [
    ("https://example.com/cat.png", "--allow-remote-media"),
    ("file:///etc/hostname", "--allowed-local-media-path"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not a png").decode(), "cannot be decoded"),
    ("data:image/png;base64,@@@", "base64 cannot be decoded"),
])
def test_bad_or_disallowed_images_are_a_400(server, url, error):
    reply = chat(server, [image_part(url), {"type": "text", "text": "What is this?"}])
    assert reply.status_code == 400 and error in reply.json()["error"]["message"]
    assert "messages[0].content[0].image_url" in reply.json()["error"]["message"]


def test_an_unsupported_format_and_a_missing_url_are_a_400(server):
    reply = chat(server, [image_part(data_url(draw_image(20, 20), "TIFF"))])
    assert reply.status_code == 400 and "TIFF images are not supported" in reply.json()["error"]["message"]
    reply = chat(server, [{"type": "image_url", "image_url": "data:image/png;base64,"}])
    assert reply.status_code == 400 and "image_url must be" in reply.json()["error"]["message"]


BAD_IMAGES = {  # what each bad image is, and the words of its 400
    "truncated bytes": (lambda: b64(encoded(draw_image(40, 30), "PNG")[:200]), "cannot be decoded"),
    "a 1x1 image": (lambda: data_url(draw_image(1, 1)), "1 x 1 pixels: each edge must be 2 to 8192"),
    "a 20,000 px image": (lambda: data_url(draw_image(20000, 2)), "20000 x 2 pixels: each edge must be 2 to 8192"),
    "a GIF": (lambda: b64(encoded(draw_image(20, 20), "GIF"), "gif"), "GIF images are not supported: send PNG, JPEG"),
    "a file outside the allowed path": (lambda: "file:///etc/hostname", "--allowed-local-media-path"),
}


def test_named_bad_images_are_a_400_and_other_streams_go_on(server, offline):
    image, expected = offline
    good = [image_part(data_url(image)), {"type": "text", "text": "What is this?"}]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": server.async_engine.model_name, "messages": [{"role": "user", "content": good}],
            "temperature": 0, "max_tokens": GREEDY.max_tokens, "stream": True}) as stream:
        for name, (url, error) in BAD_IMAGES.items():
            reply = chat(server, [{"type": "text", "text": "Look: "}, image_part(url())])
            assert reply.status_code == 400, name
            message = reply.json()["error"]["message"]
            assert error in message and "messages[0].content[1].image_url" in message, (name, message)
        reply = chat(server, [image_part(data_url(image))] * 3)
        assert reply.status_code == 400
        assert "At most 2 image(s) may be provided in one prompt" in reply.json()["error"]["message"]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in sse_events(stream)
                       if e != "[DONE]" and json.loads(e)["choices"])
    assert text == expected.outputs[0].text
    blocks = server.async_engine.engine.scheduler.block_manager
    wait_for(lambda: blocks.num_free_blocks == blocks.num_blocks, what="every KV block back in the pool")


def test_sixteen_concurrent_mixed_requests_each_answer_as_alone(server):
    images = [draw_image(30 + 7 * i, 60 - 5 * i, seed=20 + i) for i in range(8)]
    contents = [[image_part(data_url(im)), {"type": "text", "text": f"Picture {i}?"}] for i, im in enumerate(images)]
    contents += [[{"type": "text", "text": f"Tell me about the number {i}."}] for i in range(8)]
    alone = [chat(server, c).json()["choices"][0]["message"]["content"] for c in contents]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda c: chat(server, c), contents))
    assert [r.status_code for r in together] == [200] * 16
    assert [r.json()["choices"][0]["message"]["content"] for r in together] == alone


def test_a_repeated_image_hits_the_encoder_cache_and_the_prefix_cache(server):
    image = draw_image(45, 45, seed=30)
    engine = server.async_engine.engine
    runs = engine.model_runner.encoder.num_encoder_runs
    first = chat(server, [image_part(data_url(image)), {"type": "text", "text": "Again?"}]).json()
    second = chat(server, [image_part(data_url(image)), {"type": "text", "text": "Again?"}]).json()
    assert engine.model_runner.encoder.num_encoder_runs == runs + 1
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
    assert cached[0] <= 16 < cached[1]  # the first shares the template's opening at most; the second the image too
    assert cached[1] >= second["usage"]["prompt_tokens"] - 16
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_the_responses_api_takes_input_image(server, offline):
    image, expected = offline
    reply = client(server).responses.create(
        model=server.async_engine.model_name, temperature=0, max_output_tokens=GREEDY.max_tokens,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": "What is this?"}]}])
    assert reply.output_text == expected.outputs[0].text
    assert reply.usage.input_tokens == len(expected.prompt_token_ids)
    bad = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": server.async_engine.model_name, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}]})
    assert bad.status_code == 400 and "input_image takes image_url" in bad.json()["error"]["message"]


def test_a_text_model_refuses_image_parts(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    with serve(lambda: LLMEngine(str(tiny_model_dir), max_model_len=128, kv_cache_memory="4MiB")) as server:
        reply = chat(server, [image_part(data_url(draw_image(20, 20)))])
    assert reply.status_code == 400 and "this model takes no images" in reply.json()["error"]["message"]


def test_a_gemma3_image_over_the_server_is_answered_as_offline(gemma3_dir):
    """Gemma 3's images (attending both ways, never split across steps) through an openai client: the offline
    engine's answer and prompt, the placeholder being Gemma 3's `<start_of_image>`."""
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(gemma3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=32,
                       max_num_seqs=4)
    image = draw_image(50, 40, seed=3)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "<start_of_image>What is this?"}])
    engine.add_request("offline", {"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    expected = outputs[-1]
    with serve(lambda: engine) as server:
        reply = client(server).chat.completions.create(
            model=server.async_engine.model_name, temperature=0, max_tokens=GREEDY.max_tokens,
            messages=[{"role": "user", "content": [image_part(data_url(image)),
                                                   {"type": "text", "text": "What is this?"}]}])
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) > 16  # the image's 16 soft tokens and the text
