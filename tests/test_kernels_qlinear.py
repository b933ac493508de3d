"""The fused dequant-matmul kernels (kernels/cpu/qmatmul.c, qmatmul_k.c) and qlinear.py, against numpy.

Two oracles, for every format at M = 1, 3, 37 and N not a multiple of the tiles:
  (a) a numpy reference that quantizes x exactly as the kernel does (8-bit blocks, rint, float32 scales) and then
      computes the block sums in float64: the kernel must agree to float32 rounding;
  (b) the float product x @ W.T with W from tinyvllm.model.quant.dequantize (bit-exact with the `gguf` package):
      the kernel may differ only by what rounding x to 8 bits allows (the bound is derived in `activation_bound`).
Blocks are random with valid float16 scales (and random 6-bit / int8 sub-block scales for the K-quants), plus real
tensors of the default model's GGUF (Q4_1 layers, the Q8_0 token embedding).
"""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes

from tinyvllm.kernels import cpu_threads, launcher
from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.qlinear import (
    QUANT_FORMATS,
    QuantizedWeight,
    dequantize_weight,
    embedding,
    qlinear,
    scratch_bytes,
    uses_kernel,
)
from tinyvllm.model.quant import _k_scales_mins, dequantize

FORMATS = list(QUANT_FORMATS)  # 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K
needs_kernel = pytest.mark.skipif(not launcher.has_kernel("qmatmul", Device.DEFAULT), reason="no C kernel here")


# ---- random blocks with valid scales ----

def f16_bytes(values: np.ndarray) -> np.ndarray:
    """float values -> (..., 2) uint8: their float16 bytes."""
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(ggml_type: int, N: int, K: int, seed: int) -> np.ndarray:
    """(N, K // block_size * type_size) uint8: random quants, float16 scales of the size real weights have."""
    fmt = QUANT_FORMATS[ggml_type]
    rng = np.random.default_rng(seed)
    nb = K // fmt.block_size
    b = rng.integers(0, 256, (N, nb, fmt.type_size), dtype=np.uint8)  # quants, and the 6-bit / int8 sub-scales
    scale = lambda lo, hi: f16_bytes(rng.uniform(lo, hi, (N, nb)))  # noqa: E731
    if ggml_type in (2, 3, 8):
        b[..., 0:2] = scale(0.001, 0.02)  # d
    if ggml_type == 3:
        b[..., 2:4] = scale(-0.15, 0.0)  # m: the block's minimum, usually negative
    if ggml_type == 12:
        b[..., 0:2], b[..., 2:4] = scale(0.0005, 0.002), scale(0.0005, 0.002)  # d, dmin
    if ggml_type == 14:
        b[..., 208:210] = scale(0.0001, 0.0005)  # d
    return b.reshape(N, -1)


def weight(blocks: np.ndarray, ggml_type: int, K: int) -> QuantizedWeight:
    return QuantizedWeight(Tensor(np.ascontiguousarray(blocks)).realize(), ggml_type, (blocks.shape[0], K))


# ---- oracle (a): the kernel's arithmetic in numpy ----

def quantize_x(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(M, K) float32 -> q (M, K/block, block) int64, d (M, K/block) float32, in float32 as the kernels do:
    d = max|x| / 127, q = rint(x * (127 / max|x|)) (round half to even, as _mm256_round_ps)."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)


def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def reference(x: np.ndarray, blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """out (M, N) in float64 from x quantized as the kernel quantizes it, and w's blocks taken apart."""
    fmt = QUANT_FORMATS[ggml_type]
    N, K = blocks.shape[0], x.shape[1]
    b = blocks.reshape(N, K // fmt.block_size, fmt.type_size)
    if fmt.block_size == 32:
        qx, dx = quantize_x(x, 32)
        dw = f16(b, 0)
        if ggml_type == 8:
            qw, mw = b[..., 2:].view(np.int8).astype(np.int64), np.zeros_like(dw)
        else:
            qs = b[..., 4:] if ggml_type == 3 else b[..., 2:]
            qw = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
            mw = f16(b, 2) if ggml_type == 3 else -8 * dw
        sx = dx * qx.sum(-1).astype(np.float32)  # the kernel's s = d * sum(q), in float32
        dots = np.einsum("mbk,nbk->mnb", qx, qw)  # exact integers
        return np.einsum("nb,mb,mnb->mn", dw, dx.astype(np.float64), dots) + sx.astype(np.float64) @ mw.T
    qx, dx = quantize_x(x, 256)
    nb = b.shape[1]
    if ggml_type == 12:  # w = d * sc * q - dmin * m per 32-element sub-block
        sc, mn = _k_scales_mins(b.reshape(-1, 144)[:, 4:16])
        sc, mn = sc.reshape(N, nb, 8).astype(np.int64), mn.reshape(N, nb, 8).astype(np.int64)
        qs = b[..., 16:].reshape(N, nb, 4, 32)
        qw = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, nb, 8, 32).astype(np.int64)
        qxs = qx.reshape(*qx.shape[:2], 8, 32)
        isum = np.einsum("nbj,mbjk,nbjk->mnb", sc, qxs, qw)
        msum = np.einsum("nbj,mbj->mnb", mn, qxs.sum(-1))
        return np.einsum("mb,mnb->mn", dx.astype(np.float64), f16(b, 0)[None] * isum - f16(b, 2)[None] * msum)
    # Q6_K: w = d * sc * (q - 32) per 16-element sub-block, q = 4 low bits (ql) | 2 high bits (qh) << 4
    ql, qh = b[..., 0:128].reshape(N, nb, 2, 64), b[..., 128:192].reshape(N, nb, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # (N, nb, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(N, nb, 2, 128)
    qw = ((low | (high << 4)).astype(np.int64) - 32).reshape(N, nb, 16, 16)
    sc = b[..., 192:208].view(np.int8).astype(np.int64)  # (N, nb, 16)
    isum = np.einsum("nbj,mbjk,nbjk->mnb", sc, qx.reshape(*qx.shape[:2], 16, 16), qw)
    return np.einsum("mb,nb,mnb->mn", dx.astype(np.float64), f16(b, 208), isum)


# ---- oracle (b): the float product, and the error the 8-bit activations allow ----

def activation_bound(x: np.ndarray, W: np.ndarray, block: int) -> np.ndarray:
    """|kernel - x @ W.T| <= this, per output (M, N).

    x is rounded per block of `block` elements to q * d with d = max|x| / 127 and q = rint(x / d), so each element
    moves by at most d / 2 (plus float32 rounding of x * (127 / max): a relative 2^-23, well inside 1e-5):
        |sum_k W[n,k] (x[m,k] - q d)| <= sum over blocks b of (d_b / 2) * sum_{k in b} |W[n,k]|
    The weights themselves are exact (the kernel reads the same numbers dequantize returns); the block sums in
    float32 add |x| @ |W|.T * 1e-5 (K/32 <= 64 terms per output, each rounded at 2^-24, with room to spare)."""
    M, K = x.shape
    d = np.abs(x.reshape(M, -1, block)).max(axis=-1).astype(np.float64) / 127  # (M, blocks)
    wsum = np.abs(W.astype(np.float64)).reshape(W.shape[0], -1, block).sum(axis=-1)  # (N, blocks)
    return (d / 2 * (1 + 1e-5)) @ wsum.T + 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(W.T).astype(np.float64))


def check_both_oracles(out: np.ndarray, x: np.ndarray, blocks: np.ndarray, ggml_type: int) -> None:
    fmt = QUANT_FORMATS[ggml_type]
    N, K = blocks.shape[0], x.shape[1]
    ref = reference(x, blocks, ggml_type)
    W = dequantize(blocks.reshape(-1), ggml_type, (N, K))
    magnitude = np.abs(x).astype(np.float64) @ np.abs(W.T).astype(np.float64)  # sum_k |x w|: what rounding scales
    # (a) float32 rounding only: ~K/32 block sums each rounded at 2^-24 stay far inside 1e-5 of the magnitudes
    np.testing.assert_array_less(np.abs(out - ref), 1e-5 * magnitude + 1e-30)
    # (b) within what the 8-bit activations allow of the float product
    exact = x.astype(np.float64) @ W.T.astype(np.float64)
    np.testing.assert_array_less(np.abs(out - exact), activation_bound(x, W, fmt.block_size))


SHAPES = {32: [(37, 96), (7, 576)], 256: [(37, 512), (5, 256)]}  # N not a multiple of the 4- and 2-row tiles


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 37])
@pytest.mark.parametrize("ggml_type", FORMATS, ids=[QUANT_FORMATS[t].name for t in FORMATS])
def test_kernel_matches_both_oracles(ggml_type: int, M: int):
    for N, K in SHAPES[QUANT_FORMATS[ggml_type].block_size]:
        blocks = random_blocks(ggml_type, N, K, seed=N + ggml_type)
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        w, xt = weight(blocks, ggml_type, K), Tensor(x).realize()
        assert uses_kernel(xt, w)
        check_both_oracles(qlinear(xt, w).numpy(), x, blocks, ggml_type)
