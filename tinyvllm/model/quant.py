"""GGML's block formats drawn byte by byte, their numpy dequantizers, and `QuantizedArray` (Phase 6).

Each `dequantize_*` takes `blocks: (n_blocks, type_size) uint8` and returns `(n_blocks, block_size) float32`, with
ggml's float operations in ggml's order: bit-exact with the `gguf` package (tests/model/test_weights.py). They are the
reference every kernel is tested against (docs/phases/06-quantized-weights.md, section 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tinyvllm.ggml_types import GGML_TYPES, QK_K, type_name


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32: (n_blocks, 1)."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) packed bytes -> (..., 2k) 4-bit values: all lo nibbles first, then all hi nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# ---- plain floats ----

def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    """F32: 4 bytes per element, IEEE float32."""
    return blocks.view(np.float32).copy()  # a copy: the bytes may be a read-only view of the mapped file


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    """F16: 2 bytes per element, IEEE float16 (5-bit exponent, 10-bit mantissa)."""
    return blocks.view(np.float16).astype(np.float32)


def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16: 2 bytes per element, the top half of a float32 (8-bit exponent, 7-bit mantissa).

        bf16:     S EEEEEEEE MMMMMMM
        float32:  S EEEEEEEE MMMMMMM 0000000000000000     (bf16 << 16)
    """
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ---- 32-element blocks ----

def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0: 32 elements in 18 bytes (4.5 bits per weight), x = d * (q - 8), q in 0..15.

        byte  0      2                            18
              +------+----------------------------+
              | d    | qs[0..15]                  |
              | f16  | lo nibble: q[j]            |
              |      | hi nibble: q[j + 16]       |
              +------+----------------------------+
    """
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1: 32 elements in 20 bytes (5 bits per weight), x = d * q + m, q in 0..15.

        byte  0      2      4                            20
              +------+------+----------------------------+
              | d    | m    | qs[0..15]                  |
              | f16  | f16  | lo nibble: q[j]            |
              |      |      | hi nibble: q[j + 16]       |
              +------+------+----------------------------+
    """
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return d * q + m


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) bits, bit j is element j's 5th bit (value 16)."""
    qh = qh_bytes.copy().view(np.uint32)  # (n, 1)
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0: 32 elements in 22 bytes (5.5 bits per weight), x = d * (q - 16), q in 0..31.

        byte  0      2            6                            22
              +------+------------+----------------------------+
              | d    | qh (u32)   | qs[0..15]                  |
              | f16  | bit j:     | lo nibble: q[j] low 4 bits |
              |      | q[j] bit 4 | hi nibble: q[j+16] low 4   |
              +------+------------+----------------------------+
    """
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1: 32 elements in 24 bytes (6 bits per weight), x = d * q + m, q in 0..31.

        byte  0      2      4            8                            24
              +------+------+------------+----------------------------+
              | d    | m    | qh (u32)   | qs[0..15]  (as in Q5_0)    |
              +------+------+------------+----------------------------+
    """
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return d * q + m


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0: 32 elements in 34 bytes (8.5 bits per weight), x = d * q, q an int8.

        byte  0      2                            34
              +------+----------------------------+
              | d    | qs[0..31]  int8            |
              +------+----------------------------+
    """
    d = _f16(blocks, 0)
    return d * blocks[:, 2:].view(np.int8).astype(np.float32)


# IQ4_NL and IQ4_XS: a 4-bit index into 16 fixed values, denser near zero (ggml's kvalues_iq4nl): NF4's idea
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: 32 elements in 18 bytes (4.5 bits per weight), x = d * IQ4NL_VALUES[q], q in 0..15.

        byte  0      2                            18
              +------+----------------------------+
              | d    | qs[0..15]  (as in Q4_0)    |
              +------+----------------------------+
    """
    d = _f16(blocks, 0)
    return d * IQ4NL_VALUES[_nibbles(blocks[:, 2:])].astype(np.float32)


# ---- k-quants: 256-element super-blocks ----

def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: 256 elements in 84 bytes (2.625 bits per weight): 16 sub-blocks of 16, each with a 4-bit scale sc and
    min m, x = (d * sc) * q - (dmin * m), q in 0..3.

        byte  0                  16                         80     82     84
              +------------------+--------------------------+------+------+
              | scales[0..15]    | qs[0..63]                | d    | dmin |
              | lo nibble: sc    | 2 bits per element       | f16  | f16  |
              | hi nibble: m     |                          |      |      |
              +------------------+--------------------------+------+------+

    Two halves of 128 elements; half h uses qs[32h : 32h+32]; element e (0..127) of a half is bits 2k..2k+1 of
    qs[32h + e % 32], k = e // 32 (Q6_K's high bits, the same walk).
    """
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
    """Q3_K: 256 elements in 110 bytes (3.4375 bits per weight): 16 sub-blocks of 16, each with a 6-bit scale,
    x = (d * (sc - 32)) * q, q in -4..3: 2 low bits from qs, minus 4 where the element's hmask bit is 0.

        byte  0              32                     96                 108    110
              +--------------+----------------------+------------------+------+
              | hmask[0..31] | qs[0..63]            | scales (12 B)    | d    |
              | bit k of     | 2 bits per element,  | 16 x 6 bits      | f16  |
              | hmask[l]:    | as in Q2_K           | (_q3_k_scales)   |      |
              | element 32k+l|                      |                  |      |
              +--------------+----------------------+------------------+------+
    """
    n = blocks.shape[0]
    dl = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))[..., None]  # (n, 16, 1)
    qs = blocks[:, 32:96].reshape(n, 2, 1, 32)
    low = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(n, 16, 16)
    hbit = ((blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, 16, 16)
    q = (low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)).astype(np.float32)
    return (dl * q).reshape(n, QK_K)

def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins, each (n, 8) float32.

        bytes 0-3   (j = 0..3):  bits 0-5 scale[j]   bits 6-7: scale[j+4] bits 4-5
        bytes 4-7   (j = 0..3):  bits 0-5 min[j]     bits 6-7: min[j+4]   bits 4-5
        bytes 8-11  (j = 0..3):  lo nibble: scale[j+4] bits 0-3   hi nibble: min[j+4] bits 0-3
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 256 elements in 144 bytes (4.5 bits per weight): 8 sub-blocks of 32, each with a 6-bit
    scale sc and min m, x = (d * sc) * q - (dmin * m), q in 0..15.

        byte  0      2      4              16                                      144
              +------+------+--------------+---------------------------------------+
              | d    | dmin | scales, mins | qs: 4 chunks of 32 bytes              |
              | f16  | f16  | 8 + 8 values | chunk c: lo nibbles -> sub-block 2c   |
              |      |      | of 6 bits    |          hi nibbles -> sub-block 2c+1 |
              +------+------+--------------+---------------------------------------+
    """
    n = blocks.shape[0]
    sc, m = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc)[..., None]  # (n, 8, 1)
    dm = (_f16(blocks, 2) * m)[..., None]
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: 256 elements in 176 bytes (5.5 bits per weight): Q4_K plus a 5th bit per element,
    x = (d * sc) * q - (dmin * m), q in 0..31.

        byte  0      2      4              16                 48                   176
              +------+------+--------------+------------------+--------------------+
              | d    | dmin | scales, mins | qh[0..31]        | qs: as in Q4_K     |
              | f16  | f16  | as in Q4_K   | bit s of qh[l]:  | (the 4 low bits)   |
              |      |      |              | bit 4 of element |                    |
              |      |      |              | l of sub-block s |                    |
              +------+------+--------------+------------------+--------------------+
    """
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
    """Q6_K: 256 elements in 210 bytes (6.5625 bits per weight): 16 sub-blocks of 16, each with an
    int8 scale, x = (d * scale) * (q - 32), q in 0..63 (4 low bits in ql, 2 high bits in qh).

        byte  0                  128              192              208    210
              +------------------+----------------+----------------+------+
              | ql[0..127]       | qh[0..63]      | scales[0..15]  | d    |
              | lo 4 bits of q   | hi 2 bits of q | int8           | f16  |
              +------------------+----------------+----------------+------+

    The super-block is two halves of 128 elements; half h uses ql[64h : 64h+64], qh[32h : 32h+32].
    Within a half, element e (0..127) takes:
        lo 4 bits: lo nibble of ql[e] for e < 64, hi nibble of ql[e - 64] for e >= 64
        hi 2 bits: bits 2k..2k+1 of qh[e % 32], k = e // 32
    """
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
    """IQ4_XS: 256 elements in 136 bytes (4.25 bits per weight): 8 sub-blocks of 32, each with a 6-bit scale,
    x = (d * (sc - 32)) * IQ4NL_VALUES[q], q in 0..15.

        byte  0      2          4                8                                      136
              +------+----------+----------------+---------------------------------------+
              | d    | scales_h | scales_l[0..3] | qs: 8 runs of 16 bytes, run s is       |
              | f16  | u16: bits| nibble s:      | sub-block s as Q4_0 packs a block      |
              |      | 2s..2s+1 | sc[s] bits 0-3 | (lo nibbles q[0..15], hi q[16..31])    |
              |      | sc bits 4-5                |                                       |
              +------+----------+----------------+---------------------------------------+
    """
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
    n = math.prod(shape)  # Python's ints: no float or int64 round trip, and no numpy call per tensor
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
    """A 2-D weight still in its GGUF blocks, on the host: what the loader hands the model instead of floats.

        data: (N, K // block_size * type_size) uint8   row n's blocks, in order (a block never spans two rows)
        shape: (N, K)                                   the float weight it stands for: (out_features, in_features)

    `data` is usually a read-only view of the memory-mapped file: nothing is copied or dequantized until the
    model uploads the bytes to the device."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def dequantize(self) -> np.ndarray:
        return dequantize(self.data.reshape(-1), self.ggml_type, self.shape)

    def rows(self, order: np.ndarray) -> QuantizedArray:
        """The same weight with its rows reordered (rows are whole blocks, so this is a byte gather)."""
        return QuantizedArray(self.data[order], self.ggml_type, self.shape)


def as_blocks(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantizedArray:
    """One tensor's raw bytes -> a QuantizedArray of rows, checking the byte count."""
    nbytes = tensor_nbytes(ggml_type, shape)
    if data.size != nbytes or len(shape) != 2:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} needs 2 dims and {nbytes} bytes, got "
                         f"{len(shape)} dims and {data.size} bytes")
    return QuantizedArray(data.reshape(shape[0], -1), ggml_type, (int(shape[0]), int(shape[1])))
