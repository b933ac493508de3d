"""Images in, text out with a Gemma 3 checkpoint: an image's tokens attend to each other both ways (a prefix LM over
its images, vLLM's `is_mm_prefix_lm`), against HF's Gemma3ForConditionalGeneration `generate` (Phase 10)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
from gemma3_models import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, hf_model, hf_processor  # noqa: E402
from vision_models import (assert_greedy_equal_hf, assert_top20_equal_hf, draw_image, hf_image_inputs,  # noqa: E402
                           image_request)

from tinyvllm.core.encoder_cache import MultiModalFeature  # noqa: E402
from tinyvllm.llm import LLM  # noqa: E402
from tinyvllm.model.gemma3_vision import Gemma3VisionTower  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)
MAX_NUM_BATCHED_TOKENS = 24  # an image (16 tokens) fits; a prompt does not: chunks end before an image
PROMPTS = {  # the text model's sliding window is 8 tokens: an image's 16 tokens see past it
    "one image": ("Look at this picture closely: <start_of_image> What is in it?", ["wide"]),
    "two images": ("Compare <start_of_image> with <start_of_image>: which one is brighter?", ["tall", "small"]),
    "text only": ("The capital of France is", []),
}


@pytest.fixture(scope="module")
def llm(gemma3_dir):
    llm = LLM(str(gemma3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_num_seqs=4)
    tower = llm.llm_engine.model.vision_tower
    assert isinstance(tower, Gemma3VisionTower) and tower.is_mm_prefix_lm
    return llm


def request(name: str) -> dict | str:
    return image_request(*PROMPTS[name])


def hf_inputs(model_dir, name: str):
    """HF's processor's tensors, token_type_ids included: HF's Gemma 3 attends both ways within an image from them."""
    return hf_image_inputs(hf_processor(model_dir), *PROMPTS[name])


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_equal_hf(llm, gemma3_dir, name):
    (out,) = llm.generate(request(name), GREEDY, use_tqdm=False)
    assert_greedy_equal_hf(out, hf_model(gemma3_dir), hf_inputs(gemma3_dir, name), GREEDY.max_tokens)
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE * len(PROMPTS[name][1])


@pytest.mark.parametrize("name", PROMPTS)
def test_top20_logprobs_equal_hf(llm, gemma3_dir, name):
    (out,) = llm.generate(request(name), SamplingParams(max_tokens=1, temperature=0, logprobs=20), use_tqdm=False)
    assert_top20_equal_hf(out, hf_model(gemma3_dir), hf_inputs(gemma3_dir, name))


def test_images_on_the_discrete_gpus_path_and_beside_text_give_the_same_tokens(llm, gemma3_dir, monkeypatch):
    """The discrete GPU's path (tests/test_device_path.py): staged inputs, graphs replayed by tinygrad's TinyJit, the
    image rows' context lengths an input like the others; and all three prompts in one batch, each its solo tokens."""
    from tinyvllm import platforms

    prompts = [request(name) for name in PROMPTS]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == want
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    gpu = LLM(str(gemma3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_num_seqs=4)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_attending_causally_within_the_image_would_differ_from_hf(llm, gemma3_dir):
    """The test above can fail: HF with a causal mask over the image (no token_type_ids) gives other logits."""
    import torch

    inputs = hf_inputs(gemma3_dir, "one image")
    with torch.no_grad():
        model = hf_model(gemma3_dir)
        both_ways = model(**inputs).logits[0, -1]
        causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0, -1]
    assert (both_ways - causal).abs().max() > 1e-3


def test_a_step_never_ends_inside_an_image():
    from tinyvllm.core.outputs import ModelRunnerOutput
    from tinyvllm.core.scheduler import Scheduler
    from tinyvllm.core.sequence import Sequence

    scheduler = Scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=20,
                          encoder_cache_size=20, disable_chunked_mm_input=True)
    image = MultiModalFeature("x", 10, np.ones(16, bool), np.zeros(1))
    scheduler.add_seq(Sequence("a", list(range(40)), SamplingParams(max_tokens=1), mm_features=[image]))
    steps = []
    while scheduler.has_unfinished_seqs():
        out = scheduler.schedule()
        steps.append(out.num_scheduled_tokens.get("a", 0))
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [5]} if sum(steps) >= 40 else {}))
    assert steps[:3] == [10, 20, 10]  # up to the image, the image and 4 tokens after it, the rest


def test_a_token_budget_smaller_than_an_image_is_refused(gemma3_dir):
    with pytest.raises(ValueError, match=r"max_tokens_per_mm_item \(16\) is larger than max_num_batched_tokens \(8\)"):
        LLM(str(gemma3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=8, max_num_seqs=4)


def test_disable_chunked_mm_input_keeps_any_models_images_whole(idefics3_dir):
    """vLLM's flag, for a model that attends causally too: `--disable-chunked-mm-input` reaches the scheduler, which
    then ends each step before an image it cannot finish (Idefics3's 64-token frames after ~70 tokens of text, a
    96-token budget)."""
    import argparse

    from tinyvllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--disable-chunked-mm-input", "--max-num-batched-tokens", "96", "--max-num-seqs", "4"])
    assert EngineArgs.from_cli_args(args).create_engine_config().scheduler_config.disable_chunked_mm_input
    llm = LLM(str(idefics3_dir), max_model_len=512, kv_cache_memory="8MiB", max_num_batched_tokens=96,
              max_num_seqs=4, disable_chunked_mm_input=True)
    scheduler, chunks = llm.llm_engine.engine_core.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend((seq.num_computed_tokens, out.num_scheduled_tokens[seq.seq_id], seq.mm_features)
                      for seq in out.scheduled_seqs if seq.mm_features)
        return out

    scheduler.schedule = recording
    text = "Here is a picture that was taken on a long walk through the hills last summer, " * 4
    image = {"prompt": text + "<image> Describe it.", "multi_modal_data": {"image": draw_image(40, 40, seed=5)}}
    (out,) = llm.generate(image, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens and chunks[0][1] < 96  # the first chunk cut short
    for start, count, features in chunks:  # each prompt chunk ends outside every image
        assert not any(f.offset < start + count < f.offset + f.length for f in features), (start, count)
