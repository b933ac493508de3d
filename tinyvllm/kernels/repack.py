"""Weights reordered at load for the CPU: rows 8 side by side, the layouts kernels/cpu/qmatmul_k_x8.c (Q4_K) and
qmatmul_x8.c (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) read.

The GGUF stores a weight row after row. A CPU core computes one row's dot product per super-block with a scale
unpack, two float multiply-adds and a horizontal sum; with 8 rows in the 8 lanes of one register, those costs are
paid once per 8 rows (the kernel file says how). The bytes are the GGUF's, reordered: the weight takes the same
memory, but it is copied out of the file's mapped pages instead of being used where it lies (the first start keeps
the copy on disk for the next ones: tinyvllm/model/repacked_cache.py).

llama.cpp's CPU backend reorders Q4_K, Q4_0 and IQ4_NL the same way when it loads a file (its "repacked" buffers).
The GPU kernels keep the file's layout: this is the CPU's choice, made in one place, `repack_for`.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from tinygrad import Device, Tensor

from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.launcher import device_kind, has_kernel

# ggml type -> the kernel that reads its repacked layout
# the 32-element formats of qmatmul_x8.c (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): ggml type -> (block bytes, float16
# scales before the quants (d, or d and m), whether a u32 of fifth bits follows them)
BLOCK_X8 = {2: (18, 1, False), 3: (20, 2, False), 6: (22, 1, True), 7: (24, 2, True), 20: (18, 1, False)}
X8_KERNELS = {12: "qmatmul_k_x8", **{t: "qmatmul_x8" for t in BLOCK_X8}}
GROUP = 8  # rows of w side by side

# 0: keep the GGUF's row layout on the CPU too (to compare the two kernels)
ENABLED = os.getenv("TINYVLLM_REPACK", "1") == "1"


def repack_for(ggml_type: int, rows: int, device: str | None) -> str | None:
    """The layout a (rows, K) weight of `ggml_type` is kept in on `device`: "x8" (repacked) or None (the GGUF's)."""
    device = device or Device.DEFAULT
    if not ENABLED or linear_module.PORTABLE or ggml_type not in X8_KERNELS or rows % GROUP != 0:
        return None
    if not isinstance(device, str):  # split over devices: each keeps the file's rows
        return None
    return "x8" if device_kind(device) == "CPU" and has_kernel(X8_KERNELS[ggml_type], device) else None


def repack_q4_k_x8(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_K rows (N, NB * 144) uint8 -> groups (N / 8, NB * 1152) uint8, qmatmul_k_x8.c's layout (into `out`).
    The float16 scales move as uint16 and the nibbles as uint32 (4 bytes of a row stay together): a quarter of the
    elements to move than byte by byte."""
    N, row_bytes = data.shape
    G, NB = N // GROUP, row_bytes // 144
    blocks = data.reshape(G, GROUP, NB, 144)  # (G, r, NB, 144)
    out = (np.empty((G, NB * 1152), np.uint8) if out is None else out).reshape(G, NB, 1152)
    out[..., 0:32].view(np.uint16).reshape(G, NB, 2, GROUP)[:] = blocks[..., 0:4].view(np.uint16).transpose(0, 2, 3, 1)
    from tinyvllm.model.quant import k_scales_mins_bytes  # (the model layer's; imported where it is used)

    # (G, r, NB, 2) uint32: sc[r][j] and m[r][j], 4 bytes a word, for the masks below
    sc, m = (v.view(np.uint32) for v in k_scales_mins_bytes(blocks[..., 4:16]))
    four, two = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)

    def by_subblock(v: np.ndarray) -> np.ndarray:  # bytes (G, r, NB, j) -> (G, NB, 64), byte 8j + r
        return v.view(np.uint8).reshape(G, GROUP, NB, 8).transpose(0, 2, 3, 1).reshape(G, NB, 64)

    out[..., 32:96] = by_subblock((sc & four) | (m & four) << 4)
    high = by_subblock((sc >> 4 & two) | (m >> 2 & two << 2))  # 4 bits of i = 8j + r: bits 4-5 of sc, of m
    out[..., 96:128] = high[..., :32] | high[..., 32:] << 4  # i < 32: lo nibble of byte i; i >= 32: hi of i - 32
    qs = blocks[..., 16:].view(np.uint32).reshape(G, GROUP, NB, 4, 8)  # (G, r, NB, c, g): 4 bytes t of a row each
    out[..., 128:].view(np.uint32).reshape(G, NB, 4, 8, GROUP)[:] = qs.transpose(0, 2, 3, 4, 1)  # (c, g, r)
    return out.reshape(G, NB * 1152)


def repack_blocks_x8(data: np.ndarray, ggml_type: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of 32-element blocks (N, NB * B) uint8 -> groups (N / 8, NB * 8 * B), qmatmul_x8.c's layout: per group
    and block, each float16 scale of the 8 rows side by side, then (Q5) the fifth bits regrouped, 32 bytes, then the
    16 bytes of nibbles 4 bytes of a row at a time (moved as uint16 and uint32)."""
    B, scales, fifth = BLOCK_X8[ggml_type]
    N, row_bytes = data.shape
    G, NB = N // GROUP, row_bytes // B
    blocks = data.reshape(G, GROUP, NB, B)  # (G, r, NB, B)
    out = (np.empty((G, NB * GROUP * B), np.uint8) if out is None else out).reshape(G, NB, GROUP * B)
    head = GROUP * 2 * scales  # the scales: (G, NB, field, r) uint16
    out[..., :head].view(np.uint16).reshape(G, NB, scales, GROUP)[:] = blocks[..., :2 * scales].view(
        np.uint16).transpose(0, 2, 3, 1)
    at = 2 * scales
    if fifth:  # byte 4r + t, bit 4h + k: the fifth bit of element 16h + 4k + t of row r (h < 2, k < 4, t < 4)
        bits = np.unpackbits(blocks[..., at:at + 4], axis=-1, bitorder="little")  # (G, r, NB, e)
        bits = bits.reshape(G, GROUP, NB, 2, 4, 4).transpose(0, 2, 1, 5, 3, 4).reshape(G, NB, GROUP, 4, 8)
        out[..., head:head + 32] = np.packbits(bits, axis=-1, bitorder="little").reshape(G, NB, 32)  # (r, t)
        head, at = head + 32, at + 4
    qs = blocks[..., at:].view(np.uint32)  # (G, r, NB, k): bytes 4k .. 4k + 3 of a row's 16
    out[..., head:].view(np.uint32).reshape(G, NB, 4, GROUP)[:] = qs.transpose(0, 2, 3, 1)  # (k, r)
    return out.reshape(G, NB * GROUP * B)


def unpack_blocks_x8(groups, ggml_type: int, N: int, K: int):
    """The inverse of `repack_blocks_x8` on a tinygrad Tensor: groups -> the GGUF's rows (N, K / 32 * B) uint8."""
    B, scales, fifth = BLOCK_X8[ggml_type]
    G, NB = N // GROUP, K // 32
    b = groups.reshape(G, NB, GROUP * B)
    head = GROUP * 2 * scales
    parts = [b[..., :head].reshape(G, NB, scales, GROUP, 2).permute(0, 3, 1, 2, 4).reshape(G, GROUP, NB, 2 * scales)]
    if fifth:  # element e = 16h + 4k + t: bit 4h + k of byte 4r + t; qh byte j holds elements 8j .. 8j + 7
        packed = b[..., head:head + 32].reshape(G, NB, GROUP, 4)  # (G, NB, r, t)
        bits = Tensor.stack(*[(packed >> s) & 1 for s in range(8)], dim=3)  # (G, NB, r, 4h + k, t): element order
        bits = bits.reshape(G, NB, GROUP, 4, 8)  # (.., qh byte j, bit i): element 8j + i
        qh = functools.reduce(lambda a, c: a | c, [bits[..., i] << i for i in range(8)])  # (G, NB, r, 4 bytes)
        parts.append(qh.permute(0, 2, 1, 3))
        head += 32
    parts.append(b[..., head:].reshape(G, NB, 4, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(G, GROUP, NB, 16))
    return parts[0].cat(*parts[1:], dim=-1).reshape(N, NB * B)


REPACK = {12: repack_q4_k_x8, **{t: functools.partial(repack_blocks_x8, ggml_type=t) for t in BLOCK_X8}}
