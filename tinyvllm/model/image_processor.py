"""An image to the vision tower's frames and the prompt text it takes, as HF's Idefics3 processor (PIL backend).

    image --RGB--> longest edge to `size` --> each edge up to a multiple of the tile --> rows x cols tiles + the
    whole image at tile size (the global frame) --> /255, (x - mean) / std --> frames (rows*cols + 1, 3, S, S)

    prompt "<image>"  -->  <fake><row_1_col_1><image>*T ... <fake><row_r_col_c><image>*T\\n
                           \\n<fake><global-img><image>*T<fake>          (T: tokens per frame)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN = "<image>", "<fake_token_around_image>", "<global-img>"
MAX_IMAGE_SIZE = 4096  # HF's bound on either edge after the first resize
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json's fields."""

    longest_edge: int = 4 * 364  # `size`: the image's longest edge after the first resize
    tile: int = 364  # `max_image_size`: a frame's edge
    do_image_splitting: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.LANCZOS

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        cfg, d = read_processor_config(model_dir), cls()
        return cls(longest_edge=cfg.get("size", {}).get("longest_edge", d.longest_edge),
                   tile=cfg.get("max_image_size", {}).get("longest_edge", d.tile),
                   do_image_splitting=cfg.get("do_image_splitting", d.do_image_splitting),
                   image_mean=tuple(cfg.get("image_mean", d.image_mean)),
                   image_std=tuple(cfg.get("image_std", d.image_std)),
                   rescale_factor=cfg.get("rescale_factor", d.rescale_factor), resample=cfg.get("resample", d.resample))


def read_processor_config(model_dir: str | Path, steps: tuple[str, ...] = ()) -> dict:
    """preprocessor_config.json ({} if none); a ValueError if it turns off a step tinyvllm's processors always do."""
    path = Path(model_dir) / PROCESSOR_FILE
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", *steps):
        if cfg.get(key) is False:  # null: the processor's default (on)
            raise ValueError(f"{path}: {key} false is not supported (tinyvllm's processor always does it)")
    return cfg


@dataclass
class ProcessedImage:
    pixel_values: np.ndarray  # (rows*cols + 1, 3, S, S) float32; (1, 3, S, S) when rows == cols == 0
    rows: int
    cols: int


def to_rgb(image: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8; transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.array(image.convert("RGB"))


def longest_edge_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge to `longest`, the other by the aspect ratio (even), both under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def multiple_of_tile(height: int, width: int, tile: int) -> tuple[int, int]:
    """Each edge up to a multiple of `tile`, keeping the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split_size(image: Image.Image, config: ImageProcessorConfig) -> tuple[int, int, int, int]:
    """(height, width) after the resizes, and the (rows, cols) of tiles the image is split into ((0, 0): none)."""
    height, width = longest_edge_to(image.height, image.width, config.longest_edge)
    if not config.do_image_splitting:
        return height, width, 0, 0
    height, width = multiple_of_tile(height, width, config.tile)
    split = height > config.tile or width > config.tile
    return height, width, height // config.tile if split else 0, width // config.tile if split else 0


def process_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    def resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:  # (H, W, 3) uint8
        return np.array(Image.fromarray(pixels).resize((width, height), resample=config.resample))

    pixels, tile = to_rgb(image), config.tile
    pixels = resize(pixels, *longest_edge_to(*pixels.shape[:2], config.longest_edge))
    _, _, rows, cols = split_size(image, config)
    if not config.do_image_splitting:
        frames = [resize(pixels, tile, tile)]
    else:
        pixels = resize(pixels, *multiple_of_tile(*pixels.shape[:2], tile))
        frames = [pixels[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
        frames.append(resize(pixels, tile, tile) if rows else pixels)
    return ProcessedImage(normalize(np.stack(frames), config), rows, cols)


def normalize(frames: np.ndarray, config) -> np.ndarray:
    """frames (F,H,W,3) uint8 -> (F,3,H,W) float32: x * rescale_factor, then (x - image_mean) / image_std, as HF's
    numpy (the product in float64)."""
    x = (frames.transpose(0, 3, 1, 2).astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean, std = np.array(config.image_mean, np.float32), np.array(config.image_std, np.float32)
    return (x - mean[:, None, None]) / std[:, None, None]


def image_prompt(rows: int, cols: int, tokens_per_frame: int) -> str:
    """The text one image's `<image>` becomes: a frame's tokens after its row/column tag, the global frame's last."""
    frame = IMAGE_TOKEN * tokens_per_frame
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{frame}{FAKE_TOKEN}"
    if rows == cols == 0:
        return whole
    grid = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{frame}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{whole}"
