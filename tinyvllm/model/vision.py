"""The vision tower of an Idefics3 (SmolVLM) checkpoint: SigLIP's ViT, then the connector into the LLaMA's width.

    frames (F,3,S,S) -> patches (F,P,3*p*p) @ patch_embedding + position -> N x [LN, attention, LN, MLP] -> LN
                     -> pixel shuffle (F,P/s^2,s^2*Dv) -> proj (no bias) -> (F*P/s^2, D): one row per <image> token
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm.model.image_processor import IMAGE_TOKEN, ImageProcessorConfig, image_prompt, process_image, split_size
from tinyvllm.model.llama import project

VISION_PREFIX, CONNECTOR_PREFIX = "model.vision_model.", "model.connector."


@dataclass(frozen=True)
class VisionConfig:
    """An Idefics3 config.json's `vision_config` (SigLIP) and its connector's `scale_factor`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # a frame is image_size x image_size pixels
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # the pixel shuffle folds scale_factor^2 neighbouring patches into one token
    text_hidden_size: int
    image_token_id: int
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """<image> tokens one frame becomes (HF's image_seq_len)."""
        return self.patches_per_side**2 // self.scale_factor**2

    @classmethod
    def from_hf_config(cls, cfg: dict) -> VisionConfig:
        v = cfg["vision_config"]
        activation(v.get("hidden_act", "gelu_pytorch_tanh"), "vision hidden_act", ("gelu_pytorch_tanh",))
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
                   image_size=v["image_size"], patch_size=v["patch_size"], layer_norm_eps=v.get("layer_norm_eps", 1e-6),
                   scale_factor=cfg.get("scale_factor", 2), text_hidden_size=cfg["text_config"]["hidden_size"],
                   image_token_id=cfg["image_token_id"], num_channels=v.get("num_channels", 3))


# HF's hidden_act names: SigLIP's MLP, CLIP's MLP, LLaVA's projector
ACTIVATIONS = {"gelu_pytorch_tanh": Tensor.gelu, "quick_gelu": Tensor.quick_gelu,
               "gelu": lambda x: x.gelu(approximate="none")}
ENCODER_LAYER_TENSORS = (
    "layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight", "layer_norm2.bias",
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias",
    "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")


def activation(name: str, where: str, allowed: tuple[str, ...]):
    if name not in allowed:
        raise ValueError(f"{where} {name!r}: tinyvllm's vision tower has {' or '.join(allowed)} there")
    return ACTIVATIONS[name]


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return x.float().layernorm(eps=eps).cast(x.dtype) * weight + bias


def patchify(pixels: Tensor, p: int) -> Tensor:
    """pixels (F,C,S,S) -> (F,P,C*p*p), P = (S/p)^2 patches in row-major order: a stride-p conv's inputs."""
    F, C, S, _ = pixels.shape
    n = S // p
    return pixels.reshape(F, C, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(F, n * n, C * p * p)


def full_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Every patch sees every patch: softmax(q k^T / sqrt(d)) v for q, k, v (F,H,P,Hd). Each head's two products
    go through the engine's matmul (`project`: several times tinygrad's own speed here), the softmax is one kernel
    between them (base 2, normalised after the weighted sum: one pass fewer over the P x P scores)."""
    F, H, P, Hd = q.shape
    heads = [(f, h) for f in range(F) for h in range(H)]
    scores = Tensor.stack(*[project(q[f, h], k[f, h]) for f, h in heads]).reshape(F, H, P, P)
    scores = (scores * (math.log2(math.e) / math.sqrt(Hd))).contiguous()
    p = (scores - scores.max(-1, keepdim=True)).exp2().contiguous()
    vt = v.transpose(-1, -2).contiguous()  # (F,H,Hd,P): project takes its weight as (out, in)
    return Tensor.stack(*[project(p[f, h], vt[f, h]) for f, h in heads]).reshape(F, H, P, Hd) / p.sum(-1, keepdim=True)


def encoder_layer(x: Tensor, w: dict[str, Tensor], num_heads: int, eps: float, act) -> Tensor:
    """A pre-LayerNorm ViT layer, SigLIP's and CLIP's alike: x (F,P,D) -> (F,P,D)."""
    F, P, D = x.shape
    H = num_heads
    h = layer_norm(x, w["layer_norm1.weight"], w["layer_norm1.bias"], eps)
    q, k, v = ((project(h, w[f"self_attn.{n}_proj.weight"]) + w[f"self_attn.{n}_proj.bias"]).contiguous()
               for n in "qkv")
    q, k, v = (t.reshape(F, P, H, D // H).transpose(1, 2) for t in (q, k, v))  # (F,H,P,Hd)
    a = full_attention(q, k, v).transpose(1, 2).reshape(F, P, D)
    x = x + project(a, w["self_attn.out_proj.weight"]) + w["self_attn.out_proj.bias"]
    h = layer_norm(x, w["layer_norm2.weight"], w["layer_norm2.bias"], eps)
    h = act(project(h, w["mlp.fc1.weight"]) + w["mlp.fc1.bias"])
    return (x + project(h, w["mlp.fc2.weight"]) + w["mlp.fc2.bias"]).contiguous()


class ViTTower:
    """What both towers share: `config` (image_size, num_channels, image_token_id), `patch_embedding`, a call from
    frames (F,C,S,S) to features (F*T, D)."""

    is_mm_prefix_lm = False  # an image's tokens attend to each other both ways (Gemma 3; vLLM's name)

    def loader(self, state_dict: dict[str, np.ndarray], device: str | None):
        def load(name: str) -> Tensor:
            return Tensor(np.ascontiguousarray(state_dict[name], np.float32), device=device).cast(self.dtype).realize()
        return load

    @property
    def device(self) -> str:
        return self.patch_embedding.device

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """pixel_values (F,3,S,S) float32 -> (F*T, D) float32 on the host, a frame at a time."""
        C, S = self.config.num_channels, self.config.image_size
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != (C, S, S):
            raise ValueError(f"pixel values must be (frames, {C}, {S}, {S}), got {pixel_values.shape}")
        frames = [self.frame_graph(Tensor(np.ascontiguousarray(f[None], np.float32), device=self.device).realize())
                  .numpy() for f in pixel_values]
        return np.concatenate(frames)

    def num_embeds(self, pixel_values: np.ndarray) -> int:
        """Image tokens an image's frames become."""
        return len(pixel_values) * self.config.tokens_per_frame

    @property
    def max_embeds_per_image(self) -> int:
        """The most image tokens of one image: one frame's (a tower that tiles says more)."""
        return self.config.tokens_per_frame

    @functools.cached_property
    def frame_graph(self):
        """One frame through the tower, captured once and replayed."""
        from tinyvllm.jit import Jit

        return Jit(lambda frame: self(frame).float().realize())


class SiglipTower(ViTTower):
    """SigLIP's ViT, Idefics3's and Gemma 3's alike: frames (F,3,S,S) -> its last hidden state (F,P,Dv)."""

    def load_siglip(self, load, prefix: str) -> None:
        e, c = prefix + "embeddings.", self.config
        self.patch_embedding = load(e + "patch_embedding.weight").reshape(c.hidden_size, -1)  # (Dv, 3*p*p)
        self.patch_bias = load(e + "patch_embedding.bias")  # (Dv,)
        self.position_embedding = load(e + "position_embedding.weight")  # (P, Dv)
        self.layers = [{name: load(f"{prefix}encoder.layers.{i}.{name}") for name in ENCODER_LAYER_TENSORS}
                       for i in range(c.num_hidden_layers)]
        self.post_layernorm = load(prefix + "post_layernorm.weight"), load(prefix + "post_layernorm.bias")

    def embed_patches(self, pixels: Tensor) -> Tensor:
        """pixels (F,3,S,S) -> (F,P,Dv): the conv of stride p as one matmul over flattened patches."""
        patches = patchify(pixels, self.config.patch_size)
        # a whole frame's patches are all real: HF's fractional position ids are then 0 .. P-1
        return project(patches, self.patch_embedding) + self.patch_bias + self.position_embedding[:patches.shape[1]]

    def siglip(self, pixels: Tensor) -> Tensor:
        """pixels (F,3,S,S) -> (F,P,Dv), after the post-LayerNorm."""
        x = self.embed_patches(pixels.cast(self.dtype))
        for w in self.layers:
            x = encoder_layer(x, w, self.config.num_attention_heads, self.config.layer_norm_eps, Tensor.gelu)
        return layer_norm(x, *self.post_layernorm, self.config.layer_norm_eps)


class VisionTower(SiglipTower):
    """SigLIP + Idefics3's connector, from the HF-named tensors `model.vision_model.*` and `model.connector.*`.

    What the engine asks of any vision tower (LLaVA's in model/llava.py answers the same): `placeholder`, the text
    where an image goes; `image_token`, the text of the token each embedding replaces, and its `image_token_id`;
    `image_text(image)`, the text a placeholder becomes (from the image's size alone); `preprocess(image)`, its
    pixel values; `num_embeds(pixel values)`; `encode(pixel values)`, one embedding per image token;
    `max_embeds_per_image`; `device`."""

    placeholder = image_token = IMAGE_TOKEN

    def __init__(self, config: VisionConfig, state_dict: dict[str, np.ndarray], dtype: DType = dtypes.float32,
                 device: str | None = None, processor: ImageProcessorConfig | None = None):
        self.config, self.dtype = config, dtype
        self.processor = processor or ImageProcessorConfig()
        load = self.loader(state_dict, device)
        self.load_siglip(load, VISION_PREFIX)
        self.proj = load(CONNECTOR_PREFIX + "modality_projection.proj.weight")  # (D, s^2*Dv)

    def image_text(self, image) -> str:
        return image_prompt(*split_size(image, self.processor)[2:], self.config.tokens_per_frame)

    def preprocess(self, image) -> np.ndarray:
        return process_image(image, self.processor).pixel_values

    @property
    def max_embeds_per_image(self) -> int:
        """The most <image> tokens of one image: k x k tiles and the global frame."""
        k = -(-self.processor.longest_edge // self.processor.tile) if self.processor.do_image_splitting else 1
        return (k * k + (k > 1)) * self.config.tokens_per_frame

    def pixel_shuffle(self, x: Tensor) -> Tensor:
        """(F,P,Dv) -> (F,P/s^2,s^2*Dv): each s x s square of patches becomes one token (HF's Idefics3Connector)."""
        F, P, D = x.shape
        s, n = self.config.scale_factor, self.config.patches_per_side
        x = x.reshape(F, n, n // s, D * s).permute(0, 2, 1, 3)  # (F, n/s, n, s*D)
        x = x.reshape(F, n // s, n // s, D * s * s).permute(0, 2, 1, 3)  # (F, n/s, n/s, s*s*D)
        return x.reshape(F, P // (s * s), D * s * s)

    def __call__(self, pixels: Tensor) -> Tensor:
        """pixels (F,3,S,S) -> image features (F*T, D), T = tokens_per_frame, in the order of the <image> tokens."""
        features = project(self.pixel_shuffle(self.siglip(pixels)), self.proj)  # (F,T,D)
        return features.reshape(-1, self.config.text_hidden_size)


def load_vision_tower(model_dir: str | os.PathLike, dtype: DType = dtypes.float32,
                      device: str | None = None) -> ViTTower | None:
    """The vision tower of an HF directory whose config.json is a vision-language one; None for any other path."""
    from tinyvllm.model.weights_hf import read_hf_tensors, text_config

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    cfg = json.loads(config_path.read_text())
    if text_config(cfg)[1] is None:  # no vision tower beside the LLaMA
        return None
    if cfg["model_type"] == "llava":
        from tinyvllm.model.llava import load_llava_tower

        return load_llava_tower(Path(model_dir), cfg, dtype, device)
    if cfg["model_type"] == "gemma3":
        from tinyvllm.model.gemma3_vision import load_gemma3_tower

        return load_gemma3_tower(Path(model_dir), cfg, dtype, device)
    tensors = read_hf_tensors(Path(model_dir), lambda name: name.startswith((VISION_PREFIX, CONNECTOR_PREFIX)))
    return VisionTower(VisionConfig.from_hf_config(cfg), tensors, dtype, device,
                       ImageProcessorConfig.from_dir(model_dir))


# llama.cpp's mmproj GGUF (its `clip` architecture, projector "idefics3"): the same tensors under llama.cpp's names
MMPROJ_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
                      "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                      "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
MMPROJ_NAMES = {"v.patch_embd": VISION_PREFIX + "embeddings.patch_embedding",
                "v.position_embd": VISION_PREFIX + "embeddings.position_embedding",
                "v.post_ln": VISION_PREFIX + "post_layernorm",
                "mm.model.fc": CONNECTOR_PREFIX + "modality_projection.proj"}


def mmproj_hf_name(name: str) -> str:
    """llama.cpp's mmproj tensor name -> HF's Idefics3 name: v.blk.3.attn_q.weight -> ...layers.3.self_attn.q_proj..."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[:2] == ["v", "blk"] and len(parts) == 4 and parts[3] in MMPROJ_LAYER_NAMES:
        return f"{VISION_PREFIX}encoder.layers.{parts[2]}.{MMPROJ_LAYER_NAMES[parts[3]]}.{suffix}"
    if base in MMPROJ_NAMES:
        return f"{MMPROJ_NAMES[base]}.{suffix}"
    raise ValueError(f"mmproj tensor {name!r} is not one of an idefics3 projector's")


def load_mmproj(path: str | os.PathLike, tokenizer, dtype: DType = dtypes.float32,
                device: str | None = None) -> VisionTower:
    """The vision tower in a llama.cpp mmproj GGUF (projector idefics3: SmolVLM's), beside a text model whose
    vocabulary (`tokenizer`) has the `<image>` token."""
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights_gguf import read_tensor

    gguf = GGUFFile(path)
    md = gguf.metadata
    if md.get("general.architecture") != "clip" or md.get("clip.projector_type") != "idefics3":
        raise ValueError(f"{path}: an mmproj GGUF with projector_type idefics3 (SmolVLM's) is served, got architecture "
                         f"{md.get('general.architecture')!r}, projector {md.get('clip.projector_type')!r}")
    image_token_id = tokenizer.special_token_id(IMAGE_TOKEN)
    if image_token_id is None:
        raise ValueError(f"{path}: the text model's vocabulary has no {IMAGE_TOKEN} token: give the mmproj beside "
                         "the text model it was converted with")
    v = "clip.vision."
    config = VisionConfig(hidden_size=md[v + "embedding_length"], intermediate_size=md[v + "feed_forward_length"],
                          num_hidden_layers=md[v + "block_count"], num_attention_heads=md[v + "attention.head_count"],
                          image_size=md[v + "image_size"], patch_size=md[v + "patch_size"],
                          layer_norm_eps=md.get(v + "attention.layer_norm_epsilon", 1e-6),
                          scale_factor=md.get(v + "projector.scale_factor", 2),
                          text_hidden_size=md[v + "projection_dim"], image_token_id=image_token_id)
    processor = ImageProcessorConfig(longest_edge=md.get(v + "preproc_image_size", 4 * config.image_size),
                                     tile=config.image_size, image_mean=tuple(md[v + "image_mean"]),
                                     image_std=tuple(md[v + "image_std"]))
    tensors = {mmproj_hf_name(name): read_tensor(gguf, name) for name in gguf.tensors}
    return VisionTower(config, tensors, dtype, device, processor)
