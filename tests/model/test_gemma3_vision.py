"""Gemma 3's vision tower, image processor and prompts on tinyvllm against HF's Gemma3ForConditionalGeneration,
Gemma3ImageProcessor (PIL backend) and Gemma3Processor (Phase 10)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
from gemma3_models import IMAGE_SIZE, IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, hf_model, hf_processor  # noqa: E402
from vision_models import encoded  # noqa: E402

from tinyvllm.engine.multimodal import expand_prompt  # noqa: E402
from tinyvllm.model.gemma3_vision import Gemma3ProcessorConfig, Gemma3VisionConfig, Gemma3VisionTower  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.vision import load_vision_tower  # noqa: E402

# (width, height, mode, format): wide, tall, small (upscaled), square, transparent, grey, palette, big (downscaled)
IMAGES = [(70, 40, "RGB", "PNG"), (33, 100, "RGB", "JPEG"), (20, 12, "RGB", "PNG"), (64, 64, "RGB", "JPEG"),
          (50, 64, "RGBA", "PNG"), (81, 47, "L", "JPEG"), (45, 30, "P", "PNG"), (640, 427, "RGB", "JPEG")]


def config_json(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def hf_features(model_dir, pixels: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = hf_model(model_dir).model.get_image_features(torch.from_numpy(pixels))
    return out.pooler_output.reshape(-1, out.pooler_output.shape[-1]).numpy()


def test_image_features_equal_hf(gemma3_dir):
    tower = load_vision_tower(gemma3_dir)
    assert isinstance(tower, Gemma3VisionTower) and tower.config.pool_kernel == 2
    pixels = np.random.default_rng(0).standard_normal((3, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    ours, theirs = tower.encode(pixels), hf_features(gemma3_dir, pixels)
    assert ours.shape == theirs.shape == (3 * TOKENS_PER_IMAGE, 64)
    assert np.abs(theirs).mean() > 0.1  # features of unit scale, not near zero
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefixes", [
    ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."),
    ("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.")])
def test_other_checkpoint_names_load(gemma3_dir, tmp_path, prefixes):
    """transformers' own module names (model.*), and Google's checkpoints' (vision_tower.vision_model.*)."""
    from tinyvllm.model.weights_hf import load_hf, read_safetensors, save_safetensors

    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(gemma3_dir / name, tmp_path / name)
    olds = ("vision_tower.", "multi_modal_projector.", "language_model.model.")
    tensors = read_safetensors(gemma3_dir / "model.safetensors")
    renamed = {next(new + n.removeprefix(old) for old, new in zip(olds, prefixes) if n.startswith(old)): t
               for n, t in tensors.items()}
    save_safetensors(renamed, tmp_path / "model.safetensors")
    pixels = np.random.default_rng(1).standard_normal((1, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    np.testing.assert_allclose(load_vision_tower(tmp_path).encode(pixels), hf_features(gemma3_dir, pixels),
                               atol=1e-4, rtol=0)
    assert load_hf(tmp_path)[1].keys() == load_hf(gemma3_dir)[1].keys()


def test_text_model_loads_from_the_gemma3_checkpoint(gemma3_dir):
    from tinyvllm.model.weights_hf import load_hf

    config, state_dict = load_hf(gemma3_dir)
    assert config.architecture == "Gemma3ForCausalLM" and config.scale_embeddings and config.tie_word_embeddings
    assert config.layer_types == ("sliding_attention", "full_attention") and config.sliding_window == 8
    assert not any("vision" in n or "projector" in n for n in state_dict)
    hf = hf_model(gemma3_dir).model.language_model
    np.testing.assert_array_equal(state_dict["model.embed_tokens.weight"], hf.embed_tokens.weight.detach().numpy())
    np.testing.assert_array_equal(state_dict["model.layers.1.mlp.up_proj.weight"],
                                  hf.layers[1].mlp.up_proj.weight.detach().numpy())
    np.testing.assert_allclose(state_dict["model.layers.0.post_feedforward_layernorm.weight"],
                               1 + hf.layers[0].post_feedforward_layernorm.weight.detach().numpy())


def test_a_text_config_that_leaves_keys_out_takes_gemma3s_defaults(gemma3_dir):
    """Google's Gemma 3 configs name a few text keys only; the rest are Gemma3TextConfig's defaults."""
    from transformers import Gemma3TextConfig

    from tinyvllm.model.config import ModelConfig
    from tinyvllm.model.weights_hf import text_config

    cfg = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                   "model_type": "gemma3_text", "num_hidden_layers": 34,
                                                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                                   "sliding_window": 1024}}
    ours = ModelConfig.from_hf_config(text_config(cfg)[0])
    theirs = Gemma3TextConfig(**cfg["text_config"])
    assert (ours.vocab_size, ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar and ours.tie_word_embeddings
    assert (ours.rope_theta, ours.rope_local_theta) == (theirs.rope_parameters["full_attention"]["rope_theta"],
                                                        theirs.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.layer_types == tuple(theirs.layer_types) and ours.rope_scaling.factor == 8.0


@pytest.mark.parametrize("width,height,mode,fmt", IMAGES)
def test_pixels_equal_hf(gemma3_dir, width, height, mode, fmt):
    image = encoded(width, height, mode, fmt)
    theirs = np.asarray(hf_processor(gemma3_dir).image_processor(images=[image])["pixel_values"])
    ours = load_vision_tower(gemma3_dir).preprocess(image)
    assert ours.shape == theirs.shape == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("width,height", [(640, 480), (300, 500)])
def test_pixels_equal_hf_at_gemma3s_size(width, height):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tinyvllm.model.gemma3_vision import gemma3_process

    image = encoded(width, height, "RGB", "JPEG")
    theirs = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ours = gemma3_process(image, Gemma3ProcessorConfig())  # Gemma 3's: 896 pixels, mean and std 0.5
    np.testing.assert_allclose(ours, np.asarray(theirs(image)["pixel_values"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt,sizes", [
    ("<start_of_turn>user\n<start_of_image>What is in this image?<end_of_turn>\n", [(70, 40)]),
    ("Compare <start_of_image> with <start_of_image>, please.", [(20, 12), (33, 100)]),
    ("<start_of_image>", [(16, 16)]),
])
def test_prompt_token_ids_equal_hf(gemma3_dir, prompt, sizes):
    images = [encoded(w, h, "RGB", "PNG", seed=i) for i, (w, h) in enumerate(sizes)]
    theirs = hf_processor(gemma3_dir)(text=prompt, images=images)["input_ids"][0]
    tower = load_vision_tower(gemma3_dir)
    text = expand_prompt(prompt, tower.placeholder, [tower.image_text(image) for image in images])
    ours = load_tokenizer(gemma3_dir).encode(text)
    assert ours == list(theirs)
    assert ours.count(IMAGE_TOKEN_ID) == len(images) * TOKENS_PER_IMAGE


def test_pan_and_scan_is_refused_by_name(gemma3_dir, tmp_path):
    cfg = json.loads((gemma3_dir / "preprocessor_config.json").read_text())
    for value, refused in [(True, True), (False, False), (None, False)]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**cfg, "do_pan_and_scan": value}))
        if refused:
            with pytest.raises(ValueError, match="do_pan_and_scan true is not supported"):
                Gemma3ProcessorConfig.from_dir(tmp_path)
        else:
            assert Gemma3ProcessorConfig.from_dir(tmp_path).size == (IMAGE_SIZE, IMAGE_SIZE)


def test_google_preprocessor_config_with_nulls_loads(tmp_path):
    """Google's preprocessor_config.json writes the steps it leaves at their defaults as null."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": 896, "width": 896}}))
    assert Gemma3ProcessorConfig.from_dir(tmp_path) == Gemma3ProcessorConfig()


@pytest.mark.parametrize("change,error", [
    ({"mm_tokens_per_image": 15}, "mm_tokens_per_image 15"),
    ({"mm_tokens_per_image": 9}, "side divides 8"),
    ({"vision_config": {"hidden_act": "gelu"}}, "vision hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_by_name(gemma3_dir, change, error):
    cfg = config_json(gemma3_dir)
    for key, value in change.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=error):
        Gemma3VisionConfig.from_hf_config(cfg)


def test_a_processor_that_does_not_fit_the_tower_is_refused(gemma3_dir):
    config = Gemma3VisionConfig.from_hf_config(config_json(gemma3_dir))
    with pytest.raises(ValueError, match=r"size \(48, 48\) is not the vision tower's image_size 64"):
        Gemma3VisionTower(config, {}, processor=Gemma3ProcessorConfig(size=(48, 48)))
