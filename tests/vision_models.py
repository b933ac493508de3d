"""A tiny random Idefics3 (SmolVLM's architecture) written by HF transformers, with SmolLM2's tokenizer plus
SmolVLM's image tokens at SmolVLM's ids, and HF's image processor config: the oracle of Phase 10's tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

# SmolVLM's added tokens and their ids after SmolLM2's 49152
IMAGE_TOKENS = ["<global-img>", *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
                "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
IMAGE_TOKEN_ID = 49152 + IMAGE_TOKENS.index("<image>")  # 49190, as SmolVLM's
TILE, LONGEST_EDGE = 32, 96  # a frame is 32 x 32 pixels; an image is resized to at most 3 x 3 tiles


def write_tiny_idefics3(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tinyvllm.convert import write_tokenizer
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights import default_model_path

    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, GGUFFile(default_model_path()).metadata,
                    {49152 + i: t for i, t in enumerate(IMAGE_TOKENS)})

    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=TILE, patch_size=8),
        scale_factor=2, image_token_id=IMAGE_TOKEN_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    unit_scale(model)
    model.save_pretrained(out_dir)
    Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                              max_image_size={"longest_edge": TILE}).save_pretrained(out_dir)
    return out_dir


def unit_scale(model) -> None:
    """HF's init (std 0.02) leaves the features near zero: weights of unit-scale outputs instead."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(np.prod(p.shape[1:]) if p.ndim > 1 else 1))


def hf_model(model_dir: Path):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.set_num_threads(2)
    return Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_processor(model_dir: Path):
    """HF's Idefics3Processor (PIL image processor) over the directory's tokenizer."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tinyvllm.model.vision import VisionConfig

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    vision = VisionConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    return Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(model_dir), tokenizer,
                             image_seq_len=vision.tokens_per_frame)


def assert_top20_equal_hf(output, model, inputs) -> None:
    """A one-token request's sampled logprob and its 20 best equal HF's log_softmax of `model(**inputs)` at the last
    position, within 1e-4, in HF's order."""
    import torch

    with torch.no_grad():
        theirs = torch.log_softmax(model(**inputs).logits[0, -1].double(), -1)
    chosen, top20 = output.outputs[0].logprobs[0]  # (the sampled token's logprob, the 20 best as (token, logprob))
    top = theirs.topk(20)
    assert [token for token, _ in top20] == top.indices.tolist()
    np.testing.assert_allclose([lp for _, lp in top20], top.values.numpy(), atol=1e-4, rtol=0)
    assert abs(chosen - top.values[0].item()) < 1e-4


def draw_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A Pillow image of shapes on noise: what a test feeds the processors."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        draw.ellipse([x0, y0, x0 + width // 3, y0 + height // 3], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image.convert(mode)


# the engine tests' images, by name (Idefics3's, LLaVA's and Gemma 3's tests prompt with the same three)
IMAGES = {"wide": draw_image(70, 40, seed=1), "tall": draw_image(30, 50, seed=2), "small": draw_image(20, 20, seed=3)}


def image_request(text: str, names: list[str]) -> dict | str:
    """LLM.generate's prompt for a text and the IMAGES it names: the text alone when it names none."""
    return {"prompt": text, "multi_modal_data": {"image": [IMAGES[n] for n in names]}} if names else text


def hf_image_inputs(processor, text: str, names: list[str]):
    """HF's processor's tensors for the same text and images."""
    return processor(text=text, images=[IMAGES[n] for n in names] or None, return_tensors="pt")


def assert_greedy_equal_hf(output, model, inputs, max_tokens: int) -> None:
    """A greedy request's prompt ids equal HF's processor's, and its tokens `model.generate`'s from them."""
    import torch

    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    assert output.prompt_token_ids == prompt_ids and output.outputs[0].token_ids == tokens[0, len(prompt_ids):].tolist()


def write_mmproj(model_dir: Path, path: Path, f16: bool = True) -> Path:
    """The vision tower of an HF Idefics3 directory as llama.cpp's convert_hf_to_gguf.py --mmproj writes it (the
    layout recorded from that converter in tests/model/data/mmproj_layout.json): F32 embeddings and vectors, the
    matrices F16 (or F32, as its --outtype f32)."""
    from tinyvllm.ggml_types import F16, F32
    from tinyvllm.model.gguf_writer import TensorData, typed, write_gguf
    from tinyvllm.model.vision import MMPROJ_LAYER_NAMES, MMPROJ_NAMES, VISION_PREFIX
    from tinyvllm.model.weights_hf import read_hf_tensors

    cfg = json.loads((model_dir / "config.json").read_text())
    v, pre = cfg["vision_config"], json.loads((model_dir / "preprocessor_config.json").read_text())
    metadata = {"general.architecture": "clip", "general.type": "mmproj", "clip.has_vision_encoder": True,
                "clip.vision.projection_dim": cfg["text_config"]["hidden_size"],
                "clip.vision.image_size": v["image_size"], "clip.vision.patch_size": v["patch_size"],
                "clip.vision.embedding_length": v["hidden_size"],
                "clip.vision.feed_forward_length": v["intermediate_size"],
                "clip.vision.block_count": v["num_hidden_layers"],
                "clip.vision.attention.head_count": v["num_attention_heads"],
                "clip.vision.image_mean": pre["image_mean"], "clip.vision.image_std": pre["image_std"],
                "clip.projector_type": "idefics3", "clip.vision.attention.layer_norm_epsilon": v["layer_norm_eps"],
                "clip.vision.projector.scale_factor": cfg["scale_factor"], "clip.use_gelu": True,
                "clip.vision.preproc_image_size": pre["size"]["longest_edge"]}
    to_gguf = {hf: gguf for gguf, hf in MMPROJ_NAMES.items()}
    to_gguf.update({f"{VISION_PREFIX}encoder.layers.{{}}.{hf}": f"v.blk.{{}}.{gguf}"
                    for gguf, hf in MMPROJ_LAYER_NAMES.items()})

    def gguf_name(name: str) -> str:
        base, _, suffix = name.rpartition(".")
        if base in to_gguf:
            return f"{to_gguf[base]}.{suffix}"
        layer = base.split(".")[4]  # model.vision_model.encoder.layers.<i>.<module>
        return to_gguf[base.replace(f".layers.{layer}.", ".layers.{}.", 1)].format(layer) + f".{suffix}"

    tensors = []
    for name, x in read_hf_tensors(model_dir, lambda n: "vision_model" in n or "connector" in n).items():
        kind = F16 if f16 and x.ndim > 1 and ".embeddings." not in name else F32
        tensors.append(TensorData(gguf_name(name), x.shape, kind, x.astype(np.float16 if kind == F16 else np.float32)))
    write_gguf(path, {key: typed(value) for key, value in metadata.items()}, tensors)
    return path

def encoded(width: int, height: int, mode: str, fmt: str, seed: int = 0):
    """The drawn image written as `fmt` and read back, as a server would receive it."""
    from PIL import Image

    image = draw_image(width, height, seed, mode)
    if mode == "RGBA":
        alpha = np.array(image)
        alpha[..., 3] = np.linspace(0, 255, width, dtype=np.uint8)[None]
        image = Image.fromarray(alpha, "RGBA")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return Image.open(io.BytesIO(buffer.getvalue()))
