"""The fused dequant-matmul kernels (kernels/cpu/qmatmul.c, qmatmul_k.c) and qlinear.py, against numpy.

Two oracles, for every format at M = 1, 3, 37 and N not a multiple of the tiles:
  (a) a numpy reference that quantizes x exactly as the kernel does (8-bit blocks, rint, float32 scales) and then
      computes the block sums in float64: the kernel must agree to float32 rounding (from FLOAT_PATH_MIN_M rows
      on, Q4_0/Q4_1/Q8_0 multiply dequantized weights in float32 instead: there the reference is the float product);
  (b) the float product x @ W.T with W from tinyvllm.model.quant.dequantize (bit-exact with the `gguf` package):
      the kernel may differ only by what rounding x to 8 bits allows (the bound is derived in `activation_bound`).
Blocks are random with valid float16 scales (and random 6-bit / int8 sub-block scales for the K-quants), plus real
tensors of the default model's GGUF (Q4_1 layers, the Q8_0 token embedding).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes

from tinyvllm.kernels import cpu_threads, launcher
from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.qlinear import (
    FLOAT_PATH_MIN_M,
    uses_float_path,
    QUANT_FORMATS,
    QuantizedWeight,
    dequantize_weight,
    embedding,
    qlinear,
    scratch_bytes,
    uses_kernel,
)
from tinyvllm.model.quant import IQ4NL_VALUES, _k_scales_mins, _q3_k_scales, dequantize

FORMATS = list(QUANT_FORMATS)  # ggml type ids: 2 Q4_0, 3 Q4_1, 6 Q5_0, 8 Q8_0, 12 Q4_K, 14 Q6_K, ...
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
    if fmt.block_size == 32:
        b[..., 0:2] = scale(0.001, 0.02)  # d
    if ggml_type in (3, 7):
        b[..., 2:4] = scale(-0.15, 0.0)  # m: the block's minimum, usually negative
    if ggml_type in (12, 13):
        b[..., 0:2], b[..., 2:4] = scale(0.0005, 0.002), scale(0.0005, 0.002)  # d, dmin
    if ggml_type == 14:
        b[..., 208:210] = scale(0.0001, 0.0005)  # d
    if ggml_type == 23:
        b[..., 0:2] = scale(0.00002, 0.0001)  # d
    if ggml_type == 10:
        b[..., 80:82], b[..., 82:84] = scale(0.002, 0.01), scale(0.001, 0.005)  # d, dmin
    if ggml_type == 11:
        b[..., 108:110] = scale(0.0005, 0.002)  # d
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


def block_integers(b: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 32-element format's blocks (N, nb, type_size) taken apart: w = d * q + m per block, q (N, nb, 32) int64,
    d and m (N, nb) float64."""
    dw = f16(b, 0)
    if ggml_type == 8:
        return b[..., 2:].view(np.int8).astype(np.int64), dw, np.zeros_like(dw)
    if ggml_type == 20:  # IQ4_NL: the nibbles index 16 values
        qs = b[..., 2:]
        return IQ4NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].astype(np.int64), dw, np.zeros_like(dw)
    qs = b[..., {2: 2, 3: 4, 6: 6, 7: 8}[ggml_type]:]
    qw = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    if ggml_type in (6, 7):  # Q5: bit k of the u32 before the nibbles is element k's fifth bit
        qh = b[..., {6: 2, 7: 4}[ggml_type]:][..., :4].copy().view(np.uint32)  # (N, nb, 1)
        qw |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
    mw = f16(b, 2) if ggml_type in (3, 7) else {2: -8, 6: -16}[ggml_type] * dw
    return qw, dw, mw


def reference(x: np.ndarray, blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """out (M, N) in float64 from x quantized as the kernel quantizes it, and w's blocks taken apart."""
    fmt = QUANT_FORMATS[ggml_type]
    N, K = blocks.shape[0], x.shape[1]
    b = blocks.reshape(N, K // fmt.block_size, fmt.type_size)
    if fmt.block_size == 32:
        qx, dx = quantize_x(x, 32)
        qw, dw, mw = block_integers(b, ggml_type)
        sx = dx * qx.sum(-1).astype(np.float32)  # the kernel's s = d * sum(q), in float32
        dots = np.einsum("mbk,nbk->mnb", qx, qw)  # exact integers
        return np.einsum("nb,mb,mnb->mn", dw, dx.astype(np.float64), dots) + sx.astype(np.float64) @ mw.T
    qx, dx = quantize_x(x, 256)
    nb = b.shape[1]
    if ggml_type in (12, 13):  # w = d * sc * q - dmin * m per 32-element sub-block
        sc, mn = _k_scales_mins(b.reshape(-1, fmt.type_size)[:, 4:16])
        sc, mn = sc.reshape(N, nb, 8).astype(np.int64), mn.reshape(N, nb, 8).astype(np.int64)
        qs = b[..., 16 if ggml_type == 12 else 48:].reshape(N, nb, 4, 32)
        qw = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, nb, 8, 32).astype(np.int64)
        if ggml_type == 13:  # Q5_K: bit s of qh[l] is element l of sub-block s's fifth bit
            qh = b[..., 16:48].reshape(N, nb, 1, 32)
            qw |= ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int64) << 4
        qxs = qx.reshape(*qx.shape[:2], 8, 32)
        isum = np.einsum("nbj,mbjk,nbjk->mnb", sc, qxs, qw)
        msum = np.einsum("nbj,mbj->mnb", mn, qxs.sum(-1))
        return np.einsum("mb,mnb->mn", dx.astype(np.float64), f16(b, 0)[None] * isum - f16(b, 2)[None] * msum)
    if ggml_type in (10, 11):  # per 16: Q2_K w = d * sc * q - dmin * m, Q3_K w = d * (sc - 32) * (q - 4)
        qs = b[..., 16:80] if ggml_type == 10 else b[..., 32:96]
        qw = ((qs.reshape(N, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3)
        qw = qw.reshape(N, nb, 16, 16).astype(np.int64)
        qxs = qx.reshape(*qx.shape[:2], 16, 16)
        if ggml_type == 10:
            sc, mn = (b[..., 0:16] & 15).astype(np.int64), (b[..., 0:16] >> 4).astype(np.int64)
            isum = np.einsum("nbj,mbjk,nbjk->mnb", sc, qxs, qw)
            msum = np.einsum("nbj,mbj->mnb", mn, qxs.sum(-1))
            return np.einsum("mb,mnb->mn", dx.astype(np.float64), f16(b, 80)[None] * isum - f16(b, 82)[None] * msum)
        hbit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (N, nb, 8, 32)
        qw = qw - 4 * (1 - hbit.reshape(N, nb, 16, 16).astype(np.int64))
        sc = _q3_k_scales(b.reshape(-1, 110)[:, 96:108]).reshape(N, nb, 16).astype(np.int64)
        isum = np.einsum("nbj,mbjk,nbjk->mnb", sc, qxs, qw)
        return np.einsum("mb,nb,mnb->mn", dx.astype(np.float64), f16(b, 108), isum)
    if ggml_type == 23:  # IQ4_XS: w = d * (sc - 32) * values[q] per 32-element sub-block
        high = b[..., 2:4].copy().view(np.uint16)  # (N, nb, 1)
        sc = ((b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(N, nb, 8) & 15).astype(np.int64)
        sc |= ((high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.int64) << 4
        qs = b[..., 8:].reshape(N, nb, 8, 16)
        qw = IQ4NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].astype(np.int64)  # (N, nb, 8, 32)
        isum = np.einsum("nbj,mbjk,nbjk->mnb", sc - 32, qx.reshape(*qx.shape[:2], 8, 32), qw)
        return np.einsum("mb,nb,mnb->mn", dx.astype(np.float64), f16(b, 0), isum)
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


def check_both_oracles(out: np.ndarray, x: np.ndarray, blocks: np.ndarray, ggml_type: int,
                       float_path: bool | None = None) -> None:
    fmt = QUANT_FORMATS[ggml_type]
    N, K = blocks.shape[0], x.shape[1]
    W = dequantize(blocks.reshape(-1), ggml_type, (N, K))
    float_path = uses_float_path(fmt.kernel, x.shape[0]) if float_path is None else float_path
    ref = x.astype(np.float64) @ W.T.astype(np.float64) if float_path else reference(x, blocks, ggml_type)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(W.T).astype(np.float64)  # sum_k |x w|: what rounding scales
    # (a) float32 rounding only: ~K/32 block sums each rounded at 2^-24 stay far inside 1e-5 of the magnitudes
    np.testing.assert_array_less(np.abs(out - ref), 1e-5 * magnitude + 1e-30)
    # (b) within what the 8-bit activations allow of the float product
    exact = x.astype(np.float64) @ W.T.astype(np.float64)
    np.testing.assert_array_less(np.abs(out - exact), activation_bound(x, W, fmt.block_size))


SHAPES = {32: [(37, 96), (7, 576)], 256: [(37, 512), (5, 256)]}  # N not a multiple of the 4-, 3- and 2-row tiles


def test_float_path_is_off_unless_asked_for():
    source = (launcher.KERNELS_DIR / "cpu" / "qmatmul.c").read_text()
    assert "#define TV_FLOAT_MIN_M 0 " in source  # the kernel's own default: the integer route at every M
    if os.getenv("TINYVLLM_QMATMUL_FLOAT_MIN_M") is None:
        assert FLOAT_PATH_MIN_M == 0 and not uses_float_path("qmatmul", 10_000)


@needs_kernel
@pytest.mark.parametrize("ggml_type", FORMATS, ids=[QUANT_FORMATS[t].name for t in FORMATS])
def test_a_rows_result_does_not_depend_on_its_batch(ggml_type):
    """Batch invariance: row 0 of a 37-row product is bit-identical to the same row multiplied alone (M=1), and to
    it inside 2-, 5- and 11-row batches: the engine's batched requests equal the same requests run alone."""
    fmt = QUANT_FORMATS[ggml_type]
    N, K = SHAPES[fmt.block_size][0]
    blocks = random_blocks(ggml_type, N, K, seed=3)
    w = QuantizedWeight(Tensor(blocks), ggml_type, (N, K))
    x = np.random.default_rng(3).standard_normal((37, K), dtype=np.float32)
    alone = qlinear(Tensor(x[:1]), w).numpy()[0]
    for M in (2, 5, 11, 37):
        np.testing.assert_array_equal(qlinear(Tensor(x[:M]), w).numpy()[0], alone, err_msg=f"M={M}")


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


@needs_kernel
@pytest.mark.parametrize("ggml_type", FORMATS, ids=[QUANT_FORMATS[t].name for t in FORMATS])
def test_portable_c_path_matches_too(ggml_type: int):
    # TV_SCALAR compiles the kernels' plain-C loops (what a CPU without AVX2 runs) instead of the intrinsics
    fmt = QUANT_FORMATS[ggml_type]
    N, K = SHAPES[fmt.block_size][0]
    blocks = random_blocks(ggml_type, N, K, seed=7)
    # the integer path at 1, 3 and 37 rows, and (qmatmul.c, when a user turns it on) the float path at 37
    for M, float_min_m in ((1, 0), (3, 0), (37, 0), (37, 12)):
        x = np.random.default_rng(7).standard_normal((M, K), dtype=np.float32)
        out = Tensor.empty(M, N, dtype=dtypes.float32)
        scratch = Tensor.empty(scratch_bytes(ggml_type, M, K), dtype=dtypes.uint8)
        out, _ = launcher.launch(fmt.kernel, outs=[out, scratch], ins=[Tensor(x).realize(), Tensor(blocks).realize()],
                                 defines={"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type,
                                          "TV_FLOAT_MIN_M": float_min_m, "TV_SCALAR": 1})
        check_both_oracles(out.numpy(), x, blocks, ggml_type, float_path=float_min_m > 0 and fmt.kernel == "qmatmul")


QMATMUL_FORMATS = [t for t in FORMATS if QUANT_FORMATS[t].kernel == "qmatmul"]


@needs_kernel
@pytest.mark.parametrize("ggml_type", QMATMUL_FORMATS, ids=[QUANT_FORMATS[t].name for t in QMATMUL_FORMATS])
def test_avx512_and_avx2_routes(ggml_type: int):
    # qmatmul.c streams the weights at 1 row of x (AVX2's per-block route, two rows of w at a time), and from 2 rows
    # to 8 applies each streamed block to every row of x (the few rows: 5 and 3 take the masked loads of fewer than
    # 8 rows' scales); on a CPU with AVX-512 VNNI these use _mm256_dpbusd_epi32; TV_NO_VNNI
    # compiles AVX2's maddubs + madd. Each route must meet both oracles and be batch-invariant, and the two must give
    # the same bits: the same integer sums, then the same float operations in the same order. K=96: an odd number of
    # blocks (the 512-bit route's last block alone), K=1536: down_proj's, K=576: the model's width (18 blocks, the wide
    # tile's products 8 at a time and 2 alone). From M=9 on, AVX-512 takes the wide tile (Q8_0 6 x 4 outputs, Q4
    # 4 x 4): 9, 11 and 38 rows and 37, 19 and 11 rows of w leave every smaller tile at the edges (the other tests take
    # M=3's)
    for N, K in ((37, 96), (19, 1536), (11, 576)):
        blocks = random_blocks(ggml_type, N, K, seed=11)
        x = np.random.default_rng(K).standard_normal((50, K), dtype=np.float32)
        x[0, :32] *= 40.0  # a block whose 8-bit x reaches -127..127 against Q8_0's -128: the widest int16 pairs
        x[5, 40:] += 30.0  # large activations of one sign (down_proj's input): large dot and min terms that cancel
        routes = []
        for extra in ({}, {"TV_NO_VNNI": 1}):
            rows = {}
            for M in (1, 2, 3, 5, 8, 9, 11, 38, 50):  # (from 16 rows Q4, from 48 Q8_0: the pair blocks per chunk)
                out, scratch = Tensor.empty(M, N, dtype=dtypes.float32), Tensor.empty(
                    scratch_bytes(ggml_type, M, K), dtype=dtypes.uint8)
                out, _ = launcher.launch("qmatmul", outs=[out, scratch],
                                         ins=[Tensor(x[:M]).realize(), Tensor(blocks).realize()],
                                         defines={"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type, **extra})
                rows[M] = out.numpy()
                check_both_oracles(rows[M], x[:M], blocks, ggml_type)
                np.testing.assert_array_equal(rows[M][0], rows[1][0], err_msg=f"{extra} M={M}: row 0 moved")
            routes.append(rows[50])
        np.testing.assert_array_equal(routes[0], routes[1], err_msg=f"K={K}: the AVX-512 and AVX2 routes differ")


def model_tensor(name: str) -> tuple[np.ndarray, int, int]:
    """(blocks (N, row bytes), ggml type, K) of a tensor of the default model's GGUF; skips if it is not installed."""
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.quant import tensor_nbytes
    from tinyvllm.model.weights import default_model_path
    try:
        f = GGUFFile(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    info = f.tensors[name]
    data = f.raw(name, tensor_nbytes(info.ggml_type, info.shape))
    return np.array(data).reshape(info.shape[0], -1), info.ggml_type, info.shape[1]


@needs_kernel
@pytest.mark.parametrize("name,M", [("blk.0.attn_q.weight", 1), ("blk.0.ffn_down.weight", 32),
                                    ("blk.29.ffn_gate.weight", 3), ("token_embd.weight", 1)])
def test_real_model_tensors(name: str, M: int):
    # the shipped file: layers in Q4_1, the (tied) embedding in Q8_0, at the model's shapes
    blocks, ggml_type, K = model_tensor(name)
    assert QUANT_FORMATS[ggml_type].name == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
    x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
    check_both_oracles(qlinear(Tensor(x).realize(), weight(blocks, ggml_type, K)).numpy(), x, blocks, ggml_type)


@needs_kernel
@pytest.mark.parametrize("ggml_type", [6, 12, 20], ids=["Q5_0", "Q4_K", "IQ4_NL"])
def test_real_weights_requantized(ggml_type: int):
    # the shipped model's down_proj (576 x 1536) dequantized and quantized again by tinyvllm's own quantizers, as
    # --quantization q4_k (its Q5_0 fallback) and iq4_nl make them: real blocks, against both oracles, at one row
    # (the stream), at 9 (AVX-512's wide tile for the 32-element formats) and at 37
    from tinyvllm.model.quantizer import quantize
    blocks, src_type, K = model_tensor("blk.0.ffn_down.weight")
    floats = dequantize(blocks.reshape(-1), src_type, (blocks.shape[0], K))
    requantized = quantize(floats[:64], ggml_type)
    for M in (1, 9, 37):
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        out = qlinear(Tensor(x).realize(), weight(requantized, ggml_type, K)).numpy()
        check_both_oracles(out, x, requantized, ggml_type)


@needs_kernel
@pytest.mark.parametrize("ggml_type", FORMATS, ids=[QUANT_FORMATS[t].name for t in FORMATS])
def test_portable_path_matches_kernel(ggml_type: int, monkeypatch: pytest.MonkeyPatch):
    N, K = SHAPES[QUANT_FORMATS[ggml_type].block_size][0]
    blocks = random_blocks(ggml_type, N, K, seed=3)
    x = np.random.default_rng(3).standard_normal((2, 5, K), dtype=np.float32)  # leading dims (B,T,K) -> (B,T,N)
    w, xt = weight(blocks, ggml_type, K), Tensor(x).realize()
    kernel = qlinear(xt, w).numpy()
    monkeypatch.setattr(linear_module, "PORTABLE", True)
    assert not uses_kernel(xt, w)
    portable = qlinear(xt, w).numpy()
    assert portable.shape == kernel.shape == (2, 5, N)
    # the portable path is the float product (float32 rounding only); the kernel adds the 8-bit activation error
    W = dequantize(blocks.reshape(-1), ggml_type, (N, K))
    x2 = x.reshape(-1, K)
    bound = activation_bound(x2, W, QUANT_FORMATS[ggml_type].block_size)
    np.testing.assert_array_less(np.abs(kernel - portable).reshape(-1, N), bound)
    magnitude = np.abs(x2) @ np.abs(W.T)
    np.testing.assert_array_less(np.abs(portable.reshape(-1, N) - x2 @ W.T), 1e-5 * magnitude + 1e-30)


def test_symbolic_rows_take_portable_path():
    blocks = random_blocks(3, 9, 64, seed=4)
    w = weight(blocks, 3, 64)
    x = np.random.default_rng(4).standard_normal((8, 64), dtype=np.float32)
    v = UOp.variable("tokens", 1, 8).bind(3)
    xs = Tensor(x).realize()[:v]
    assert not uses_kernel(xs, w)
    out = qlinear(xs, w)[:3].numpy()
    W = dequantize(blocks.reshape(-1), 3, (9, 64))
    np.testing.assert_allclose(out, x[:3] @ W.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=[QUANT_FORMATS[t].name for t in FORMATS])
def test_embedding_rows_exact(ggml_type: int):
    N, K = SHAPES[QUANT_FORMATS[ggml_type].block_size][0]
    blocks = random_blocks(ggml_type, N, K, seed=5)
    ids = np.array([[3, 0, N - 1], [1, 1, 2]], dtype=np.int32)
    got = embedding(weight(blocks, ggml_type, K), Tensor(ids)).numpy()
    np.testing.assert_array_equal(got, dequantize(blocks.reshape(-1), ggml_type, (N, K))[ids])
    # and the whole weight, dequantized in tinygrad ops (the portable path's weight)
    np.testing.assert_array_equal(dequantize_weight(weight(blocks, ggml_type, K)).numpy(),
                                  dequantize(blocks.reshape(-1), ggml_type, (N, K)))


def test_embedding_of_the_real_token_embd():
    blocks, ggml_type, K = model_tensor("token_embd.weight")
    ids = np.array([[0, 1, 49151, 9690]], dtype=np.int32)
    got = embedding(weight(blocks, ggml_type, K), Tensor(ids)).numpy()
    np.testing.assert_array_equal(got, dequantize(blocks[ids[0]].reshape(-1), ggml_type, (4, K))[None])


@needs_kernel
def test_tinyjit_replays_with_new_inputs():
    blocks = random_blocks(3, 37, 96, seed=6)
    w = weight(blocks, 3, 96)
    jit = TinyJit(lambda x: qlinear(x, w).realize())
    for i in range(4):  # run, capture, replay, replay
        x = np.random.default_rng(10 + i).standard_normal((3, 96), dtype=np.float32)
        check_both_oracles(jit(Tensor(x).realize()).numpy(), x, blocks, 3)
    names = [c.src[0].arg.name for c in jit.captured.linear.src if c.src[0].op.name == "PROGRAM"]
    # the program is named by its entry point and defines: M, N, K, the format (and TV_NO_VNNI's 1 on the AVX2 route)
    assert any(name.startswith("qmatmul_3_37_96_3") for name in names), names


@needs_kernel
def test_graphed_jit_replays_with_new_inputs():
    # the engine's JIT: the whole capture replayed by one C call (kernels/cpu/graph_runner.c)
    from tinyvllm.kernels.cpu_graph import GraphedJit
    blocks = random_blocks(12, 5, 512, seed=8)
    w = weight(blocks, 12, 512)
    jit = GraphedJit(lambda x: qlinear(x, w).realize())
    for i in range(3):
        x = np.random.default_rng(20 + i).standard_normal((2, 512), dtype=np.float32)
        check_both_oracles(jit(Tensor(x).realize()).numpy(), x, blocks, 12)


@needs_kernel
@pytest.mark.parametrize("M", [8, 32])  # the integer path and the float path
def test_same_bits_with_and_without_threads(M: int):
    blocks = random_blocks(3, 960, 576, seed=9)  # 960 rows of w: many chunks for the thread pool
    w, x = weight(blocks, 3, 576), Tensor(np.random.default_rng(9).standard_normal((M, 576), dtype=np.float32))
    with cpu_threads.threads_enabled(True):
        a = qlinear(x.realize(), w).numpy()
    with cpu_threads.threads_enabled(False):
        b = qlinear(x.realize(), w).numpy()
    np.testing.assert_array_equal(a, b)


def test_bad_input_is_a_clear_error():
    data = Tensor(random_blocks(3, 4, 64, seed=1))
    with pytest.raises(ValueError, match=r"IQ2_XXS \(ggml type 16\).*supported: Q4_0"):
        QuantizedWeight(data, 16, (4, 64))
    with pytest.raises(ValueError, match=r"needs data of shape \(4, 60\) uint8"):
        QuantizedWeight(data, 3, (4, 96))
    with pytest.raises(ValueError, match="not a multiple"):
        QuantizedWeight(data, 3, (4, 48))
    with pytest.raises(ValueError, match="K=64"):
        qlinear(Tensor.ones(2, 32), QuantizedWeight(data, 3, (4, 64)))
    assert scratch_bytes(3, 2, 64) == 2 * 2 * 40 and scratch_bytes(12, 1, 512) == 2 * 292


@needs_kernel
@pytest.mark.parametrize("name,qtype", [("qmatmul", 3), ("qmatmul_k", 14)])
def test_entry_function_is_first_in_object(name: str, qtype: int):
    defines = {"TV_M": 3, "TV_N": 5, "TV_K": 256, "TV_QTYPE": qtype, "TV_POOL_ADDR": hex(cpu_threads.pool_address())}
    launcher.check_entry_is_first(Device["CPU"].compiler.compile_cached(launcher.kernel_source(name, "CPU", defines)),
                                  name)
