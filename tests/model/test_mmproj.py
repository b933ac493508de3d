"""llama.cpp's mmproj GGUF (its vision tower file beside a text GGUF) read into the same tower as the HF checkpoint
(Phase 10). The layout is the one llama.cpp's converter writes, recorded from it for the tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
from vision_models import TILE, draw_image, write_mmproj  # noqa: E402

from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.vision import load_mmproj, load_vision_tower, mmproj_hf_name  # noqa: E402

LAYOUT = Path(__file__).parent / "data" / "mmproj_layout.json"  # convert_hf_to_gguf.py --mmproj on the tiny model


def test_the_written_file_has_llama_cpps_layout(idefics3_dir, tmp_path):
    recorded = json.loads(LAYOUT.read_text())
    gguf = GGUFFile(write_mmproj(idefics3_dir, tmp_path / "mmproj.gguf"))
    ours = {n: {"shape": list(i.shape), "ggml_type": i.ggml_type} for n, i in gguf.tensors.items()}
    assert ours == recorded["tensors"]
    for key, value in recorded["metadata"].items():
        assert gguf.metadata[key] == pytest.approx(value), key
    assert all(mmproj_hf_name(name).startswith("model.") for name in recorded["tensors"])


def test_the_tower_from_an_mmproj_equals_the_checkpoints(idefics3_dir, tmp_path):
    pixels = np.random.default_rng(1).standard_normal((2, 3, TILE, TILE)).astype(np.float32)
    from_hf = load_vision_tower(idefics3_dir)
    tokenizer = load_tokenizer(idefics3_dir)
    from_gguf = load_mmproj(write_mmproj(idefics3_dir, tmp_path / "f32.gguf", f16=False), tokenizer)
    assert from_gguf.image_token_id == from_hf.image_token_id
    eps = from_gguf.config.layer_norm_eps  # float32 in the file
    assert eps == pytest.approx(from_hf.config.layer_norm_eps, rel=1e-6) and from_gguf.processor == from_hf.processor
    assert dataclasses.replace(from_gguf.config, layer_norm_eps=from_hf.config.layer_norm_eps) == from_hf.config
    np.testing.assert_array_equal(from_gguf.encode(pixels), from_hf.encode(pixels))
    half = load_mmproj(write_mmproj(idefics3_dir, tmp_path / "f16.gguf"), tokenizer)
    np.testing.assert_allclose(half.encode(pixels), from_hf.encode(pixels), atol=0.05, rtol=0.05)  # F16 matrices


def test_an_engine_with_an_mmproj_answers_as_the_checkpoint(idefics3_dir, tmp_path):
    from tinyvllm.llm import LLM
    from tinyvllm.sampling_params import SamplingParams

    mmproj = write_mmproj(idefics3_dir, tmp_path / "mmproj.gguf", f16=False)
    prompt = {"prompt": "Look at <image> here", "multi_modal_data": {"image": draw_image(70, 40, seed=1)}}
    greedy = SamplingParams(max_tokens=6, temperature=0)
    outs = [LLM(str(idefics3_dir), max_model_len=256, kv_cache_memory="4MiB", **extra).generate(
        prompt, greedy, use_tqdm=False)[0] for extra in ({}, {"mmproj": str(mmproj)})]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_a_wrong_mmproj_or_text_model_is_refused(idefics3_dir, tiny_model_dir, tmp_path):
    from tinyvllm.llm import LLM
    from tinyvllm.model.gguf_writer import typed, write_gguf

    mmproj = write_mmproj(idefics3_dir, tmp_path / "mmproj.gguf")
    with pytest.raises(ValueError, match="vocabulary has no <image> token"):
        LLM(str(tiny_model_dir), mmproj=str(mmproj), max_model_len=128, kv_cache_memory="4MiB")
    other = tmp_path / "other.gguf"
    write_gguf(other, {"general.architecture": typed("clip"), "clip.projector_type": typed("gemma3")}, [])
    with pytest.raises(ValueError, match="projector_type idefics3 .* got architecture 'clip', projector 'gemma3'"):
        load_mmproj(other, load_tokenizer(idefics3_dir))
