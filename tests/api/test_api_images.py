"""Chat `image_url` parts on the server (Phase 10): data URLs served as the offline engine answers them, bad or
disallowed images a 400 that names the fault."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

pytest.importorskip("transformers")
from api_helpers import client, serve  # noqa: E402
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

    return LLMEngine(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=128)


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
    with serve(lambda: engine, media=MediaConnector(allowed_local_media_path=str(media))) as server:
        server.media = media
        yield server


def chat(server, content: list) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                      json={"model": server.async_engine.model_name, "messages": [{"role": "user", "content": content}],
                            "temperature": 0, "max_tokens": GREEDY.max_tokens})


def test_a_data_url_image_is_answered_as_offline(server, offline):
    image, expected = offline
    reply = client(server).chat.completions.create(
        model=server.async_engine.model_name, temperature=0, max_tokens=GREEDY.max_tokens,
        messages=[{"role": "user", "content": [image_part(data_url(image)), {"type": "text", "text": "What is this?"}]}])
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


def test_a_text_model_refuses_image_parts(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    with serve(lambda: LLMEngine(str(tiny_model_dir), max_model_len=128, kv_cache_memory="4MiB")) as server:
        reply = chat(server, [image_part(data_url(draw_image(20, 20)))])
    assert reply.status_code == 400 and "this model takes no images" in reply.json()["error"]["message"]
