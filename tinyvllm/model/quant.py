"""GGML's block formats, their numpy dequantizers (every kernel's reference), and `QuantizedArray`
(docs/phases/06-quantized-weights.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.ggml_types import GGML_TYPES, QK_K, type_name


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2k): all lo nibbles, then all hi nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# ---- plain floats ----

def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float32).copy()  # the bytes may be a read-only view of the mapped file


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16: the top half of a float32."""
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- 32-element blocks ----

def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0: 32 elements in 18 bytes (4.5 bits per weight), x = d * (q - 8), q in 0..15."""
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1: 32 elements in 20 bytes (5 bits per weight), x = d * q + m, q in 0..15."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return d * q + m


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32): bit j as element j's 5th bit (0 or 16)."""
    qh = qh_bytes.copy().view(np.uint32)  # (n, 1)
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0: 32 elements in 22 bytes (5.5 bits per weight), x = d * (q - 16), q in 0..31."""
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1: 32 elements in 24 bytes, x = d * q + m, q in 0..31."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return d * q + m


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0: 32 elements in 34 bytes, x = d * q, q int8."""
    d = _f16(blocks, 0)
    return d * blocks[:, 2:].view(np.int8).astype(np.float32)


# IQ4_NL and IQ4_XS: a 4-bit index into 16 values denser near zero (ggml's kvalues_iq4nl)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: 32 elements in 18 bytes, x = d * IQ4NL_VALUES[q] (laid out as Q4_0)."""
    d = _f16(blocks, 0)
    return d * IQ4NL_VALUES[_nibbles(blocks[:, 2:])].astype(np.float32)


# ---- k-quants: 256-element super-blocks ----

def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: 256 elements in 84 bytes, 16 sub-blocks of 16: x = (d * sc) * q - (dmin * m), q in 0..3."""
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (scales & 0x0F).astype(np.float32))[..., None]  # (n, 16, 1)
    ml = (_f16(blocks, 82) * (scales >> 4).astype(np.float32))[..., None]
    qs = blocks[:, 16:80].reshape(n, 2, 1, 32)
    q = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 six-bit scales minus 32, (n, 16) float32.

        bytes 0-7   (j = 0..7):  lo nibble: scale[j] bits 0-3       hi nibble: scale[j+8] bits 0-3
        bytes 8-11  (j = 0..3):  bits 2k..2k+1: scale[4k + j] bits 4-5   (k = 0..3)
    """
    n = packed.shape[0]
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=-1)  # (n, 16)
    high = ((packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 16)
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K: 256 elements in 110 bytes, 16 sub-blocks of 16: x = (d * (sc - 32)) * q, q in -4..3 (minus 4 where the
    hmask bit is 0)."""
    n = blocks.shape[0]
    dl = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))[..., None]  # (n, 16, 1)
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)
    low = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 16, 16)
    hbit = ((blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, 16, 16)
    q = (low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)

def k_scales_mins_bytes(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes (..., 12) uint8 -> 8 six-bit scales and 8 six-bit mins, each (..., 8) uint8.

        bytes 0-3   (j = 0..3):  bits 0-5 scale[j]   bits 6-7: scale[j+4] bits 4-5
        bytes 4-7   (j = 0..3):  bits 0-5 min[j]     bits 6-7: min[j+4]   bits 4-5
        bytes 8-11  (j = 0..3):  lo nibble: scale[j+4] bits 0-3   hi nibble: min[j+4] bits 0-3

    Four bytes at a time, as little-endian uint32 words (as the C kernel unpacks them, qmatmul_k.c's
    unpack_scales): the 4-byte groups above are one word each, and each mask and shift works on 4 bytes at once."""
    words = packed.view(np.uint32)  # (..., 3): bytes 0-3, 4-7, 8-11
    a, b, c = words[..., 0], words[..., 1], words[..., 2]
    six, four, two = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    scales = np.stack([a & six, (c & four) | (a >> 6 & two) << 4], axis=-1).view(np.uint8)
    mins = np.stack([b & six, (c >> 4 & four) | (b >> 6 & two) << 4], axis=-1).view(np.uint8)
    return scales, mins


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes (n, 12) -> the 8 scales and 8 mins (`k_scales_mins_bytes`), each (n, 8) float32."""
    scales, mins = k_scales_mins_bytes(packed)
    return scales.astype(np.float32), mins.astype(np.float32)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 256 elements in 144 bytes, 8 sub-blocks of 32: x = (d * sc) * q - (dmin * m), q in 0..15."""
    n = blocks.shape[0]
    sc, m = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc)[..., None]  # (n, 8, 1)
    dm = (_f16(blocks, 2) * m)[..., None]
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: 256 elements in 176 bytes: Q4_K plus a 5th bit per element, q in 0..31."""
    n = blocks.shape[0]
    sc, m = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc)[..., None]
    dm = (_f16(blocks, 2) * m)[..., None]
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = blocks[:, 16:48]  # (n, 32)
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4  # (n, 8, 32)
    q = (low | high).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 256 elements in 210 bytes, 16 sub-blocks of 16: x = (d * scale) * (q - 32), q in 0..63."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    d = (_f16(blocks, 208) * scales)[..., None]  # (n, 16, 1)
    low = _nibbles(ql)  # (n, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 2, 128)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return (d * q.reshape(n, 16, 16)).reshape(n, QK_K)


def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: 256 elements in 136 bytes, 8 sub-blocks of 32: x = (d * (sc - 32)) * IQ4NL_VALUES[q]."""
    n = blocks.shape[0]
    scales_l = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & 0x0F
    scales_h = blocks[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)  # (n, 8)
    sc = (scales_l | ((scales_h.astype(np.uint8) & 3) << 4)).astype(np.int8) - np.int8(32)
    dl = (_f16(blocks, 0) * sc.astype(np.float32))[..., None]  # (n, 8, 1)
    q = IQ4NL_VALUES[_nibbles(blocks[:, 8:].reshape(n, 8, 16))].astype(np.float32)  # (n, 8, 32)
    return (dl * q).reshape(n, QK_K)


# ggml type id -> (elements per block, bytes per block, dequantizer)
_FORMATS: dict[int, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    0: (1, 4, dequantize_f32),
    1: (1, 2, dequantize_f16),
    2: (32, 18, dequantize_q4_0),
    3: (32, 20, dequantize_q4_1),
    6: (32, 22, dequantize_q5_0),
    7: (32, 24, dequantize_q5_1),
    8: (32, 34, dequantize_q8_0),
    10: (QK_K, 84, dequantize_q2_k),
    11: (QK_K, 110, dequantize_q3_k),
    12: (QK_K, 144, dequantize_q4_k),
    13: (QK_K, 176, dequantize_q5_k),
    14: (QK_K, 210, dequantize_q6_k),
    20: (32, 18, dequantize_iq4_nl),
    23: (QK_K, 136, dequantize_iq4_xs),
    30: (1, 2, dequantize_bf16),
}
SUPPORTED_TYPES: tuple[int, ...] = tuple(_FORMATS)


def _format(ggml_type: int) -> tuple[int, int, Callable[[np.ndarray], np.ndarray]]:
    if ggml_type not in _FORMATS:
        supported = ", ".join(f"{GGML_TYPES[t]}({t})" for t in SUPPORTED_TYPES)
        raise ValueError(f"GGML type {type_name(ggml_type)} (id {ggml_type}) is not supported; "
                         f"tinyvllm dequantizes: {supported}")
    return _FORMATS[ggml_type]


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (numpy-order) shape occupies in a GGUF file."""
    block_size, type_size, _ = _format(ggml_type)
    n = math.prod(shape)  # no int64 overflow
    if shape and shape[-1] % block_size != 0:
        raise ValueError(f"a {type_name(ggml_type)} row must be a multiple of {block_size} elements, got shape {shape}")
    return n // block_size * type_size


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes of one tensor (uint8) -> float32 array of `shape` (numpy order)."""
    block_size, type_size, fn = _format(ggml_type)
    nbytes = tensor_nbytes(ggml_type, shape)
    if data.size != nbytes:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} needs {nbytes} bytes, got {data.size}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, type_size)
    return fn(blocks).reshape(shape)


# ---- weights kept quantized ----

@dataclass(frozen=True)
class QuantizedArray:
    """A (N, K) weight still in its GGUF blocks, on the host: data (N, K // block_size * type_size) uint8."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def dequantize(self) -> np.ndarray:
        return dequantize(self.data.reshape(-1), self.ggml_type, self.shape)

    def rows(self, order: np.ndarray) -> QuantizedArray:
        """The same weight with its rows reordered."""
        return QuantizedArray(self.data[order], self.ggml_type, self.shape)


def as_blocks(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantizedArray:
    """One tensor's raw bytes -> a QuantizedArray, its byte count checked."""
    nbytes = tensor_nbytes(ggml_type, shape)
    if data.size != nbytes or len(shape) != 2:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} needs 2 dims and {nbytes} bytes, got "
                         f"{len(shape)} dims and {data.size} bytes")
    return QuantizedArray(data.reshape(shape[0], -1), ggml_type, (int(shape[0]), int(shape[1])))
