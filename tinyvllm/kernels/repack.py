"""Weights reordered at load for the CPU: Q4_K's rows 8 side by side, the layout kernels/cpu/qmatmul_k_x8.c reads.

The GGUF stores a weight row after row. A CPU core computes one row's dot product per super-block with a scale
unpack, two float multiply-adds and a horizontal sum; with 8 rows in the 8 lanes of one register, those costs are
paid once per 8 rows (the kernel file says how). The bytes are the GGUF's, reordered: the weight takes the same
memory, but it is copied out of the file's mapped pages instead of being used where it lies.

llama.cpp's CPU backend reorders Q4_K the same way when it loads a file (its "repacked" buffers). The GPU kernels
keep the file's layout: this is the CPU's choice, made in one place, `repack_for`.
"""

from __future__ import annotations

import os

import numpy as np
from tinygrad import Device

from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels.launcher import device_kind, has_kernel

# ggml type -> the kernel that reads its repacked layout
X8_KERNELS = {12: "qmatmul_k_x8"}  # Q4_K
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


REPACK = {12: repack_q4_k_x8}
