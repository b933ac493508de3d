"""The vision tower and connector on tinygrad against HF's Idefics3 `get_image_features` (Phase 10)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
from vision_models import TILE, hf_model  # noqa: E402

from tinyvllm.model.vision import VisionTower, load_vision_tower  # noqa: E402


def test_image_features_equal_hf(idefics3_dir):
    import torch

    tower = load_vision_tower(idefics3_dir)
    assert isinstance(tower, VisionTower)
    pixels = np.random.default_rng(0).standard_normal((3, 3, TILE, TILE)).astype(np.float32)
    ours = tower.encode(pixels)
    with torch.no_grad():
        theirs = hf_model(idefics3_dir).model.get_image_features(torch.from_numpy(pixels)[None]).pooler_output[0]
    assert ours.shape == tuple(theirs.shape) == (3 * tower.config.tokens_per_frame, 64)
    assert np.abs(theirs.numpy()).mean() > 0.1  # features of unit scale, not near zero
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4, rtol=0)


def test_text_model_loads_from_the_vision_checkpoint(idefics3_dir):
    from tinyvllm.model.weights_hf import load_hf

    config, state_dict = load_hf(idefics3_dir)
    assert config.hidden_size == 64 and config.vocab_size == 49280
    assert "model.embed_tokens.weight" in state_dict and not any("vision" in n for n in state_dict)


def test_a_text_only_checkpoint_has_no_vision_tower(tiny_model_dir):
    assert load_vision_tower(tiny_model_dir) is None


def test_frames_of_the_wrong_size_are_refused(idefics3_dir):
    with pytest.raises(ValueError, match="pixel values must be"):
        load_vision_tower(idefics3_dir).encode(np.zeros((1, 3, TILE + 8, TILE), np.float32))
