"""`qlinear(x, w)`: matmuls on weights kept in their GGUF block formats (docs/phases/06-quantized-weights.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tinygrad import Tensor, dtypes

from tinyvllm.kernels import linear as linear_module
from tinyvllm.kernels import repack
from tinyvllm.kernels.launcher import device_kind, has_kernel, launch, output
from tinyvllm.ggml_types import type_name
from tinyvllm.tinygrad_ext.programs import kernel_cost as Estimates  # noqa: N813 (a kernel's cost: tinygrad's name)


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block format: `block_size` weights stored in `type_size` bytes."""

    name: str
    block_size: int
    type_size: int
    kernel: str  # "qmatmul" (32-element blocks) or "qmatmul_k" (256-element super-blocks)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size


# ggml type id -> format (byte layouts in model/quant.py)
QUANT_FORMATS: dict[int, QuantFormat] = {
    2: QuantFormat("Q4_0", 32, 18, "qmatmul"),
    3: QuantFormat("Q4_1", 32, 20, "qmatmul"),
    6: QuantFormat("Q5_0", 32, 22, "qmatmul"),
    7: QuantFormat("Q5_1", 32, 24, "qmatmul"),
    8: QuantFormat("Q8_0", 32, 34, "qmatmul"),
    10: QuantFormat("Q2_K", 256, 84, "qmatmul_k"),
    11: QuantFormat("Q3_K", 256, 110, "qmatmul_k"),
    12: QuantFormat("Q4_K", 256, 144, "qmatmul_k"),
    13: QuantFormat("Q5_K", 256, 176, "qmatmul_k"),
    14: QuantFormat("Q6_K", 256, 210, "qmatmul_k"),
    20: QuantFormat("IQ4_NL", 32, 18, "qmatmul"),
    23: QuantFormat("IQ4_XS", 256, 136, "qmatmul_k"),
}

# Bytes of one quantized block of x in the CPU kernels' scratch: sizeof struct xblock / xblock_k in the C files.
X_BLOCK_BYTES = {"qmatmul": 40, "qmatmul_k": 292}

# 0: the integer route at every M, batch-invariant. N > 0: from N rows of x on, a float32 path whose result depends
# on how many rows share the step.
FLOAT_PATH_MIN_M = int(os.getenv("TINYVLLM_QMATMUL_FLOAT_MIN_M", "0"))


# 1: qmatmul.c uses AVX-512 VNNI where the CPU has it; 0: AVX2's route. Same bits either way.
VNNI = os.getenv("TINYVLLM_QMATMUL_VNNI", "1") == "1"


def uses_float_path(kernel: str, M: int) -> bool:
    """Does `kernel` (qmatmul.c's, on the GGUF's rows: the repacked layouts have no float path) take it at M rows?"""
    return kernel == "qmatmul" and 0 < FLOAT_PATH_MIN_M <= M


def quant_format(ggml_type: int) -> QuantFormat:
    if ggml_type not in QUANT_FORMATS:
        supported = ", ".join(f"{f.name} ({t})" for t, f in QUANT_FORMATS.items())
        raise ValueError(f"no quantized matmul for {type_name(ggml_type)} (ggml type {ggml_type}); "
                         f"supported: {supported}")
    return QUANT_FORMATS[ggml_type]


@dataclass(frozen=True)
class QuantizedWeight:
    """A (N, K) weight kept in its GGUF blocks on the device: data (N, K // block_size * type_size) uint8."""

    data: Tensor
    ggml_type: int
    shape: tuple[int, int]
    layout: str | None = None  # "x8": 8 rows side by side, repacked at load for the CPU (kernels/repack.py)

    def __post_init__(self):
        fmt = quant_format(self.ggml_type)
        N, K = self.shape
        if K % fmt.block_size != 0:
            raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block_size} weights; K={K} is not a multiple")
        want = (N, K // fmt.block_size * fmt.type_size)
        if self.layout == "x8":
            if self.ggml_type not in repack.X8_KERNELS or N % repack.GROUP != 0:
                raise ValueError(f"the x8 layout holds Q4_K, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL weights of a multiple "
                                 f"of 8 rows, not {fmt.name} {self.shape}")
            want = (N // repack.GROUP, want[1] * repack.GROUP)
        elif self.layout is not None:
            raise ValueError(f"layout {self.layout!r}: None (the GGUF's rows) or 'x8'")
        if self.data.dtype != dtypes.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{fmt.name} weight of shape {self.shape} needs data of shape {want} uint8, "
                             f"got {tuple(self.data.shape)} {self.data.dtype}")

    @property
    def format(self) -> QuantFormat:
        return QUANT_FORMATS[self.ggml_type]

    @property
    def kernel(self) -> str:
        """The kernel file that reads this weight's layout."""
        return repack.X8_KERNELS[self.ggml_type] if self.layout == "x8" else self.format.kernel


def scratch_bytes(ggml_type: int, M: int, K: int) -> int:
    """Bytes of the CPU kernel's scratch: M rows of x quantized to 8-bit blocks."""
    fmt = quant_format(ggml_type)
    return M * (K // fmt.block_size) * X_BLOCK_BYTES[fmt.kernel]


# ---- the GPU launches: GEMV for a few rows of x, tiles for many ----
GPU_GEMV_MAX_M = 8  # llama.cpp's MMVQ_MAX_BATCH_SIZE
GPU_TILE = 64  # rows of x and of w per thread block of the tiled route


@dataclass(frozen=True)
class GpuLaunch:
    """`entry` of the format's file on `grid` blocks of `threads` threads."""

    entry: str
    grid: tuple[int, int, int]
    threads: int


def gpu_launches(ggml_type: int, M: int, N: int, K: int) -> list[GpuLaunch]:
    """The launches for x (M, K) @ w(N, K).T: GEMV for M <= GPU_GEMV_MAX_M, else quantize_x then qmatmul_tiled."""
    kernel = quant_format(ggml_type).kernel
    if M <= GPU_GEMV_MAX_M:
        return [GpuLaunch(kernel, ((N + 3) // 4, M, 1), 128)]  # one warp per (m, n)
    return [GpuLaunch("quantize_x", ((K // 32 + 127) // 128, M, 1), 128),  # one thread per block of 32 of x
            GpuLaunch("qmatmul_tiled", (-(-N // GPU_TILE), -(-M // GPU_TILE), 1), 256)]


def gpu_scratch_bytes(M: int, K: int) -> int:
    """Bytes of the GPU kernels' scratch: the tiled route's quantized x; the GEMV route needs none."""
    return M * (K // 32) * X_BLOCK_BYTES["qmatmul"] if M > GPU_GEMV_MAX_M else 0


def uses_kernel(x: Tensor, w: QuantizedWeight) -> bool:
    """Would `qlinear(x, w)` run a hand-written kernel?"""
    if linear_module.PORTABLE or x.device != w.data.device or not linear_module.split_fits(x, w.data):
        return False
    if x.dtype != dtypes.float32 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        return False
    if not all(isinstance(s, int) for s in x.shape) or 0 in x.shape:
        return False
    return has_kernel(w.kernel, x.device)


def qlinear(x: Tensor, w: QuantizedWeight) -> Tensor:
    """x (..., K) float32 @ w(N, K).T -> (..., N) float32."""
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes K={K} (weight shape {w.shape})")
    if not uses_kernel(x, w):
        return x.float() @ dequantize_weight(w).T
    fmt = w.format

    def kernel(x2: Tensor, M: int, N: int, K: int, out: Tensor) -> Tensor:  # one device's (M,K) @ (N,K).T -> out
        nbytes = N * K // fmt.block_size * fmt.type_size
        estimates = Estimates(ops=2 * M * N * K, lds=nbytes + 4 * M * K, mem=nbytes + 4 * (M * K + M * N))
        defines = {"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": w.ggml_type}
        wd = w.data.contiguous()
        if device_kind(x.device) == "CPU":
            scratch = output((max(1, scratch_bytes(w.ggml_type, M, K)),), dtypes.uint8, x2)
            if uses_float_path(w.kernel, M):
                defines["TV_FLOAT_MIN_M"] = FLOAT_PATH_MIN_M
            if not VNNI:
                defines["TV_NO_VNNI"] = 1
            out, _ = launch(w.kernel, outs=[out, scratch], ins=[x2, wd], defines=defines, estimates=estimates)
            return out
        scratch = output((max(1, gpu_scratch_bytes(M, K)),), dtypes.uint8, x2)
        *quantize, matmul = gpu_launches(w.ggml_type, M, N, K)
        for q in quantize:
            (scratch,) = launch(fmt.kernel, outs=[scratch], ins=[x2], defines=defines, entry=q.entry, grid=q.grid,
                                local_size=(q.threads, 1, 1),
                                estimates=Estimates(ops=4 * M * K, lds=4 * M * K, mem=4 * M * K + scratch.nbytes()))
        outs, ins = ([out], [scratch, x2, wd]) if quantize else ([out, scratch], [x2, wd])
        return launch(fmt.kernel, outs=outs, ins=ins, defines=defines, estimates=estimates, entry=matmul.entry,
                      grid=matmul.grid, local_size=(matmul.threads, 1, 1))[0]
    # a row-parallel weight's columns are split between whole blocks
    return linear_module.run_split(x, w.data, N, kernel)


# ---- dequantizing in tinygrad ops: blocks (..., type_size) uint8 -> (..., block_size) float32, in the order of
# model/quant.py's numpy dequantizers ----

def _f16(b: Tensor, at: int) -> Tensor:
    """The little-endian float16 at byte `at` of each block, as float32: (..., 1)."""
    bits = b[..., at:at + 1].cast(dtypes.uint16) | (b[..., at + 1:at + 2].cast(dtypes.uint16) << 8)
    return bits.bitcast(dtypes.float16).cast(dtypes.float32)


def _nibbles(qs: Tensor) -> Tensor:
    """(..., n) bytes -> (..., 2n): every lo nibble, then every hi nibble."""
    return (qs & 0x0F).cat(qs >> 4, dim=-1)


def _q4_0(b: Tensor) -> Tensor:  # x = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[..., 2:]).cast(dtypes.float32) - 8)


def _q4_1(b: Tensor) -> Tensor:  # x = d * q + m
    return _f16(b, 0) * _nibbles(b[..., 4:]).cast(dtypes.float32) + _f16(b, 2)


def _shifted(x: Tensor, shifts: range | tuple[int, ...], dim: int) -> Tensor:
    """x >> s for each s, stacked along `dim`; Python constants, as a Tensor of shifts would keep the step out of
    the CPU graph."""
    return Tensor.stack(*[x >> sh for sh in shifts], dim=dim)


def _fifth_bits(qh: Tensor) -> Tensor:
    """(..., 4) bytes of a little-endian u32 -> (..., 32): bit k of it, as 0 or 16 (element k's fifth bit)."""
    return ((_shifted(qh, range(8), -1) & 1) << 4).reshape(*qh.shape[:-1], 32)


def _q5_0(b: Tensor) -> Tensor:  # x = d * (q - 16), q = nibble | fifth bit
    q = _nibbles(b[..., 6:]) | _fifth_bits(b[..., 2:6])
    return _f16(b, 0) * (q.cast(dtypes.float32) - 16)


def _iq4_values(nibbles: Tensor) -> Tensor:
    """IQ4_NL's 16 values looked up by 4-bit indices: a chain of selects on constants."""
    out = nibbles.cast(dtypes.float32) * 0
    for index, value in enumerate((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)):
        out = (nibbles == index).where(float(value), out)
    return out


def _iq4_nl(b: Tensor) -> Tensor:  # x = d * values[q]
    return _f16(b, 0) * _iq4_values(_nibbles(b[..., 2:]))


def _q5_1(b: Tensor) -> Tensor:  # x = d * q + m, q = nibble | fifth bit
    q = _nibbles(b[..., 8:]) | _fifth_bits(b[..., 4:8])
    return _f16(b, 0) * q.cast(dtypes.float32) + _f16(b, 2)


def _q8_0(b: Tensor) -> Tensor:  # x = d * q, q an int8
    return _f16(b, 0) * b[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32)


def _two_bits(qs: Tensor) -> Tensor:
    """Q2_K/Q3_K: (..., 64) bytes -> (..., 16, 16) values 0..3."""
    halves = qs.reshape(*qs.shape[:-1], 2, 32)
    return (_shifted(halves, range(0, 8, 2), -2) & 3).reshape(*qs.shape[:-1], 16, 16)


def _q2_k(b: Tensor) -> Tensor:  # 16 sub-blocks of 16: x = (d * sc) * q - (dmin * m), 4-bit sc and m
    scales = b[..., 0:16]
    dl = (_f16(b, 80) * (scales & 0x0F).cast(dtypes.float32)).unsqueeze(-1)  # (..., 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).cast(dtypes.float32)).unsqueeze(-1)
    return (dl * _two_bits(b[..., 16:80]).cast(dtypes.float32) - ml).reshape(*b.shape[:-1], 256)


def _q3_k(b: Tensor) -> Tensor:  # 16 sub-blocks of 16: x = (d * (sc - 32)) * q, q = 2 low bits - 4 (high bit 0)
    lead = b.shape[:-1]
    packed = b[..., 96:108]
    low = (packed[..., 0:8] & 0x0F).cat(packed[..., 0:8] >> 4, dim=-1)  # (..., 16)
    high = (_shifted(packed[..., 8:12], range(0, 8, 2), -2) & 3).reshape(*lead, 16)
    sc = (low | (high << 4)).cast(dtypes.int32) - 32
    dl = (_f16(b, 108) * sc.cast(dtypes.float32)).unsqueeze(-1)  # (..., 16, 1)
    hbit = (_shifted(b[..., 0:32], range(8), -2) & 1).reshape(*lead, 16, 16)  # element 32k + l: bit k of byte l
    q = _two_bits(b[..., 32:96]).cast(dtypes.int32) - ((hbit ^ 1) << 2).cast(dtypes.int32)
    return (dl * q.cast(dtypes.float32)).reshape(*lead, 256)


def _k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K: d * sc and dmin * m of the 8 sub-blocks, each (..., 8, 1) (6-bit sc and m in bytes 4-15)."""
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = (lo & 63).cat((hi & 0x0F) | ((lo >> 6) << 4), dim=-1).cast(dtypes.float32)  # (..., 8)
    mn = (mid & 63).cat((hi >> 4) | ((mid >> 6) << 4), dim=-1).cast(dtypes.float32)
    return (_f16(b, 0) * sc).unsqueeze(-1), (_f16(b, 2) * mn).unsqueeze(-1)


def _q4_k(b: Tensor) -> Tensor:  # 8 sub-blocks of 32: x = (d * sc) * q - (dmin * m), 6-bit sc and m
    d, dm = _k_scales(b)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
    q = _nibbles(qs).reshape(*b.shape[:-1], 8, 32).cast(dtypes.float32)  # chunk c: sub-blocks 2c, 2c+1
    return (d * q - dm).reshape(*b.shape[:-1], 256)


def _q5_k(b: Tensor) -> Tensor:  # Q4_K's scales and nibbles (from byte 48), a fifth bit: bit s of qh[l]
    d, dm = _k_scales(b)
    low = _nibbles(b[..., 48:].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    high = (_shifted(b[..., 16:48], range(8), -2) & 1) << 4  # (..., 8, 32)
    return (d * (low | high).cast(dtypes.float32) - dm).reshape(*b.shape[:-1], 256)


def _q6_k(b: Tensor) -> Tensor:  # 16 sub-blocks of 16: x = (d * scale) * (q - 32), q = 4 low bits | 2 high bits
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = b[..., 192:208].bitcast(dtypes.int8).cast(dtypes.float32)  # (..., 16)
    d = (_f16(b, 208) * scales).unsqueeze(-1)  # (..., 16, 1)
    low = _nibbles(ql)  # (..., 2, 128)
    high = (_shifted(qh[..., 0, :], range(0, 8, 2), -2) & 3).reshape(*lead, 2, 128)  # bits 2(e // 32) of qh[e % 32]
    q = (low | (high << 4)).cast(dtypes.float32) - 32
    return (d * q.reshape(*lead, 16, 16)).reshape(*lead, 256)


def _iq4_xs(b: Tensor) -> Tensor:  # 8 sub-blocks of 32: x = (d * (sc - 32)) * values[q], 6-bit sc
    lead = b.shape[:-1]
    low = _shifted(b[..., 4:8], (0, 4), -1).reshape(*lead, 8) & 0x0F
    high = b[..., 2:3].cast(dtypes.uint16) | (b[..., 3:4].cast(dtypes.uint16) << 8)  # (..., 1) scales_h
    high = _shifted(high[..., 0], range(0, 16, 2), -1) & 3  # (..., 8)
    sc = (low.cast(dtypes.int32) | (high.cast(dtypes.int32) << 4)) - 32
    dl = (_f16(b, 0) * sc.cast(dtypes.float32)).unsqueeze(-1)  # (..., 8, 1)
    q = _iq4_values(_nibbles(b[..., 8:].reshape(*lead, 8, 16)))  # (..., 8, 32)
    return (dl * q).reshape(*lead, 256)


_DEQUANTIZE = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k,
               14: _q6_k, 20: _iq4_nl, 23: _iq4_xs}


def _dequantize_rows(rows: Tensor, ggml_type: int, K: int) -> Tensor:
    """rows (..., row_bytes) uint8 -> (..., K) float32."""
    fmt = quant_format(ggml_type)
    blocks = rows.reshape(*rows.shape[:-1], K // fmt.block_size, fmt.type_size)  # (..., blocks per row, type_size)
    return _DEQUANTIZE[ggml_type](blocks).reshape(*rows.shape[:-1], K)


def _dequantize_q4_k_x8(groups: Tensor, N: int, K: int) -> Tensor:
    """Q4_K repacked 8 rows at a time (N / 8, K / 256 * 1152) uint8 -> (N, K) float32 (layout: qmatmul_k_x8.c)."""
    G, NB = N // 8, K // 256
    b = groups.reshape(G, NB, 1152)
    d = _f16(b[..., 0:16].reshape(G, NB, 8, 2), 0)  # (G, NB, r, 1)
    dmin = _f16(b[..., 16:32].reshape(G, NB, 8, 2), 0)
    low, high = b[..., 32:96], b[..., 96:128]
    high = (high & 0x0F).cat(high >> 4, dim=-1)  # (G, NB, 64): bits of sc and m above their low 4, i = 8j + r
    sc = ((low & 0x0F) | ((high & 3) << 4)).reshape(G, NB, 8, 8).permute(0, 1, 3, 2)  # (G, NB, r, j)
    mn = ((low >> 4) | (((high >> 2) & 3) << 4)).reshape(G, NB, 8, 8).permute(0, 1, 3, 2)
    qs = b[..., 128:].reshape(G, NB, 4, 1, 8, 8, 4)  # (G, NB, c, ., g, r, t)
    q = (qs & 0x0F).cat(qs >> 4, dim=3).permute(0, 1, 5, 2, 3, 4, 6)  # (G, NB, r, c, nibble, g, t)
    q = q.reshape(G, NB, 8, 8, 32).cast(dtypes.float32)  # sub-block j = 2c + nibble, element 4g + t
    w = (d * sc.cast(dtypes.float32)).unsqueeze(-1) * q - (dmin * mn.cast(dtypes.float32)).unsqueeze(-1)
    return w.permute(0, 2, 1, 3, 4).reshape(N, K)  # (G, r, NB, j, e): row 8G + r


def dequantize_weight(w: QuantizedWeight) -> Tensor:
    """The (N, K) float32 weight in tinygrad ops: the portable reference."""
    if w.layout == "x8" and w.ggml_type == 12:
        return _dequantize_q4_k_x8(w.data, *w.shape)
    if w.layout == "x8":  # the 32-element formats: moved back to the GGUF's rows, then as those
        return _dequantize_rows(repack.unpack_blocks_x8(w.data, w.ggml_type, *w.shape), w.ggml_type, w.shape[1])
    return _dequantize_rows(w.data, w.ggml_type, w.shape[1])


def embedding(w: QuantizedWeight, ids: Tensor) -> Tensor:
    """ids (...) int -> (..., K) float32: only the looked-up rows' bytes are gathered and dequantized."""
    if w.layout is not None:
        raise ValueError(f"an embedding is looked up by rows: keep it in the GGUF's layout, not {w.layout!r}")
    return _dequantize_rows(w.data[ids], w.ggml_type, w.shape[1])
