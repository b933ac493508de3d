"""Phase 1 on tiny random-weight models: HF checkpoints load, and the architecture's options match HF
transformers (GQA ratios, untied lm_head, RoPE scaling), in float32 and float16."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY_CONFIG, write_tiny_model
from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
from tinyvllm.model.config import RopeScaling
from tinyvllm.model.loader import load_model

VARIANTS = {
    "gqa-2": TINY_CONFIG,
    "mha": dataclasses.replace(TINY_CONFIG, num_key_value_heads=4),
    "llama3-rope": dataclasses.replace(TINY_CONFIG, rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
    "linear-rope": dataclasses.replace(TINY_CONFIG, rope_scaling=RopeScaling(factor=4.0, rope_type="linear")),
}
PROMPT = [int(t) for t in np.random.default_rng(5).integers(100, 40000, size=40)]


@pytest.mark.oracle
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_matches_hf(tmp_path, variant):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = write_tiny_model(tmp_path / variant, VARIANTS[variant])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
    model, _, _ = load_model(model_dir)
    ours = ContiguousModelRunner(model, 64).prefill(PROMPT)
    assert np.abs(ours - expected).max() < 1e-4


def test_float16_is_selectable(tiny_model_dir):
    model32, _, _ = load_model(tiny_model_dir)
    model16, _, _ = load_model(tiny_model_dir, dtype="float16")
    assert model16.embed_tokens.dtype.name == "half"
    a = ContiguousModelRunner(model32, 64).prefill(PROMPT)
    b = ContiguousModelRunner(model16, 64).prefill(PROMPT)
    assert b.dtype == np.float32 and np.abs(a - b).max() < 0.05
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_dir, dtype="int3")
