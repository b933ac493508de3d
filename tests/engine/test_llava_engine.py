"""Images in, text out with a LLaVA-1.5 checkpoint: prompts with images through the one engine, against HF's
LlavaForConditionalGeneration `generate` (Phase 10)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from llava_models import IMAGE_TOKEN_ID, hf_model, hf_processor  # noqa: E402
from vision_models import assert_greedy_equal_hf, assert_top20_equal_hf, hf_image_inputs, image_request  # noqa: E402

from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.model.llava import LlavaVisionTower  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)
MAX_NUM_BATCHED_TOKENS = 32  # fewer than an image's 64 tokens: each image is split across prefill chunks
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


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_equal_hf(llm, llava_dir, name):
    (out,) = llm.generate(image_request(*PROMPTS[name]), GREEDY, use_tqdm=False)
    assert_greedy_equal_hf(out, hf_model(llava_dir), hf_image_inputs(hf_processor(llava_dir), *PROMPTS[name]),
                           GREEDY.max_tokens)
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == 64 * len(PROMPTS[name][1])


@pytest.mark.parametrize("name", PROMPTS)
def test_top20_logprobs_equal_hf(llm, llava_dir, name):
    (out,) = llm.generate(image_request(*PROMPTS[name]), SamplingParams(max_tokens=1, temperature=0, logprobs=20),
                          use_tqdm=False)
    assert_top20_equal_hf(out, hf_model(llava_dir), hf_image_inputs(hf_processor(llava_dir), *PROMPTS[name]))
