"""Quantizing float32 weights into GGML blocks with numpy: Q8_0, Q4_0, Q4_1, Q5_0, and (quantizer_search.py)
IQ4_NL and Q4_K (docs/phases/06-quantized-weights.md section 3)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tinyvllm.ggml_types import GGML_TYPES
from tinyvllm.model.quantizer_search import quantize_iq4_nl, quantize_q4_k

BLOCK_SIZE = 32
# ggml type id -> (elements, bytes) per block
FORMATS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 20: (32, 18)}
QUANTIZE_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q4_k": 12}
FALLBACK = {12: 6}  # llama-quantize's, where a row is not whole blocks (SmolLM2's rows are 576 wide)

CHUNK_BLOCKS = 2048  # 256 KiB of float32 in: fits the L2 cache with its temporaries


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes: q[j] in byte j's lo nibble, q[j + 16] in its hi."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _pick(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """x[i, index[i]] for every block i, as (n, 1)."""
    n, width = x.shape
    return np.take(x.reshape(-1), index + np.arange(0, n * width, width))[:, None]


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d in float32, 0 where d is 0."""
    out = np.zeros_like(d)
    np.divide(np.float32(1), d, out=out, where=d != 0)
    return out


def _float16(values: np.ndarray, what: str) -> np.ndarray:
    """A block's scale (or minimum) as float16 bytes (n, 2); ValueError for what float16 cannot hold."""
    with np.errstate(over="ignore"):  # reported below
        half = values.astype(np.float16)
    if not np.isfinite(half).all():
        bad = values[~np.isfinite(half)][0]
        raise ValueError(f"cannot quantize these weights: a block's {what} is {bad:g}, which float16 cannot hold "
                         "(the weights hold NaN, infinity, or values too large)")
    return half.view(np.uint8)


class _Work:
    """One thread's float32 work arrays, reused chunk after chunk."""

    def __init__(self, n_blocks: int):
        self.v = np.empty((n_blocks, BLOCK_SIZE), dtype=np.float32)
        self.t = np.empty((n_blocks, BLOCK_SIZE), dtype=np.float32)
        self.mask = np.empty((n_blocks, BLOCK_SIZE), dtype=bool)


def _quantize_q8_0(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    """x (n, 32) float32 -> out (n, 34) uint8: f16 d, then 32 int8 q."""
    n = len(x)
    v, t, mask = work.v[:n], work.t[:n], work.mask[:n]
    ax = np.abs(x, out=v)
    d = _pick(ax, ax.argmax(axis=1)) / np.float32(127)  # (n, 1)
    out[:, 0:2] = _float16(d, "scale")
    np.multiply(x, _inverse(d), out=v)  # in -127..127
    np.trunc(v, out=t)  # roundf: half away from zero
    frac = np.subtract(v, t, out=v)  # exact: v and t share their leading bits
    np.add(t, np.greater_equal(frac, np.float32(0.5), out=mask), out=t)
    np.subtract(t, np.less_equal(frac, np.float32(-0.5), out=mask), out=t)
    np.copyto(out[:, 2:].view(np.int8), t, casting="unsafe")  # exact: whole numbers in -127..127


def _quantize_q4_0(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    """x (n, 32) float32 -> out (n, 18) uint8: f16 d, then 16 bytes of packed 4-bit q."""
    v = work.v[: len(x)]
    ax = np.abs(x, out=v)  # the first largest |x|, its sign kept, becomes q = 0
    d = _pick(x, ax.argmax(axis=1)) / np.float32(-8)  # (n, 1)
    out[:, 0:2] = _float16(d, "scale")
    np.multiply(x, _inverse(d), out=v)
    v += np.float32(8.5)
    np.trunc(v, out=v)  # C's (int8_t) cast
    np.clip(v, 0, 15, out=v)
    out[:, 2:] = _pack_nibbles(v.astype(np.uint8))


def _quantize_q4_1(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    """x (n, 32) float32 -> out (n, 20) uint8: f16 d, f16 min, then 16 bytes of packed 4-bit q."""
    v = work.v[: len(x)]
    lo = _pick(x, x.argmin(axis=1))  # (n, 1)
    d = (_pick(x, x.argmax(axis=1)) - lo) / np.float32(15)
    out[:, 0:2] = _float16(d, "scale")
    out[:, 2:4] = _float16(lo, "minimum")
    np.subtract(x, lo, out=v)
    v *= _inverse(d)
    v += np.float32(0.5)
    np.trunc(v, out=v)
    np.clip(v, 0, 15, out=v)
    out[:, 4:] = _pack_nibbles(v.astype(np.uint8))


def _quantize_q5_0(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    """x (n, 32) float32 -> out (n, 22) uint8: f16 d, the 32 fifth bits (u32), 16 bytes of low nibbles."""
    v = work.v[: len(x)]
    ax = np.abs(x, out=v)
    d = _pick(x, ax.argmax(axis=1)) / np.float32(-16)  # (n, 1)
    out[:, 0:2] = _float16(d, "scale")
    np.multiply(x, _inverse(d), out=v)
    v += np.float32(16.5)
    np.trunc(v, out=v)
    np.clip(v, 0, 31, out=v)
    q = v.astype(np.uint8)
    out[:, 2:6] = np.packbits(q >> 4, axis=1, bitorder="little")
    out[:, 6:] = _pack_nibbles(q & np.uint8(15))


def _quantize_iq4_nl(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    if not np.isfinite(x).all():  # the clear error before the search
        _float16(np.abs(x).max(axis=1, keepdims=True), "scale")
    quantize_iq4_nl(x, out)
    _float16(out[:, 0:2].copy().view(np.float16).astype(np.float32), "scale")  # overflow


def _quantize_q4_k(x: np.ndarray, out: np.ndarray, work: _Work) -> None:
    if not np.isfinite(x).all():
        _float16(np.abs(x).max(axis=1, keepdims=True), "scale")
    quantize_q4_k(x, out)
    _float16(out[:, 0:4].copy().view(np.float16).astype(np.float32), "scale")


_QUANTIZERS = {2: _quantize_q4_0, 3: _quantize_q4_1, 6: _quantize_q5_0, 8: _quantize_q8_0, 12: _quantize_q4_k,
               20: _quantize_iq4_nl}


def storage_type(ggml_type: int, row_length: int) -> int | None:
    """The type a row of `row_length` is stored in for `ggml_type`: it, its FALLBACK, or None (stays float)."""
    for t in (ggml_type, FALLBACK.get(ggml_type)):
        if t is not None and row_length % FORMATS[t][0] == 0:
            return t
    return None


def quantize(array: np.ndarray, ggml_type: int) -> np.ndarray:
    """`array` (N, K) float32 -> GGML blocks (N, K // block * type_size) uint8, as llama-quantize (no imatrix)."""
    if ggml_type not in _QUANTIZERS:
        supported = ", ".join(f"{GGML_TYPES[t]} ({t})" for t in sorted(_QUANTIZERS))
        name = GGML_TYPES.get(ggml_type, "unknown")
        raise ValueError(f"cannot quantize to ggml type {ggml_type} ({name}); supported: {supported}")
    block_size, type_size = FORMATS[ggml_type]
    x = np.asarray(array)
    if x.ndim == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(f"quantizing needs rows of a multiple of {block_size} elements, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"quantizing needs float weights, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((*x.shape[:-1], x.shape[-1] // block_size * type_size), dtype=np.uint8)
    if x.size == 0:
        return out

    blocks, out_blocks = x.reshape(-1, block_size), out.reshape(-1, type_size)
    fn = _QUANTIZERS[ggml_type]
    n_blocks = blocks.shape[0]
    chunk = CHUNK_BLOCKS * BLOCK_SIZE // block_size  # 256 KiB whatever the block
    n_threads = max(1, min(os.cpu_count() or 1, n_blocks // chunk))

    def run(thread: int) -> None:
        """This thread's contiguous share of the blocks, chunk by chunk."""
        begin, end = n_blocks * thread // n_threads, n_blocks * (thread + 1) // n_threads
        work = _Work(min(CHUNK_BLOCKS, (end - begin) * block_size // BLOCK_SIZE))
        for start in range(begin, end, chunk):
            stop = min(start + chunk, end)
            fn(blocks[start:stop], out_blocks[start:stop], work)

    if n_threads == 1:
        run(0)
    else:
        with ThreadPoolExecutor(max_workers=n_threads) as pool:
            list(pool.map(run, range(n_threads)))  # re-raises a worker's exception
    return out
