"""A prompt with images to token ids and the images' features, at admission (vLLM v1's multimodal processor).

    {"prompt": "Describe <image>", "multi_modal_data": {"image": img}}
      -> frames, rows x cols (model/image_processor.py) -> "Describe <fake><row_1_col_1><image>*T ..." -> token ids
      -> MultiModalFeature(mm_hash, offset of its first <image>, is_embed, pixel values)
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image

from tinyvllm.core.encoder_cache import MultiModalFeature
from tinyvllm.model.image_processor import expand_prompt, process_image
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.model.vision import VisionTower


def image_hash(image: Image.Image) -> str:
    """The image's content hash: its mode, size and pixels (vLLM's MultiModalHasher hashes the same)."""
    h = hashlib.sha256(f"{image.mode} {image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    def __init__(self, tokenizer: Tokenizer, tower: VisionTower, encoder_cache_size: int):
        self.tokenizer, self.tower, self.encoder_cache_size = tokenizer, tower, encoder_cache_size

    def process(self, prompt: dict) -> tuple[str, list[int], list[MultiModalFeature]]:
        """(the text, its token ids with each image's placeholders expanded, the images' features); a ValueError
        names what is wrong with the prompt or an image."""
        unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
        if unknown or not isinstance(prompt.get("prompt"), str):
            raise ValueError(f"a prompt with images is {{'prompt': str, 'multi_modal_data': {{'image': ...}}}}, "
                             f"got keys {sorted(prompt)}")
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' (a PIL image or a list of them), got {data!r:.80}")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        for image in images:
            if not isinstance(image, Image.Image):
                raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        try:
            processed = [process_image(image, self.tower.processor) for image in images]
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ValueError(f"the image cannot be read: {e}") from None
        ids = self.tokenizer.encode(expand_prompt(prompt["prompt"], processed, self.tower.config.tokens_per_frame))
        features = self.features(np.array(ids), [p.pixel_values for p in processed], [image_hash(i) for i in images])
        return prompt["prompt"], ids, features

    def features(self, ids: np.ndarray, pixels: list[np.ndarray], hashes: list[str]) -> list[MultiModalFeature]:
        """Each image's feature: its <image> tokens, in order, are the next frames x T of the prompt's."""
        at = np.flatnonzero(ids == self.tower.config.image_token_id)
        features, used = [], 0
        for frames, mm_hash in zip(pixels, hashes):
            n = len(frames) * self.tower.config.tokens_per_frame
            if n > self.encoder_cache_size:
                raise ValueError(f"an image of {n} embeddings does not fit the encoder cache ({self.encoder_cache_size}"
                                 "): give a smaller image or raise max_num_batched_tokens")
            first, last = at[used], at[used + n - 1]
            features.append(MultiModalFeature(mm_hash, int(first), ids[first:last + 1] == ids[first], frames))
            used += n
        if used != len(at):
            raise ValueError(f"the prompt holds {len(at) - used} image token(s) beyond its images' placeholders")
        return features
