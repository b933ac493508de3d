"""Phase 6: the numpy quantizers (tinyvllm/model/quantizer.py, quantizer_search.py), bit-exact with ggml's.

Oracles: the `gguf` package (llama.cpp's own Python package: its `quants.quantize` follows ggml's reference
quantizers bit for bit) and digests of ggml's own output for the formats that search for their scales.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from tinyvllm.model.quant import dequantize  # noqa: E402
from tinyvllm.model.quantizer import quantize  # noqa: E402

TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3}


def block_test_data(rng: np.random.Generator) -> np.ndarray:
    """(64, 1024) float32 whose blocks span scales 1e-4..1e3 and hold the rounding edge cases."""
    x = (rng.standard_normal((64, 1024)) * 10.0 ** rng.uniform(-4, 3, (64, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0, q = 0
    x[1, :32] = np.arange(-16, 16) / 2  # exact halves: Q8_0 rounds them away from zero, Q4 types truncate +0.5
    x[1, 0] = -127 / 2  # so that Q8_0's d is exactly 0.5 and x / d lands on .5 ties
    x[2, :32] = -x[2, :32].max()  # every element the same: Q4_1's d is 0
    x[3, :32], x[3, 5], x[3, 9] = 0.1, 2.0, -2.0  # +amax and -amax both present: the first wins (Q4_0)
    x[4, :32] = rng.uniform(-1, 1, 32).astype(np.float32) * np.float32(1e-30)  # scales below float16's range
    return x


@pytest.mark.parametrize("name", list(TYPES))
def test_quantize_is_bit_exact_with_gguf(name):
    x = block_test_data(np.random.default_rng(TYPES[name]))
    got = quantize(x, TYPES[name])
    expected = gguf_quantize(x, GGMLQuantizationType(TYPES[name]))
    type_size = {8: 34, 2: 18, 3: 20}[TYPES[name]]
    assert got.dtype == np.uint8 and got.shape == expected.shape == (64, 1024 // 32 * type_size)
    np.testing.assert_array_equal(got, expected)
    # many threads over chunks give the same bytes as one call per row (a row is one chunk)
    np.testing.assert_array_equal(np.concatenate([quantize(row[None], TYPES[name]) for row in x]), got)


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_quantize_within_half_a_step(name):
    """|x - dequantize(quantize(x))| <= step/2, plus what the float16 rounding of the scale (and min) adds.

    A block's q is x/d rounded to nearest, so x = d * (q + e) with |e| <= 1/2. The file keeps d16 = float16(d),
    so the dequantized value is off by d * e + (d - d16) * q: at most d/2 + |d - d16| * |q| (Q8_0, Q4_0);
    Q4_1 adds |m - m16|. Q4_0 is the exception: its range is -8d..+7d, so an element of the opposite sign to
    the block's largest one that reaches past +7.5d (x / d up to +8) clamps to q = 15: a full step at most."""
    ggml_type = TYPES[name]
    x = block_test_data(np.random.default_rng(10 + ggml_type))
    raw = quantize(x, ggml_type)
    back = dequantize(raw.reshape(-1), ggml_type, x.shape).reshape(-1, 32)
    blocks = x.reshape(-1, 32).astype(np.float64)
    stored = raw.reshape(-1, raw.shape[-1] // (1024 // 32))
    d16 = stored[:, 0:2].copy().view(np.float16).astype(np.float64)  # (n, 1)
    if ggml_type == 8:
        d = np.abs(blocks).max(axis=1, keepdims=True) / 127
        q = stored[:, 2:].view(np.int8).astype(np.float64)
        bound = d / 2 + np.abs(d - d16) * np.abs(q)
    elif ggml_type == 2:
        big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = big / -8
        q = np.concatenate([stored[:, 2:] & 15, stored[:, 2:] >> 4], axis=1).astype(np.float64) - 8
        over = np.divide(blocks, d, out=np.zeros_like(blocks), where=d != 0) > 7.5  # clamped to q = 15 - 8
        bound = np.where(over, np.abs(d), np.abs(d) / 2) + np.abs(d - d16) * np.abs(q)
    else:
        lo = blocks.min(axis=1, keepdims=True)
        d = (blocks.max(axis=1, keepdims=True) - lo) / 15
        m16 = stored[:, 2:4].copy().view(np.float16).astype(np.float64)
        q = np.concatenate([stored[:, 4:] & 15, stored[:, 4:] >> 4], axis=1).astype(np.float64)
        bound = d / 2 + np.abs(d - d16) * q + np.abs(lo - m16)
    err = np.abs(back - blocks)
    tolerance = 1e-6 * np.abs(blocks) + 1e-45  # float32 arithmetic on the way
    assert (err <= bound + tolerance).all(), float((err - bound).max())
    if ggml_type != 2:  # and the bound is not loose: some element sits near half a step
        assert (err > 0.4 * d).any()


def searching_test_data(rows: int = 48, cols: int = 1024) -> np.ndarray:
    """(rows, cols) float32 made by integer arithmetic alone (the same bits on every machine and numpy version): sums
    of four 16-bit uniforms of a 64-bit hash, roughly Gaussian, each row scaled by a power of two from 2^-31 to 2^-14;
    then edge blocks: zeros, one spike, all equal, values near float32's smallest."""
    n = rows * cols * 4
    state = np.uint64(0x9E3779B97F4A7C15) * (np.arange(n, dtype=np.uint64) + np.uint64(1))
    state ^= state >> np.uint64(29)
    state *= np.uint64(0xBF58476D1CE4E5B9)
    state ^= state >> np.uint64(32)
    u = (state & np.uint64(0xFFFF)).astype(np.int64).reshape(rows, cols, 4).sum(-1) - 2 * 65535
    x = (u * np.exp2(np.arange(rows) % 18 - 31.0)[:, None]).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = 0
    x[1, 7] = 1.0
    x[2, :256] = -0.25
    x[3, :256] *= np.float32(2.0 ** -100)
    return x


# sha256 of what ggml's own quantizers (libggml-base, ggml_quantize_chunk: what llama-quantize runs without an
# importance matrix) write for searching_test_data(); IQ4_NL's reference variant (ntry -1) on rows 4.. (its blocks of
# zeros keep whatever ggml's stack held)
GGML_DIGESTS = {
    6: "be31bb16485c3362b271bc744dad22ab77c75d12d7bf52b76adb12e9b1838417",  # Q5_0
    12: "c9b2bbf4df67d672958ea5c962ae1ed9ab9c4ae4d8ed7f07c2a5c8163a8fd9f7",  # Q4_K
    20: "adbeda489b939af2bd1ee0b442ea32925de12fdfa939005d8b2c88ef87d86e9c",  # IQ4_NL
    "iq4_nl_ref": "7c60e8f644a8eca610118b189517805da8767af7b1d5f2633f4ddfbd082d6b48",
}


@pytest.mark.parametrize("ggml_type", [6, 12, 20], ids=["Q5_0", "Q4_K", "IQ4_NL"])
def test_quantize_is_bit_exact_with_ggml(ggml_type):
    import hashlib
    x = searching_test_data()
    got = quantize(x, ggml_type)
    assert hashlib.sha256(got.tobytes()).hexdigest() == GGML_DIGESTS[ggml_type]
    if ggml_type == 6:  # and with the gguf package, on the other test data
        y = block_test_data(np.random.default_rng(6))
        np.testing.assert_array_equal(quantize(y, 6), gguf_quantize(y, GGMLQuantizationType.Q5_0))


def test_iq4_nl_reference_variant():
    import hashlib
    from tinyvllm.model.quantizer_search import quantize_iq4_nl
    x = np.ascontiguousarray(searching_test_data()[4:])
    out = np.empty((x.size // 32, 18), np.uint8)
    quantize_iq4_nl(x.reshape(-1, 32), out, ntry=-1)
    assert hashlib.sha256(out.tobytes()).hexdigest() == GGML_DIGESTS["iq4_nl_ref"]


def test_iq4_nl_search_beats_the_plain_scale():
    """Each block's scale and assignment fit x at least as well (weighted by x^2, ggml's measure) as the plain
    scale max / 127 with every x rounded to its nearest value: the search only keeps better fits (to within the
    float16 rounding of the scale: blocks whose scale float16 holds to 11 bits)."""
    x = block_test_data(np.random.default_rng(20))[5:].reshape(-1, 32).astype(np.float64)
    x = x[np.abs(x).max(axis=1) / 127 > 2.0 ** -10]
    back = dequantize(quantize(x.astype(np.float32), 20).reshape(-1), 20, x.shape).astype(np.float64)
    values = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = big / -127
    plain = values[np.abs(x[..., None] / d[..., None] - values).argmin(-1)] * d
    weighted = lambda y: (x * x * (y - x) ** 2).sum(1)  # noqa: E731
    assert (weighted(back) <= weighted(plain) * (1 + 1e-2) + 1e-30).all()


def test_quantize_errors():
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"ggml type 14 \(Q6_K\); supported: Q4_0 \(2\), Q4_1 \(3\)"):
        quantize(x, 14)
    with pytest.raises(ValueError, match=r"multiple of 32 elements, got shape \(2, 48\)"):
        quantize(np.ones((2, 48), np.float32), 8)
    with pytest.raises(ValueError, match="float weights, got dtype int32"):
        quantize(np.ones((2, 64), np.int32), 8)
    for bad in (np.nan, np.inf, 1e9):
        y = x.copy()
        y[1, 40] = bad
        for ggml_type in (*TYPES.values(), 6, 20):
            with pytest.raises(ValueError, match="float16 cannot hold"):
                quantize(y, ggml_type)
        y256 = np.ones((2, 256), np.float32)
        y256[1, 40] = bad
        with pytest.raises(ValueError, match="float16 cannot hold"):
            quantize(y256, 12)
    assert quantize(np.zeros((0, 64), np.float32), 3).shape == (0, 40)
    np.testing.assert_array_equal(quantize(x.astype(np.float16), 8), quantize(x, 8))  # float16 in: widened first
