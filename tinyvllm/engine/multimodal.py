"""A prompt with images to token ids and the images' features, at admission (vLLM v1's multimodal processor).

    {"prompt": "Describe <image>", "multi_modal_data": {"image": img}}
      -> frames, rows x cols (model/image_processor.py) -> "Describe <fake><row_1_col_1><image>*T ..." -> token ids
      -> MultiModalFeature(mm_hash, offset of its first <image>, is_embed, pixel values)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from tinyvllm.config import MAX_IMAGES_PER_PROMPT
from tinyvllm.core.encoder_cache import MultiModalFeature
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.model.vision import ViTTower


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what vLLM's and OpenAI's image inputs take (no animation)
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 8192 * 8192
MIN_IMAGE_EDGE, MAX_IMAGE_EDGE = 2, 8192  # HF's processors cannot tell a 1-pixel edge from a channel axis


def check_size(image: Image.Image) -> None:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {image.width} x {image.height} pixels, more than the {MAX_IMAGE_PIXELS} "
                         "allowed")
    if min(image.size) < MIN_IMAGE_EDGE or max(image.size) > MAX_IMAGE_EDGE:
        raise ValueError(f"the image is {image.width} x {image.height} pixels: each edge must be "
                         f"{MIN_IMAGE_EDGE} to {MAX_IMAGE_EDGE} pixels")


def decode_image(raw: bytes) -> Image.Image:
    """An encoded image's bytes to a loaded PIL image; a ValueError for a corrupt, oversized or unsupported one."""
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(raw)} bytes, more than the {MAX_IMAGE_BYTES} allowed")
    try:
        image = Image.open(io.BytesIO(raw))
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"{image.format} images are not supported: send {', '.join(IMAGE_FORMATS)}")
        check_size(image)
        image.load()
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"the image cannot be decoded ({type(e).__name__}: {e}): send a valid "
                         f"{', '.join(IMAGE_FORMATS)} image") from None
    return image


class MediaConnector:
    """An image URL to a PIL image (vLLM's MediaConnector): data URLs always; http(s) with `allow_remote_media`;
    file:// only under `allowed_local_media_path`."""

    def __init__(self, allow_remote_media: bool = False, allowed_local_media_path: str | None = None,
                 timeout: float = 10.0):
        self.allow_remote_media, self.timeout = allow_remote_media, timeout
        self.local_root = None if allowed_local_media_path is None else Path(allowed_local_media_path).resolve()

    def fetch_image(self, url: str) -> Image.Image:
        scheme = urllib.parse.urlparse(url).scheme
        if scheme == "data":
            header, _, payload = url.partition(",")
            if not (header.startswith("data:image/") and header.endswith(";base64")):
                raise ValueError(f"a data URL of an image is data:image/<type>;base64,<data>, got {header[:40]!r}")
            if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
                raise ValueError(f"the image has more than the {MAX_IMAGE_BYTES} bytes allowed")
            try:
                return decode_image(base64.b64decode(payload, validate=True))
            except binascii.Error as e:
                raise ValueError(f"the data URL's base64 cannot be decoded: {e}") from None
        if scheme in ("http", "https"):
            if not self.allow_remote_media:
                raise ValueError("remote image URLs are not fetched by this server: send the image as a data URL "
                                 "(data:image/png;base64,...), or start the server with --allow-remote-media")
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as response:
                    return decode_image(response.read(MAX_IMAGE_BYTES + 1))
            except OSError as e:
                raise ValueError(f"the image at {url!r} cannot be fetched: {e}") from None
        if scheme == "file":
            path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
            if self.local_root is None or not path.is_relative_to(self.local_root):
                raise ValueError("local files are read only under --allowed-local-media-path"
                                 + ("" if self.local_root is None else f" ({self.local_root})"))
            if not path.is_file():
                raise ValueError(f"no image file at {url!r}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ValueError(f"the image has more than the {MAX_IMAGE_BYTES} bytes allowed")
            return decode_image(path.read_bytes())
        raise ValueError(f"image URLs are data:, http(s): or file: URLs, got {url[:40]!r}")


def part_image(part: dict, where: str, media: MediaConnector) -> Image.Image:
    """A content part's image: an `image_url` part's fetched by `media`, an `image_pil` part's (offline) as given."""
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL.Image.Image, got {type(image).__name__}")
        try:
            check_size(image)
        except ValueError as e:
            raise ValueError(f"{where}.image_pil: {e}") from None
        return image
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else None
    if not isinstance(url, str):
        raise ValueError(f"{where}.image_url must be {{\"url\": \"data:image/png;base64,...\"}}")
    try:
        return media.fetch_image(url)
    except ValueError as e:
        raise ValueError(f"{where}.image_url: {e}") from None


def image_hash(image: Image.Image) -> str:
    """The image's content hash: its mode, size and pixels (vLLM's MultiModalHasher hashes the same)."""
    h = hashlib.sha256(f"{image.mode} {image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def expand_prompt(prompt: str, placeholder: str, texts: list[str]) -> str:
    """Each placeholder replaced by its image's text, in order."""
    parts = prompt.split(placeholder)
    if len(parts) - 1 != len(texts):
        raise ValueError(f"the prompt has {len(parts) - 1} {placeholder} placeholder(s) but {len(texts)} image(s) "
                         f"were given: write one {placeholder} where each image goes")
    return parts[0] + "".join(text + part for text, part in zip(texts, parts[1:]))


class MultiModalProcessor:
    def __init__(self, tokenizer: Tokenizer, tower: ViTTower, encoder_cache_size: int,
                 max_images: int = MAX_IMAGES_PER_PROMPT):
        self.tokenizer, self.tower, self.encoder_cache_size = tokenizer, tower, encoder_cache_size
        self.max_images = max_images  # --limit-mm-per-prompt's
        self.placeholder = tower.placeholder  # where an image goes in a prompt's text
        ids = tokenizer.encode(tower.image_token, add_special_tokens=False)
        if ids != [tower.image_token_id]:  # else every image prompt would fail at admission, counting its tokens
            raise ValueError(f"the model's config gives {tower.image_token} the id {tower.image_token_id}, but its "
                             f"tokenizer reads {tower.image_token} as {ids}: a config and a tokenizer of two models?")

    def process(self, prompt: dict) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """(the text, its token ids with each image's placeholders expanded, the images' features); a ValueError
        names what is wrong with the prompt or an image. Token ids (`prompt_token_ids`) come expanded already."""
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"} or (text is None) == (ids is None) or not (
                isinstance(text, str) or isinstance(ids, list)):
            raise ValueError(f"a prompt with images is {{'prompt': str or 'prompt_token_ids': list, "
                             f"'multi_modal_data': {{'image': ...}}}}, got keys {sorted(prompt)}")
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' (a PIL image or a list of them), got {data!r:.80}")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        self.check_count(len(images))
        for image in images:
            if not isinstance(image, Image.Image):
                raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
            check_size(image)
        try:
            pixels = [self.tower.preprocess(image) for image in images]
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise ValueError(f"the image cannot be read: {e}") from None
        ids = self.tokenizer.encode(self.expand(text, images)) if ids is None else ids
        features = self.features(np.array(ids), pixels, [image_hash(i) for i in images])
        return text, ids, features

    def check_count(self, num_images: int) -> None:
        if num_images > self.max_images:
            raise ValueError(f"At most {self.max_images} image(s) may be provided in one prompt; this one has "
                             f"{num_images}. Set --limit-mm-per-prompt to raise the limit.")

    def add_image(self, images: list[Image.Image], media: MediaConnector, part: dict, where: str) -> str:
        """A content part's image appended to `images` (the limit checked before it is fetched); the part becomes
        the placeholder."""
        self.check_count(len(images) + 1)
        images.append(part_image(part, where, media))
        return self.placeholder

    def prompt_with_images(self, text: str, images: list[Image.Image], add_special_tokens: bool = True) -> dict:
        """The engine's prompt for a text with one placeholder per image: its ids, each placeholder expanded."""
        ids = self.tokenizer.encode(self.expand(text, images), add_special_tokens=add_special_tokens)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def expand(self, text: str, images: list[Image.Image]) -> str:
        """The text with each placeholder expanded to its image's tokens (from the images' sizes alone)."""
        return expand_prompt(text, self.placeholder, [self.tower.image_text(image) for image in images])

    def features(self, ids: np.ndarray, pixels: list[np.ndarray], hashes: list[str]) -> list[MultiModalFeature]:
        """Each image's feature: its image tokens, in order, are the next num_embeds of the prompt's."""
        at = np.flatnonzero(ids == self.tower.image_token_id)
        counts = [self.tower.num_embeds(frames) for frames in pixels]
        if sum(counts) != len(at):
            raise ValueError(f"the prompt holds {len(at)} image tokens where its images take {sum(counts)}")
        features, used = [], 0
        for frames, mm_hash, n in zip(pixels, hashes, counts):
            if n > self.encoder_cache_size:
                raise ValueError(f"an image of {n} embeddings does not fit the encoder cache ({self.encoder_cache_size}"
                                 "): give a smaller image or raise max_num_batched_tokens")
            first, last = at[used], at[used + n - 1]
            features.append(MultiModalFeature(mm_hash, int(first), ids[first:last + 1] == ids[first], frames))
            used += n
        return features
