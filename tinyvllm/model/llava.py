"""The vision tower of a LLaVA-1.5 checkpoint: CLIP's ViT, a hidden state from below its top, then a two-layer
projector into the LLaMA's width; and CLIP's image processor.

    image --RGB--> shortest edge to `size` (bicubic) --> centre crop S x S --> /255, (x - mean) / std --> (1,3,S,S)
    frame -> patches (P,3*p*p) @ patch_embedding -> [CLS; patches] + position -> LN -> layers 1..k (k: the
          vision_feature_layer) -> drop CLS ("default") -> linear_1, gelu, linear_2 -> (P, D): one row per <image>

    prompt "<image>"  -->  <image> * P    (576 for a 336-pixel frame of 14-pixel patches)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.model.image_processor import IMAGE_TOKEN, normalize, read_processor_config, to_rgb
from tinyvllm.model.llama import project
from tinyvllm.model.vision import (ACTIVATIONS, ENCODER_LAYER_TENSORS, ViTTower, activation, encoder_layer, layer_norm,
                                   patchify)

VISION_PREFIX, PROJECTOR_PREFIX = "vision_tower.", "multi_modal_projector."


@dataclass(frozen=True)
class LlavaConfig:
    """A LLaVA config.json's `vision_config` (CLIP) and how its features are taken and projected."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    text_hidden_size: int
    image_token_id: int
    feature_layer: int  # the hidden_states index as HF counts them (0: the embeddings, n: the last layer's)
    keep_cls: bool  # vision_feature_select_strategy "full"; "default" drops the CLS row
    hidden_act: str = "quick_gelu"
    projector_hidden_act: str = "gelu"
    num_channels: int = 3

    @property
    def tokens_per_frame(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + self.keep_cls

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlavaConfig:
        v, layer = cfg["vision_config"], cfg.get("vision_feature_layer", -2)
        n = v["num_hidden_layers"]
        if not isinstance(layer, int) or not -n - 1 <= layer <= n:
            raise ValueError(f"vision_feature_layer {layer!r}: tinyvllm's LLaVA takes one hidden state's index, "
                             f"-{n + 1} to {n}")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r}: LLaVA's are 'default' and 'full'")
        if not cfg.get("multimodal_projector_bias", True):
            raise ValueError("multimodal_projector_bias false: tinyvllm's LLaVA projector has biases")
        config = cls(hidden_size=v["hidden_size"], num_hidden_layers=n, num_attention_heads=v["num_attention_heads"],
                     image_size=v["image_size"], patch_size=v["patch_size"],
                     layer_norm_eps=v.get("layer_norm_eps", 1e-5), text_hidden_size=cfg["text_config"]["hidden_size"],
                     image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),  # HF's default
                     feature_layer=layer % (n + 1), keep_cls=strategy == "full",
                     hidden_act=v.get("hidden_act", "quick_gelu"),
                     projector_hidden_act=cfg.get("projector_hidden_act", "gelu"),
                     num_channels=v.get("num_channels", 3))
        activation(config.hidden_act, "vision hidden_act", ("quick_gelu", "gelu"))
        activation(config.projector_hidden_act, "projector_hidden_act", ("gelu",))
        return config


@dataclass(frozen=True)
class ClipProcessorConfig:
    """preprocessor_config.json's fields for CLIP's image processor (LLaVA-1.5's)."""

    shortest_edge: int = 336
    crop_size: tuple[int, int] = (336, 336)  # (height, width)
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ClipProcessorConfig:
        cfg, d = read_processor_config(model_dir, ("do_center_crop",)), cls()
        size, crop = cfg.get("size", {"shortest_edge": d.shortest_edge}), cfg.get("crop_size", {})
        if "shortest_edge" not in size:
            raise ValueError(f"preprocessor_config.json size {size}: tinyvllm's CLIP processor takes shortest_edge")
        config = cls(shortest_edge=size["shortest_edge"],
                     crop_size=(crop.get("height", d.crop_size[0]), crop.get("width", d.crop_size[1])),
                     image_mean=tuple(cfg.get("image_mean", d.image_mean)),
                     image_std=tuple(cfg.get("image_std", d.image_std)),
                     rescale_factor=cfg.get("rescale_factor", d.rescale_factor),
                     resample=cfg.get("resample", d.resample))
        if config.shortest_edge < max(config.crop_size):
            raise ValueError(f"preprocessor_config.json: shortest_edge {config.shortest_edge} is smaller than "
                             f"crop_size {config.crop_size}: the crop must fit in the resized image")
        return config


def clip_process(image: Image.Image, config: ClipProcessorConfig) -> np.ndarray:
    """image -> (1, 3, crop height, crop width) float32, as HF's CLIPImageProcessor (PIL backend)."""
    pixels = to_rgb(image)
    h, w = pixels.shape[:2]
    short, long = config.shortest_edge, int(config.shortest_edge * max(h, w) / min(h, w))  # HF's int(), not round()
    h, w = (long, short) if w <= h else (short, long)
    pixels = np.array(Image.fromarray(pixels).resize((w, h), resample=config.resample))
    crop_h, crop_w = config.crop_size
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    return normalize(pixels[None, top:top + crop_h, left:left + crop_w], config)


class LlavaVisionTower(ViTTower):
    """CLIP + LLaVA's projector, from the HF-named tensors `vision_tower.*` and `multi_modal_projector.*`; the
    engine's interface as model/vision.py's VisionTower."""

    placeholder = image_token = IMAGE_TOKEN

    def __init__(self, config: LlavaConfig, state_dict: dict[str, np.ndarray], dtype: DType = dtypes.float32,
                 device: str | None = None, processor: ClipProcessorConfig | None = None):
        self.config, self.dtype, self.processor = config, dtype, processor or ClipProcessorConfig()
        if self.processor.crop_size != (config.image_size, config.image_size):
            raise ValueError(f"the image processor's crop_size {self.processor.crop_size} is not the vision tower's "
                             f"image_size {config.image_size}")
        self.act, self.projector_act = ACTIVATIONS[config.hidden_act], ACTIVATIONS[config.projector_hidden_act]
        load, e = self.loader(state_dict, device), "embeddings."
        self.patch_embedding = load(e + "patch_embedding.weight").reshape(config.hidden_size, -1)  # (Dv, 3*p*p)
        self.class_embedding = load(e + "class_embedding")  # (Dv,)
        self.position_embedding = load(e + "position_embedding.weight")  # (P+1, Dv)
        self.pre_layrnorm = load("pre_layrnorm.weight"), load("pre_layrnorm.bias")
        self.layers = [{name: load(f"encoder.layers.{i}.{name}") for name in ENCODER_LAYER_TENSORS}
                       for i in range(config.feature_layer)]  # the layers above it never run
        self.linear_1 = load(PROJECTOR_PREFIX + "linear_1.weight"), load(PROJECTOR_PREFIX + "linear_1.bias")
        self.linear_2 = load(PROJECTOR_PREFIX + "linear_2.weight"), load(PROJECTOR_PREFIX + "linear_2.bias")

    def image_text(self, image: Image.Image) -> str:
        return IMAGE_TOKEN * self.config.tokens_per_frame

    def preprocess(self, image: Image.Image) -> np.ndarray:
        return clip_process(image, self.processor)

    def __call__(self, pixels: Tensor) -> Tensor:
        """pixels (F,3,S,S) -> image features (F*T, D), T = tokens_per_frame."""
        c = self.config
        x = project(patchify(pixels.cast(self.dtype), c.patch_size), self.patch_embedding)  # (F,P,Dv)
        cls = self.class_embedding.reshape(1, 1, -1).expand(x.shape[0], 1, c.hidden_size)
        x = layer_norm(cls.cat(x, dim=1) + self.position_embedding, *self.pre_layrnorm, c.layer_norm_eps)  # (F,P+1,Dv)
        for w in self.layers:  # up to HF's hidden_states[feature_layer]
            x = encoder_layer(x, w, c.num_attention_heads, c.layer_norm_eps, self.act)
        x = x if c.keep_cls else x[:, 1:]  # (F,T,Dv)
        h = self.projector_act(project(x, self.linear_1[0]) + self.linear_1[1])
        return (project(h, self.linear_2[0]) + self.linear_2[1]).reshape(-1, c.text_hidden_size)


def load_llava_tower(model_dir: Path, cfg: dict, dtype: DType, device: str | None) -> LlavaVisionTower:
    from tinyvllm.model.weights_hf import read_hf_tensors

    tensors = read_hf_tensors(model_dir, lambda name: name.startswith((VISION_PREFIX, PROJECTOR_PREFIX)))
    # transformers 5 saves CLIP's tensors as vision_tower.*, older checkpoints as vision_tower.vision_model.*
    tensors = {n.removeprefix(VISION_PREFIX).removeprefix("vision_model."): t for n, t in tensors.items()}
    return LlavaVisionTower(LlavaConfig.from_hf_config(cfg), tensors, dtype, device,
                            ClipProcessorConfig.from_dir(model_dir))
