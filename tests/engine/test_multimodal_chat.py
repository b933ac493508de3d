"""`LLM.chat` with images (vLLM's offline chat), through a template that loops over content parts as SmolVLM's
does, against HF's Idefics3Processor rendering the same template (Phase 10)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("transformers")
from vision_models import IMAGE_TOKEN_ID, draw_image, hf_model, hf_processor  # noqa: E402

from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0)
# SmolVLM-Instruct's chat template: each message's content is a list of parts, an image part writes <image>
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IMAGE = draw_image(60, 45, seed=4)


@pytest.fixture(scope="module")
def smolvlm_dir(idefics3_dir, tmp_path_factory):
    """The tiny Idefics3 with SmolVLM's chat template."""
    out = tmp_path_factory.mktemp("tiny-smolvlm")
    for path in idefics3_dir.iterdir():
        (out / path.name).symlink_to(path)
    (out / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def llm(smolvlm_dir):
    return LLM(str(smolvlm_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=64,
               limit_mm_per_prompt={"image": 2})


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def hf_chat(model_dir, messages: list[dict], images: list) -> tuple[list[int], list[int]]:
    """HF's (prompt token ids, greedy tokens) for the conversation, rendered by the same template."""
    import torch

    processor = hf_processor(model_dir)
    processor.chat_template = SMOLVLM_TEMPLATE
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf_model(model_dir).generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


def test_chat_with_an_image_equals_hf(llm, smolvlm_dir):
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ids, tokens = hf_chat(smolvlm_dir, hf_messages, [IMAGE])
    ours = [{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGE},
                                         {"type": "text", "text": "What is this?"}]}]
    (out,) = llm.chat(ours, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids and IMAGE_TOKEN_ID in ids
    assert out.outputs[0].token_ids == tokens
    by_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                           {"type": "text", "text": "What is this?"}]}]
    assert llm.chat(by_url, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_chat_with_text_only_and_string_content_equals_hf(llm, smolvlm_dir):
    ids, tokens = hf_chat(smolvlm_dir, [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}], [])
    (out,) = llm.chat([{"role": "user", "content": "Hello there"}], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens


def test_a_list_of_conversations_answers_each(llm):
    one = [{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGE}, {"type": "text", "text": "Hm?"}]}]
    two = [{"role": "user", "content": "Hello there"}]
    both = llm.chat([one, two], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in both] == [llm.chat(c, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                                                      for c in (one, two)]


def test_bad_images_in_chat_are_refused_by_name(llm):
    def ask(*parts):
        return llm.chat([{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], use_tqdm=False)

    image = {"type": "image_pil", "image_pil": IMAGE}
    with pytest.raises(ValueError, match=r"At most 2 image\(s\) may be provided in one prompt.*limit-mm-per-prompt"):
        ask(image, image, image)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].image_pil.*1 x 1 pixels: each edge must be"):
        ask({"type": "image_pil", "image_pil": draw_image(1, 1)})
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].image_pil must be a PIL.Image"):
        ask({"type": "image_pil", "image_pil": "cat.png"})
    with pytest.raises(ValueError, match=r"only text and image_url and image_pil content parts"):
        ask({"type": "video_url", "video_url": {"url": "x"}})
    assert not llm.llm_engine.has_unfinished_requests()


def test_main_takes_images_as_llama_cpps_mtmd_cli_does(idefics3_dir, tiny_model_dir, tmp_path, capsys):
    from tinyvllm.cli import generate_main

    IMAGE.save(tmp_path / "a.png")
    flags = ["--model", str(idefics3_dir), "--max-tokens", "6", "--temperature", "0", "--max-model-len", "512",
             "--kv-cache-memory", "8MiB"]
    assert generate_main([*flags, "--prompt", "What is this?", "--image", str(tmp_path / "a.png")]) == 0
    printed = capsys.readouterr().out
    llm = LLM(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB")
    (out,) = llm.generate({"prompt": "<image>What is this?", "multi_modal_data": {"image": IMAGE}},
                          SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert printed == out.outputs[0].text + "\n"  # the image before a prompt without <image>
    (tmp_path / "b.gif").write_bytes(b"GIF89a not really")
    assert generate_main([*flags, "--prompt", "?", "--image", str(tmp_path / "b.gif")]) == 1
    assert "--image" in capsys.readouterr().err
    assert generate_main(["--model", str(tiny_model_dir), "--prompt", "?", "--image", str(tmp_path / "a.png"),
                          "--max-model-len", "128", "--kv-cache-memory", "4MiB"]) == 1
    assert "this model takes no images" in capsys.readouterr().err
