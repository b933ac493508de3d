"""Phase 10, tasks expand_prompt, pixel_shuffle and gather: an image becomes tokens (its placeholder's expansion at
admission), rows of the LLaMA's width (the connector's pixel shuffle), and rows of the step's flattened batch (the
merge).

The engine calls them as `tinyvllm.engine.multimodal.expand_prompt` (every prompt with images, when it is added),
`VisionTower.pixel_shuffle` (tinyvllm/model/vision.py: every frame an Idefics3 tower encodes) and
`EncoderRunner.gather` (tinyvllm/worker/encoder_runner.py: every step whose tokens include image positions).
Chapter: docs/phases/10-images.md ("Build it"). Grade: make course P=10
"""

from __future__ import annotations

import numpy as np  # noqa: F401  (yours to use)
from tinygrad import Tensor


def expand_prompt(prompt: str, placeholder: str, texts: list[str]) -> str:
    """The prompt with its i-th `placeholder` replaced by texts[i]; a ValueError naming both counts when the prompt
    has not exactly len(texts) placeholders (the message must contain "placeholder").

        expand_prompt("a <image> b <image>", "<image>", ["X", "YY"]) -> "a X b YY"
    """
    raise NotImplementedError("course/phase10/images.py: expand_prompt is yours to write")


def pixel_shuffle(self, x: Tensor) -> Tensor:
    """(F, P, D) patch rows -> (F, P / s^2, s^2 * D): each s x s square of neighbouring patches becomes one row, as
    HF's Idefics3Connector folds them. s = self.config.scale_factor; the P patches are an n x n grid in row-major
    order, n = self.config.patches_per_side.

    Row (i, j) of the output (i, j < n/s, row-major) is the concatenation, over the square's patch rows a < s, of
    the s patches (s*i + a, s*j .. s*j + s - 1) side by side: reshape (F, n, n/s, s*D), swap axes 1 and 2, reshape
    (F, n/s, n/s, s*s*D), swap axes 1 and 2 again, reshape (F, P/s^2, s*s*D).
    """
    raise NotImplementedError("course/phase10/images.py: pixel_shuffle is yours to write")


def gather(self, chunks: list, embeds: np.ndarray, mask: np.ndarray) -> bool:
    """Fill the step's image rows: for each (seq, start, count, row) of `chunks` (tokens start .. start+count-1 of
    seq at flat rows row ..), and each feature of seq.mm_features whose span overlaps them (feature.overlaps(a, b)),
    copy the encoder's rows (self.encoder_output(feature), one per True of feature.is_embed over its span
    offset .. offset + length - 1) into embeds at those tokens' flat rows, and set mask there to 1. Rows of the
    span before `start` were taken by earlier chunks: the first row to copy is the count of True in
    feature.is_embed[:start - offset]. Clear mask first; return whether any row is an image's.
    """
    raise NotImplementedError("course/phase10/images.py: gather is yours to write")
