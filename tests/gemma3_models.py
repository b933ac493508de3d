"""A tiny random Gemma 3 vision-language model (SigLIP ViT, pooling projector, a sliding and a global Gemma 3 text
layer) written by HF transformers, with SmolLM2's tokenizer plus Gemma 3's three image tokens and HF's Gemma 3 image
processor config: the oracle of Phase 10's Gemma 3 tests."""

from __future__ import annotations

from pathlib import Path

BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 49152, 49153, 49154  # <start_of_image>, <end_of_image>, <image_soft_token>
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 64, 8, 16  # 8 x 8 patches pooled 2 x 2 into 4 x 4 soft tokens
SPECIAL_TOKENS = {BOI_ID: "<start_of_image>", EOI_ID: "<end_of_image>", IMAGE_TOKEN_ID: "<image_soft_token>"}


def write_tiny_gemma3(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from vision_models import unit_scale

    from tinyvllm.convert import write_tokenizer
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights import default_model_path

    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, GGUFFile(default_model_path()).metadata, SPECIAL_TOKENS)

    config = Gemma3Config(
        text_config=dict(vocab_size=49280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=1024),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI_ID, eoi_token_index=EOI_ID,
        image_token_index=IMAGE_TOKEN_ID)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    unit_scale(model)
    model.save_pretrained(out_dir)
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3,
                            image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def hf_model(model_dir: Path):
    import torch
    from transformers import Gemma3ForConditionalGeneration

    torch.set_num_threads(2)
    return Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_processor(model_dir: Path):
    """HF's Gemma3Processor (PIL image processor) over the directory's tokenizer, its image tokens named as
    Gemma 3's tokenizer names them."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), extra_special_tokens={
        "boi_token": SPECIAL_TOKENS[BOI_ID], "eoi_token": SPECIAL_TOKENS[EOI_ID],
        "image_token": SPECIAL_TOKENS[IMAGE_TOKEN_ID]})
    return Gemma3Processor(Gemma3ImageProcessorPil.from_pretrained(model_dir), tokenizer,
                           image_seq_length=TOKENS_PER_IMAGE)
