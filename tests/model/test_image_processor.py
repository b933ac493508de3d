"""Images to frames and prompts to token ids, against HF's Idefics3 processor (PIL backend) as the oracle (Phase 10)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
from vision_models import IMAGE_TOKEN_ID, encoded, hf_processor  # noqa: E402

from tinyvllm.engine.multimodal import expand_prompt  # noqa: E402
from tinyvllm.model.image_processor import ImageProcessorConfig, image_prompt, process_image  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.vision import VisionConfig  # noqa: E402

# (width, height, mode, format): wide, tall, small (upscaled), square, transparent, grey, palette
IMAGES = [(70, 40, "RGB", "PNG"), (33, 100, "RGB", "JPEG"), (20, 12, "RGB", "PNG"), (96, 96, "RGB", "JPEG"),
          (50, 64, "RGBA", "PNG"), (81, 47, "L", "JPEG"), (45, 30, "P", "PNG")]


@pytest.mark.parametrize("splitting", [True, False])
@pytest.mark.parametrize("width,height,mode,fmt", IMAGES)
def test_frames_equal_hf(idefics3_dir, width, height, mode, fmt, splitting):
    image = encoded(width, height, mode, fmt)
    hf = hf_processor(idefics3_dir).image_processor
    theirs = hf(images=[image], do_image_splitting=splitting, return_row_col_info=True)
    config = ImageProcessorConfig.from_dir(idefics3_dir)
    ours = process_image(image, ImageProcessorConfig(**{**config.__dict__, "do_image_splitting": splitting}))
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ours.pixel_values.shape == np.asarray(theirs["pixel_values"][0]).shape
    np.testing.assert_allclose(ours.pixel_values, np.asarray(theirs["pixel_values"][0]), atol=1e-5, rtol=0)


def test_a_big_image_is_split_into_tiles_and_a_global_frame(idefics3_dir):
    ours = process_image(encoded(300, 200, "RGB", "PNG"), ImageProcessorConfig.from_dir(idefics3_dir))
    assert (ours.rows, ours.cols) == (2, 3) and ours.pixel_values.shape == (7, 3, 32, 32)


@pytest.mark.parametrize("prompt,sizes", [
    ("<image>What is in this image?", [(70, 40)]),
    ("Compare <image> with <image>, please.", [(20, 12), (33, 100)]),
    ("A small one:<image>", [(16, 16)]),
])
def test_prompt_token_ids_equal_hf(idefics3_dir, prompt, sizes):
    images = [encoded(w, h, "RGB", "PNG", seed=i) for i, (w, h) in enumerate(sizes)]
    theirs = hf_processor(idefics3_dir)(text=prompt, images=images)["input_ids"][0]
    config = ImageProcessorConfig.from_dir(idefics3_dir)
    vision = VisionConfig.from_hf_config(__import__("json").loads((idefics3_dir / "config.json").read_text()))
    processed = [process_image(im, config) for im in images]
    texts = [image_prompt(p.rows, p.cols, vision.tokens_per_frame) for p in processed]
    text = expand_prompt(prompt, "<image>", texts)
    ours = load_tokenizer(idefics3_dir).encode(text)
    assert ours == list(theirs)
    assert ours.count(IMAGE_TOKEN_ID) == sum(len(process_image(im, config).pixel_values) for im in images) * 4


def test_placeholders_and_images_must_match(idefics3_dir):
    with pytest.raises(ValueError, match="1 <image> placeholder.*2 image"):
        expand_prompt("<image> and", "<image>", ["a", "b"])
