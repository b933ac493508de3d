"""K and V quantized into the cache (a scale per token per KV head) and out of it: the kernels' bitwise reference.

Taught in docs/phases/07c-kv-cache-quantization.md, section 3, with the e4m3 bit layout and the operation order.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_cache import KVCacheDtype

FP8_E4M3_MAX = 448.0
FP8_MIN_NORMAL = 2.0**-6


def hadamard(n: int, dtype=dtypes.float32, device: str | None = None) -> Tensor:
    """Sylvester's normalized Hadamard matrix of order n (a power of 2): H[i, j] = (-1)^popcount(i & j) / sqrt(n),
    H @ H = I."""
    assert n > 0 and n & (n - 1) == 0, f"a Hadamard matrix of order {n}: the order must be a power of 2"
    index = Tensor.arange(n).to(device)
    both = index.reshape(n, 1) & index.reshape(1, n)
    parity = both * 0
    for bit in range(n.bit_length() - 1):
        parity = parity ^ ((both >> bit) & 1)
    return ((1 - 2 * parity).cast(dtypes.float32) * (1.0 / n**0.5)).cast(dtype)


def rotate(x: Tensor) -> Tensor:
    """x: (..., head_dim) -> x @ H in groups of g channels, g the largest power of 2 dividing head_dim; its own
    inverse."""
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
