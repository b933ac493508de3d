"""A tiny random LLaVA-1.5 (CLIP ViT, two-layer projector, LLaMA) written by HF transformers, with SmolLM2's
tokenizer plus an `<image>` token and HF's CLIP image processor config: the oracle of Phase 10's LLaVA tests."""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKEN_ID = 49152  # `<image>`, added after SmolLM2's vocabulary
IMAGE_SIZE, PATCH_SIZE = 32, 4  # a frame is 32 x 32 pixels, 8 x 8 patches: 64 image tokens (the CLS row dropped)
SHORTEST_EDGE = 40  # resized to a shortest edge of 40, then the centre 32 x 32 cropped


def write_tiny_llava(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from vision_models import unit_scale

    from tinyvllm.convert import write_tokenizer
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights import default_model_path

    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, GGUFFile(default_model_path()).metadata, {IMAGE_TOKEN_ID: "<image>"})

    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=49216, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32),
        image_token_index=IMAGE_TOKEN_ID, image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    unit_scale(model)
    model.save_pretrained(out_dir)
    CLIPImageProcessorPil(size={"shortest_edge": SHORTEST_EDGE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out_dir)
    return out_dir


def hf_model(model_dir: Path):
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.set_num_threads(2)
    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_processor(model_dir: Path):
    """HF's LlavaProcessor (PIL CLIP image processor) over the directory's tokenizer, set as llava-hf's checkpoints
    set it: one `<image>` per patch, the CLS row (num_additional_image_tokens) counted and dropped."""
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return LlavaProcessor(CLIPImageProcessorPil.from_pretrained(model_dir), tokenizer, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)
