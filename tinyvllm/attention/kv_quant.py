"""K and V quantized on their way into the cache and dequantized on the way out (Phase 7c), in portable
tinygrad: the reference every kernel's `reshape_and_cache` and `paged_attention` are checked against.

Symmetric, one scale per token per KV head (vLLM's int8 KV cache and llama.cpp's q8_0 cache scale small
groups the same way; llama.cpp's group is 32 elements, ours a head's 64):

    x: (head_dim,) one token's K (or V) for one KV head      amax = max |x_i|
    s = amax / qmax                                          stored beside the block, float32
    code_i = round(x_i / s)         int8: qmax 127, round half to even, |code| <= 127
           = e4m3(x_i / s)          fp8:  qmax 448, the nearest e4m3 value (ties to even)
    x_i ~ code_i * s                (fp8: decode(code_i) * s)

Why per token: a token's K/V are written once, when it is computed, and never change, so its scale can be
computed then from its own values alone; a per-tensor scale would have to be known in advance (calibrated)
or grow, rewriting every stored code. And one outlier token spoils only its own 64 codes.

Before an int8 cache quantizes them, the attention rotates K and V (and q, and back the output) by a Hadamard
matrix H (`rotate`, QuaRot's trick: https://arxiv.org/abs/2404.00456): H is orthonormal and symmetric, so
(Hq).(Hk) = q.k and sum_t p_t (H v_t) = H (sum_t p_t v_t), while the rotated row spreads a few large channels over
all 64, and evenly spaced int8 codes then waste fewer of their 255 steps. bench_memory measures the rounding
error of the real model's K/V both ways (part 6). It costs no byte, and O(head_dim log head_dim) adds per new
token and per query, none per cached token. fp8 is not rotated: its error is relative to each element, and a
flatter row only makes the small elements larger.

Every formula is written as the kernels compute it, so that the codes come out bit for bit the same (tinygrad
0.14 renders `qmax / amax` as one division and the constant 1 / qmax folded; a code is the rounding of x_i * inv,
and computing inv another way, say qmax * (1 / amax), moves a code by one where x_i * inv lands within a float
rounding of a half):

    s = amax * (1 / qmax)        inv = amax > 0 ? qmax / amax : 0        y_i = x_i * inv

fp8 e4m3 (OCP "fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities; 0x7F is NaN.
    normal    (e > 0):  (-1)^s * 2^(e-7) * (1 + m/8)      largest 0x7E = 1.75 * 2^8 = 448
    subnormal (e = 0):  (-1)^s * 2^-6 * m/8 = m * 2^-9
Encoding rounds the float32's 23-bit mantissa to 3 bits by integer arithmetic on its bits (adding
0x7FFFF + the lowest kept bit, then shifting: round to nearest, ties to even, a carry moving into the exponent),
then re-biases the exponent from 127 to 7; below 2^-6 the code is round(|y| * 512), whose 8 is 2^-6, the
smallest normal. Decoding puts e + 120 into a float32's exponent, except for subnormals, m * 2^-9.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_cache import KVCacheDtype

FP8_E4M3_MAX = 448.0
FP8_MIN_NORMAL = 2.0**-6


def hadamard(n: int, dtype=dtypes.float32, device: str | None = None) -> Tensor:
    """Sylvester's Hadamard matrix of order n (a power of 2), normalized: H[i, j] = (-1)^popcount(i & j) / sqrt(n).
    Orthonormal and symmetric, so H @ H = I. Built from aranges, in the graph (no host buffer to capture)."""
    assert n > 0 and n & (n - 1) == 0, f"a Hadamard matrix of order {n}: the order must be a power of 2"
    index = Tensor.arange(n).to(device)
    both = index.reshape(n, 1) & index.reshape(1, n)
    parity = both * 0
    for bit in range(n.bit_length() - 1):
        parity = parity ^ ((both >> bit) & 1)
    return ((1 - 2 * parity).cast(dtypes.float32) * (1.0 / n**0.5)).cast(dtype)


def rotate(x: Tensor) -> Tensor:
    """x: (..., head_dim) -> x @ H in groups of g channels, g the largest power of 2 dividing head_dim (all of it for
    64 or 128). Its own inverse. Computed as the fast Walsh-Hadamard transform, log2(g) butterflies of adds and
    subtracts (a, b -> a + b, a - b at strides g/2, ..., 2, 1): elementwise, so tinygrad fuses it into the kernel
    that produces or consumes x, where a matmul by H would be a kernel of its own."""
    head_dim = x.shape[-1]
    group = head_dim & -head_dim
    lead = x.shape[:-1]
    half = group // 2
    while half >= 1:
        pairs = x.reshape(*lead, head_dim // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = Tensor.stack(a + b, a - b, dim=-2).reshape(*lead, head_dim)
        half //= 2
    return x * (1.0 / group**0.5)


def scales_of(x: Tensor, spec: KVCacheDtype) -> tuple[Tensor, Tensor]:
    """x: (..., head_dim) float32 -> (s, inv), each (...): the stored scale, and what x is multiplied by."""
    assert spec.qmax is not None, f"{spec.name} is not quantized"
    amax = x.abs().max(axis=-1)
    scale = amax * (1.0 / spec.qmax)
    inv = (amax > 0).where(spec.qmax / amax, 0.0)
    return scale, inv


def fp8_e4m3_encode(y: Tensor) -> Tensor:
    """y: float32, |y| <= 448 (larger magnitudes saturate to 448) -> e4m3 codes, uint8."""
    a = y.abs().minimum(FP8_E4M3_MAX)
    bits = a.bitcast(dtypes.uint32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits kept, exponent re-biased
    subnormal = (a * 512.0).round().cast(dtypes.uint32)  # m * 2^-9, 0..8
    magnitude = (a < FP8_MIN_NORMAL).where(subnormal, normal)
    sign = (y.bitcast(dtypes.uint32) >> 24) & 0x80
    return (magnitude | sign).cast(dtypes.uint8)


def fp8_e4m3_decode(codes: Tensor) -> Tensor:
    """uint8 e4m3 codes -> float32."""
    c = codes.cast(dtypes.uint32)
    magnitude = c & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).bitcast(dtypes.float32)
    subnormal = magnitude.cast(dtypes.float32) * 2.0**-9
    value = (magnitude < 8).where(subnormal, normal)
    return (c >= 0x80).where(-value, value)


def quantize(x: Tensor, spec: KVCacheDtype) -> tuple[Tensor, Tensor]:
    """x: (..., head_dim) float -> codes (..., head_dim) of spec.storage, scales (...) float32."""
    x = x.float()
    scale, inv = scales_of(x, spec)
    y = x * inv.unsqueeze(-1)
    if spec.name == "int8":
        codes = y.round().cast(dtypes.int8)
    else:
        codes = fp8_e4m3_encode(y)
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor, spec: KVCacheDtype) -> Tensor:
    """codes (..., head_dim), scales (...) -> float32 (..., head_dim)."""
    values = codes.cast(dtypes.float32) if spec.name == "int8" else fp8_e4m3_decode(codes)
    return values * scale.unsqueeze(-1)
