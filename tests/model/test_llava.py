"""LLaVA-1.5's vision tower, image processor and prompts on tinyvllm against HF's LlavaForConditionalGeneration,
CLIPImageProcessor (PIL backend) and LlavaProcessor (Phase 10)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tinygrad import dtypes

pytest.importorskip("transformers")
from llava_models import IMAGE_SIZE, IMAGE_TOKEN_ID, PATCH_SIZE, hf_model, hf_processor  # noqa: E402
from vision_models import encoded  # noqa: E402

from tinyvllm.engine.multimodal import expand_prompt  # noqa: E402
from tinyvllm.model.llava import ClipProcessorConfig, LlavaConfig, LlavaVisionTower, clip_process  # noqa: E402
from tinyvllm.model.llava import load_llava_tower  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.vision import load_vision_tower  # noqa: E402

# (width, height, mode, format): wide, tall, small (upscaled), square, transparent, grey, palette, big (downscaled)
IMAGES = [(70, 40, "RGB", "PNG"), (33, 100, "RGB", "JPEG"), (20, 12, "RGB", "PNG"), (96, 96, "RGB", "JPEG"),
          (50, 64, "RGBA", "PNG"), (81, 47, "L", "JPEG"), (45, 30, "P", "PNG"), (640, 427, "RGB", "JPEG")]


def config_json(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def hf_features(model_dir, pixels: np.ndarray, **kwargs) -> np.ndarray:
    import torch

    with torch.no_grad():  # all hidden states: HF's selection of layer 0 alone reads as "none"
        out = hf_model(model_dir).model.get_image_features(torch.from_numpy(pixels), output_hidden_states=True,
                                                           **kwargs)
    return torch.cat(list(out.pooler_output)).numpy()


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "full"), (1, "default"), (0, "full")])
def test_image_features_equal_hf(llava_dir, layer, strategy):
    cfg = {**config_json(llava_dir), "vision_feature_layer": layer, "vision_feature_select_strategy": strategy}
    tower = load_llava_tower(llava_dir, cfg, dtypes.float32, None)
    pixels = np.random.default_rng(0).standard_normal((3, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    ours = tower.encode(pixels)
    theirs = hf_features(llava_dir, pixels, vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    assert ours.shape == theirs.shape == (3 * tower.config.tokens_per_frame, 64)
    assert tower.config.tokens_per_frame == (IMAGE_SIZE // PATCH_SIZE) ** 2 + (strategy == "full")
    assert np.abs(theirs).mean() > 0.1  # features of unit scale, not near zero
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_older_checkpoints_vision_model_names_load(llava_dir, tmp_path):
    """Checkpoints saved before transformers 5 name CLIP's tensors vision_tower.vision_model.*."""
    from tinyvllm.model.weights_hf import read_safetensors, save_safetensors

    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(llava_dir / name, tmp_path / name)
    tensors = read_safetensors(llava_dir / "model.safetensors")
    renamed = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in tensors.items()}
    save_safetensors(renamed, tmp_path / "model.safetensors")
    pixels = np.random.default_rng(1).standard_normal((1, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    np.testing.assert_allclose(load_vision_tower(tmp_path).encode(pixels), hf_features(llava_dir, pixels),
                               atol=1e-4, rtol=0)


def test_text_model_loads_from_the_llava_checkpoint(llava_dir):
    from tinyvllm.model.weights_hf import load_hf

    config, state_dict = load_hf(llava_dir)
    assert config.hidden_size == 64 and config.vocab_size == 49216 and not config.tie_word_embeddings
    assert not any("vision" in n or "projector" in n for n in state_dict)
    hf = hf_model(llava_dir)
    np.testing.assert_array_equal(state_dict["lm_head.weight"], hf.lm_head.weight.detach().numpy())
    np.testing.assert_array_equal(state_dict["model.layers.1.mlp.up_proj.weight"],
                                  hf.model.language_model.layers[1].mlp.up_proj.weight.detach().numpy())


@pytest.mark.parametrize("width,height,mode,fmt", IMAGES)
def test_pixels_equal_hf(llava_dir, width, height, mode, fmt):
    image = encoded(width, height, mode, fmt)
    theirs = np.asarray(hf_processor(llava_dir).image_processor(images=[image])["pixel_values"])
    ours = load_vision_tower(llava_dir).preprocess(image)
    assert ours.shape == theirs.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("width,height", [(640, 480), (300, 500), (200, 120)])
def test_pixels_equal_hf_at_llava_1_5_sizes(width, height):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image = encoded(width, height, "RGB", "JPEG")
    theirs = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})(image)
    ours = clip_process(image, ClipProcessorConfig())  # LLaVA-1.5's: 336 pixels, OpenAI CLIP's mean and std
    np.testing.assert_allclose(ours, np.asarray(theirs["pixel_values"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt,sizes", [
    ("USER: <image>\nWhat is in this image? ASSISTANT:", [(70, 40)]),
    ("Compare <image> with <image>, please.", [(20, 12), (33, 100)]),
    ("<image>", [(16, 16)]),
])
def test_prompt_token_ids_equal_hf(llava_dir, prompt, sizes):
    images = [encoded(w, h, "RGB", "PNG", seed=i) for i, (w, h) in enumerate(sizes)]
    theirs = hf_processor(llava_dir)(text=prompt, images=images)["input_ids"][0]
    tower = load_vision_tower(llava_dir)
    text = expand_prompt(prompt, tower.placeholder, [tower.image_text(image) for image in images])
    ours = load_tokenizer(llava_dir).encode(text)
    assert ours == list(theirs)
    assert ours.count(IMAGE_TOKEN_ID) == len(images) * (IMAGE_SIZE // PATCH_SIZE) ** 2 == len(images) * 64


@pytest.mark.parametrize("change,error", [
    ({"vision_config": {"hidden_act": "gelu_new"}}, "vision hidden_act 'gelu_new'.*quick_gelu or gelu"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'.*gelu"),
    ({"vision_feature_select_strategy": "cls"}, "'default' and 'full'"),
    ({"vision_feature_layer": [-2, -1]}, "one hidden state's index"),
    ({"vision_feature_layer": -5}, "-4 to 3"),
    ({"multimodal_projector_bias": False}, "biases"),
])
def test_unsupported_configs_are_refused_by_name(llava_dir, change, error):
    cfg = config_json(llava_dir)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=error):
        LlavaConfig.from_hf_config(cfg)


def test_a_processor_that_does_not_fit_the_tower_is_refused(llava_dir, tmp_path):
    config = LlavaConfig.from_hf_config(config_json(llava_dir))
    with pytest.raises(ValueError, match="crop_size .* is not the vision tower's image_size 32"):
        LlavaVisionTower(config, {}, processor=ClipProcessorConfig(shortest_edge=64, crop_size=(48, 48)))
    for size, error in [({"size": {"height": 32, "width": 32}}, "takes shortest_edge"),
                        ({"size": {"shortest_edge": 24}}, "shortest_edge 24 is smaller than crop_size"),
                        ({"do_center_crop": False}, "do_center_crop false is not supported")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({"crop_size": {"height": 32, "width": 32},
                                                                       **size}))
        with pytest.raises(ValueError, match=error):
            ClipProcessorConfig.from_dir(tmp_path)


def test_frames_of_the_wrong_size_are_refused(llava_dir):
    with pytest.raises(ValueError, match="pixel values must be"):
        load_vision_tower(llava_dir).encode(np.zeros((1, 3, IMAGE_SIZE + 4, IMAGE_SIZE), np.float32))
