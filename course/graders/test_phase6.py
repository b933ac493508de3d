"""Phase 6's graders: three of GGUF's 32-element block formats dequantized (course/phase6/), on blocks written by
hand (each element's value known) and on a weight quantized by the project's quantizer, through
`quant.dequantize`, the entry the loader calls. Numpy only, no device."""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.model import quant
from tinyvllm.model.quantizer import quantize

Q8_0, Q4_1, Q5_0 = 8, 3, 6


def f16(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def nibbles(q: np.ndarray) -> np.ndarray:
    """32 values 0..15 -> 16 bytes: q[j] in byte j's lo nibble, q[j + 16] in its hi nibble."""
    return (q[:16] | (q[16:] << 4)).astype(np.uint8)


def check(ggml_type: int, blocks: list[np.ndarray], expected: np.ndarray, what: str) -> None:
    data = np.concatenate(blocks)
    got = quant.dequantize(data, ggml_type, expected.shape)
    assert got.dtype == np.float32, f"{what}: float32 expected, got {got.dtype}"
    wrong = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))
    assert not len(wrong), (f"{what}: element {wrong[0] % 32} of block {wrong[0] // 32} should be "
                            f"{expected.reshape(-1)[wrong[0]]:g}, got {got.reshape(-1)[wrong[0]]:g} "
                            f"({len(wrong)} of {expected.size} elements wrong)")


def matches_the_project(ggml_type: int, project_code, name: str) -> None:
    x = np.random.default_rng(ggml_type).standard_normal((4, 64)).astype(np.float32)
    data = quantize(x, ggml_type)
    got = quant.dequantize(data.reshape(-1), ggml_type, x.shape)
    with project_code():
        expected = quant.dequantize(data.reshape(-1), ggml_type, x.shape)
    err = np.abs(got - expected).max()
    assert err == 0, f"{name} of a quantized (4, 64) weight differs from the reference by up to {err:g}"


# ---- dequantize_q8_0 ----

@pytest.mark.task("dequantize_q8_0")
def test_q8_0_by_hand():
    q = np.arange(-16, 16, dtype=np.int8)
    blocks = [np.concatenate([f16(0.5), q.view(np.uint8)]), np.concatenate([f16(-2.0), q[::-1].view(np.uint8)])]
    expected = np.stack([0.5 * q, -2.0 * q[::-1]]).astype(np.float32)
    check(Q8_0, blocks, expected, "Q8_0 blocks d = 0.5 and d = -2, q = -16..15 (signed bytes)")


@pytest.mark.task("dequantize_q8_0")
def test_q8_0_matches_the_reference(learner_code):
    matches_the_project(Q8_0, learner_code, "Q8_0")


# ---- dequantize_q4_1 ----

@pytest.mark.task("dequantize_q4_1")
def test_q4_1_by_hand():
    q = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.uint8)
    blocks = [np.concatenate([f16(0.25), f16(-1.0), nibbles(q)])]
    expected = (0.25 * q - 1.0).astype(np.float32)[None]
    check(Q4_1, blocks, expected, "Q4_1, d = 0.25, m = -1, q = 0..15 in the lo nibbles, 15..0 in the hi")


@pytest.mark.task("dequantize_q4_1")
def test_q4_1_matches_the_reference(learner_code):
    matches_the_project(Q4_1, learner_code, "Q4_1")


# ---- dequantize_q5_0 ----

@pytest.mark.task("dequantize_q5_0")
def test_q5_0_by_hand():
    q = (np.arange(32) * 7 % 32).astype(np.uint32)  # every value 0..31 once, the fifth bits scattered
    qh = np.array([int(((q >> 4) & 1) @ (1 << np.arange(32, dtype=np.uint64)))], dtype=np.uint32).view(np.uint8)
    blocks = [np.concatenate([f16(0.125), qh, nibbles((q & 15).astype(np.uint8))])]
    expected = (0.125 * (q.astype(np.float32) - 16)).astype(np.float32)[None]
    check(Q5_0, blocks, expected, "Q5_0, d = 0.125, q = 7j mod 32 (fifth bits in the u32 at bytes 2..5)")


@pytest.mark.task("dequantize_q5_0")
def test_q5_0_matches_the_reference(learner_code):
    matches_the_project(Q5_0, learner_code, "Q5_0")
