"""Phase 10's graders: a placeholder expanded, the connector's pixel shuffle, image rows merged into the flattened
batch (course/phase10/). Numpy and tiny tensors: no checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from tinyvllm.core.encoder_cache import MultiModalFeature
from tinyvllm.engine import multimodal
from tinyvllm.model.vision import VisionTower
from tinyvllm.worker.encoder_runner import EncoderRunner


# ---- expand_prompt ----

@pytest.mark.task("expand_prompt")
def test_each_placeholder_becomes_its_images_text_in_order():
    got = multimodal.expand_prompt("a <image> b <image>", "<image>", ["X", "YY"])
    assert got == "a X b YY", f"each placeholder replaced by its own text, in order; got {got!r}"
    got = multimodal.expand_prompt("<image><image>", "<image>", ["<image><image>", "Z"])
    assert got == "<image><image>Z", f"an image's text may hold the placeholder again: split once; got {got!r}"
    assert multimodal.expand_prompt("plain", "<image>", []) == "plain"


@pytest.mark.task("expand_prompt")
def test_a_count_mismatch_names_both_counts():
    for prompt, texts in (("<image> and", ["a", "b"]), ("<image> <image>", ["a"])):
        with pytest.raises(ValueError, match="placeholder") as e:
            multimodal.expand_prompt(prompt, "<image>", texts)
        message = str(e.value)
        assert str(prompt.count("<image>")) in message and str(len(texts)) in message, (
            f"the message names the prompt's placeholders and the images given; got {message!r}")


# ---- pixel_shuffle ----

class Config:
    def __init__(self, n: int, s: int):
        self.patches_per_side, self.scale_factor = n, s


def reference_shuffle(x: np.ndarray, n: int, s: int) -> np.ndarray:
    F, P, D = x.shape
    grid = x.reshape(F, n, n, D)
    out = np.zeros((F, (n // s) ** 2, s * s * D), x.dtype)
    for i in range(n // s):
        for j in range(n // s):
            rows = [grid[:, s * i + a, s * j:s * j + s].reshape(F, s * D) for a in range(s)]
            out[:, i * (n // s) + j] = np.concatenate(rows, axis=-1)
    return out


@pytest.mark.task("pixel_shuffle")
@pytest.mark.parametrize("n,s", [(4, 2), (6, 3), (8, 2)])
def test_each_square_of_patches_is_one_row(n, s):
    x = np.random.default_rng(n * s).standard_normal((2, n * n, 3)).astype(np.float32)
    tower = VisionTower.__new__(VisionTower)
    tower.config = Config(n, s)
    got = tower.pixel_shuffle(Tensor(x)).numpy()
    assert got.shape == (2, n * n // s // s, s * s * 3), f"(F, P/s^2, s^2*D); got {got.shape}"
    np.testing.assert_array_equal(got, reference_shuffle(x, n, s),
                                  err_msg="square (i, j): its patch rows a < s side by side")


# ---- gather ----

class Tower:
    def encode(self, pixels):
        return np.arange(6, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32) + 1


class Seq:
    def __init__(self, *features):
        self.mm_features = list(features)


@pytest.mark.task("gather")
def test_a_chunk_fills_its_image_rows_and_the_mask():
    seq = Seq(MultiModalFeature("h", 3, np.array([1, 1, 0, 1, 1, 1, 1], bool), np.zeros(1)))
    runner, embeds, mask = EncoderRunner(Tower()), np.zeros((8, 2), np.float32), np.ones(8, np.int32)
    assert runner.gather([(seq, 0, 6, 2)], embeds, mask), "image rows in the step: True"
    assert mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 0], f"positions 3, 4 at flat rows 5, 6 (mask cleared first); {mask}"
    assert embeds[5:7, 0].tolist() == [1, 2], f"the encoder's rows 0 and 1 there; got {embeds[5:7, 0]}"


@pytest.mark.task("gather")
def test_the_next_chunk_continues_where_the_last_stopped():
    seq = Seq(MultiModalFeature("h", 3, np.array([1, 1, 0, 1, 1, 1, 1], bool), np.zeros(1)))
    runner, embeds, mask = EncoderRunner(Tower()), np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
    runner.gather([(seq, 0, 6, 2)], embeds, mask)
    assert runner.gather([(seq, 6, 4, 0)], embeds, mask)
    assert mask.tolist() == [1, 1, 1, 1, 0, 0, 0, 0], f"positions 6..9 are image rows 2..5; mask {mask}"
    assert embeds[:4, 0].tolist() == [3, 4, 5, 6], f"rows after the 2 earlier chunks took; got {embeds[:4, 0]}"
    assert runner.num_encoder_runs == 1, "the encoder's output is kept between chunks (encoder_output)"


@pytest.mark.task("gather")
def test_text_chunks_and_two_requests_in_one_batch():
    a = Seq(MultiModalFeature("a", 1, np.ones(2, bool), np.zeros(1)))
    text = Seq()
    runner, embeds, mask = EncoderRunner(Tower()), np.zeros((7, 2), np.float32), np.zeros(7, np.int32)
    assert not runner.gather([(text, 0, 3, 0)], embeds, mask), "a text-only step has no image rows: False"
    assert runner.gather([(text, 3, 2, 0), (a, 0, 4, 2), (text, 5, 1, 6)], embeds, mask)
    assert mask.tolist() == [0, 0, 0, 1, 1, 0, 0], f"request a's positions 1, 2 at flat rows 3, 4; mask {mask}"
