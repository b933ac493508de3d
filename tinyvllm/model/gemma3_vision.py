"""The vision tower of a Gemma 3 checkpoint (Gemma3ForConditionalGeneration): SigLIP's ViT, then a projector that
average-pools the patch grid to a few soft tokens; and Gemma 3's image processor.

    image --RGB--> S x S (bilinear) --> /255, (x - mean) / std --> (1,3,S,S)
    frame -> SigLIP (model/vision.py) -> (n x n patches, Dv) -> k x k average pool -> (t x t, Dv)
          -> RMSNorm (1 + w) -> @ mm_input_projection_weight (Dv, D) -> (T, D): one row per <image_soft_token>

    prompt "<start_of_image>"  -->  "\\n\\n<start_of_image>" + "<image_soft_token>" * T + "<end_of_image>\\n\\n"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.model.image_processor import normalize, read_processor_config, to_rgb
from tinyvllm.model.llama import project, rms_norm
from tinyvllm.model.vision import SiglipTower, activation

BOI_TOKEN, IMAGE_SOFT_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
VISION_PREFIX, PROJECTOR_PREFIX = "vision_tower.", "multi_modal_projector."


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """A Gemma 3 config.json's `vision_config` (SigLIP, HF's defaults where a key is left out) and its projector's
    `mm_tokens_per_image`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    text_hidden_size: int
    image_token_id: int  # <image_soft_token>'s
    mm_tokens_per_image: int
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """Soft tokens one frame (one image) becomes."""
        return self.mm_tokens_per_image

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """Patches per side of the square one soft token averages."""
        return self.patches_per_side // self.tokens_per_side

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Gemma3VisionConfig:
        v = cfg.get("vision_config", {})
        activation(v.get("hidden_act", "gelu_pytorch_tanh"), "vision hidden_act", ("gelu_pytorch_tanh",))
        config = cls(hidden_size=v.get("hidden_size", 768), num_hidden_layers=v.get("num_hidden_layers", 12),
                     num_attention_heads=v.get("num_attention_heads", 12), image_size=v.get("image_size", 224),
                     patch_size=v.get("patch_size", 16), layer_norm_eps=v.get("layer_norm_eps", 1e-6),
                     text_hidden_size=cfg["text_config"]["hidden_size"],
                     image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 262_144)),
                     mm_tokens_per_image=cfg.get("mm_tokens_per_image", 256), num_channels=v.get("num_channels", 3))
        t, n = config.tokens_per_side, config.patches_per_side
        if t * t != config.mm_tokens_per_image or n % t:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image}: Gemma 3's projector pools the "
                             f"{n} x {n} patch grid to a square of soft tokens whose side divides {n}")
        return config


@dataclass(frozen=True)
class Gemma3ProcessorConfig:
    """preprocessor_config.json's fields for Gemma 3's image processor."""

    size: tuple[int, int] = (896, 896)  # (height, width)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BILINEAR

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Gemma3ProcessorConfig:
        cfg, d = read_processor_config(model_dir), cls()
        if cfg.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json do_pan_and_scan true is not supported: tinyvllm's Gemma 3 "
                             "processor takes each image as one frame (set it false or null)")
        size = cfg.get("size") or {"height": d.size[0], "width": d.size[1]}
        if set(size) != {"height", "width"}:
            raise ValueError(f"preprocessor_config.json size {size}: Gemma 3's processor takes height and width")
        return cls(size=(size["height"], size["width"]), image_mean=tuple(cfg.get("image_mean") or d.image_mean),
                   image_std=tuple(cfg.get("image_std") or d.image_std),
                   rescale_factor=cfg.get("rescale_factor") or d.rescale_factor,
                   resample=d.resample if cfg.get("resample") is None else cfg["resample"])


def gemma3_process(image: Image.Image, config: Gemma3ProcessorConfig) -> np.ndarray:
    """image -> (1, 3, height, width) float32, as HF's Gemma3ImageProcessor (PIL backend, no pan and scan)."""
    height, width = config.size
    pixels = np.array(Image.fromarray(to_rgb(image)).resize((width, height), resample=config.resample))
    return normalize(pixels[None], config)


class Gemma3VisionTower(SiglipTower):
    """SigLIP + Gemma 3's projector, from the HF-named tensors `vision_tower.*` and `multi_modal_projector.*`; the
    engine's interface as model/vision.py's VisionTower, the placeholder `<start_of_image>`."""

    placeholder, image_token = BOI_TOKEN, IMAGE_SOFT_TOKEN
    is_mm_prefix_lm = True  # HF's token_type_ids mask: an image's tokens attend to each other both ways

    def __init__(self, config: Gemma3VisionConfig, state_dict: dict[str, np.ndarray], dtype: DType = dtypes.float32,
                 device: str | None = None, processor: Gemma3ProcessorConfig | None = None):
        self.config, self.dtype, self.processor = config, dtype, processor or Gemma3ProcessorConfig()
        if self.processor.size != (config.image_size, config.image_size):
            raise ValueError(f"the image processor's size {self.processor.size} is not the vision tower's "
                             f"image_size {config.image_size}")
        norm, proj = PROJECTOR_PREFIX + "mm_soft_emb_norm.weight", PROJECTOR_PREFIX + "mm_input_projection_weight"
        # Gemma's RMSNorm multiplies by (1 + w): added once here; the projection stored (Dv, D), `project` takes (D, Dv)
        load = self.loader({**state_dict, norm: state_dict[norm] + np.float32(1), proj: state_dict[proj].T}, device)
        self.load_siglip(load, VISION_PREFIX)
        self.soft_emb_norm, self.input_projection = load(norm), load(proj)  # (Dv,), (D, Dv)

    def image_text(self, image: Image.Image) -> str:
        return f"\n\n{BOI_TOKEN}{IMAGE_SOFT_TOKEN * self.config.mm_tokens_per_image}{EOI_TOKEN}\n\n"

    def preprocess(self, image: Image.Image) -> np.ndarray:
        return gemma3_process(image, self.processor)

    def pool(self, x: Tensor) -> Tensor:
        """(F,P,Dv) -> (F,T,Dv): each k x k square of patches averaged into one soft token (HF's AvgPool2d)."""
        F, _, D = x.shape
        t, k = self.config.tokens_per_side, self.config.pool_kernel
        return x.reshape(F, t, k, t, k, D).mean(axis=(2, 4)).reshape(F, t * t, D)

    def __call__(self, pixels: Tensor) -> Tensor:
        """pixels (F,3,S,S) -> image features (F*T, D), T = mm_tokens_per_image."""
        c = self.config
        x = rms_norm(self.pool(self.siglip(pixels)), self.soft_emb_norm, c.layer_norm_eps)
        return project(x, self.input_projection).reshape(-1, c.text_hidden_size)


def load_gemma3_tower(model_dir: Path, cfg: dict, dtype: DType, device: str | None) -> Gemma3VisionTower:
    from tinyvllm.model.weights_hf import read_hf_tensors

    tensors = read_hf_tensors(model_dir, lambda name: name.removeprefix("model.").startswith(
        (VISION_PREFIX, PROJECTOR_PREFIX)))
    # saved as vision_tower.vision_model.* (Google's checkpoints), vision_tower.* or model.vision_tower.*
    tensors = {n.removeprefix("model.").replace(VISION_PREFIX + "vision_model.", VISION_PREFIX, 1): t
               for n, t in tensors.items()}
    return Gemma3VisionTower(Gemma3VisionConfig.from_hf_config(cfg), tensors, dtype, device,
                             Gemma3ProcessorConfig.from_dir(model_dir))
