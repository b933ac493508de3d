"""Images in, text out with a LLaVA-1.5 checkpoint: prompts with images through the one engine, against HF's
LlavaForConditionalGeneration `generate` (Phase 10)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from llava_models import IMAGE_TOKEN_ID, hf_model, hf_processor  # noqa: E402
from vision_models import assert_top20_equal_hf, draw_image  # noqa: E402

from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.model.llava import LlavaVisionTower  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)
MAX_NUM_BATCHED_TOKENS = 32  # fewer than an image's 64 tokens: each image is split across prefill chunks
IMAGES = {"wide": draw_image(70, 40, seed=1), "tall": draw_image(30, 50, seed=2), "small": draw_image(20, 20, seed=3)}
PROMPTS = {
    "one image": ("USER: <image>\nWhat is in this image? ASSISTANT:", ["wide"]),
    "two images": ("Compare <image> with <image>: which one is brighter?", ["tall", "small"]),
    "text only": ("The capital of France is", []),
}


@pytest.fixture(scope="module")
def llm(llava_dir):
    llm = LLM(str(llava_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    tower = llm.llm_engine.model.vision_tower
    assert isinstance(tower, LlavaVisionTower) and tower.max_embeds_per_image > MAX_NUM_BATCHED_TOKENS
    return llm


def request(name: str) -> dict | str:
    text, images = PROMPTS[name]
    return {"prompt": text, "multi_modal_data": {"image": [IMAGES[i] for i in images]}} if images else text


def hf_inputs(model_dir, name: str):
    text, images = PROMPTS[name]
    return hf_processor(model_dir)(text=text, images=[IMAGES[i] for i in images] or None, return_tensors="pt")


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_equal_hf(llm, llava_dir, name):
    import torch

    (out,) = llm.generate(request(name), GREEDY, use_tqdm=False)
    inputs = hf_inputs(llava_dir, name)
    with torch.no_grad():
        tokens = hf_model(llava_dir).generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == tokens[0, len(prompt_ids):].tolist()
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == 64 * len(PROMPTS[name][1])


@pytest.mark.parametrize("name", PROMPTS)
def test_top20_logprobs_equal_hf(llm, llava_dir, name):
    (out,) = llm.generate(request(name), SamplingParams(max_tokens=1, temperature=0, logprobs=20), use_tqdm=False)
    assert_top20_equal_hf(out, hf_model(llava_dir), hf_inputs(llava_dir, name))
