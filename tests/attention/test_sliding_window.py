"""Sliding-window attention (Mistral, Gemma 3) in the paged-attention kernels: the C kernel and the CUDA / Metal
twins (under the CPU emulation) against the portable paged attention's mask, for rows shorter and longer than
the window. The whole models with a window are checked against HF in tests/model/test_architectures.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_emulation import can_emulate, run_emulated
from test_kernels_paged_attention import make_case
from tinygrad import Tensor

from tinyvllm.attention import kernel_backend
from tinyvllm.attention.kernel_backend import kernel_paged_attention
from tinyvllm.attention.paged import paged_attention

LENGTHS = [1, 7, 8, 9, 30, 70]  # shorter than, equal to and longer than the windows below


def windowed_reference(case: dict, window: int) -> np.ndarray:
    """The portable path, each row one query at position context_len - 1, masked to its last `window` keys."""
    q, R = case["q"], case["q"].shape[0]
    out = paged_attention(q.reshape(R, 1, *q.shape[1:]), case["k_cache"], case["v_cache"], case["block_tables"],
                          case["block_tables"].shape[1], (case["context_lens"] - 1).reshape(R, 1),
                          sliding_window=window)
    return out.numpy().reshape(q.shape)


@pytest.mark.skipif(not kernel_backend.has_kernel("CPU"), reason="no C kernel for this CPU compiler")
def test_window_portable_and_c_kernel():
    """The portable mask against attention written out in numpy over each row's last W keys; the C kernel
    against the portable path; and the C kernel never reads the blocks wholly before the window."""
    block_size, window = 4, 8
    case = make_case(block_size, 4, 2, 16, LENGTHS, seed=3)
    q, k, v = (case[n].numpy() for n in ("q", "k_cache", "v_cache"))
    tables = case["block_tables"].numpy()
    expected = windowed_reference(case, window)
    for r, n in enumerate(LENGTHS):
        pos = np.arange(max(0, n - window), n)
        keys, values = k[tables[r, pos // block_size], pos % block_size], v[tables[r, pos // block_size],
                                                                              pos % block_size]  # (S, KvH, Hd)
        for h in range(4):
            scores = keys[:, h // 2] @ q[r, h] / 4.0
            p = np.exp(scores - scores.max())
            np.testing.assert_allclose(expected[r, h], (p / p.sum()) @ values[:, h // 2], atol=1e-5, rtol=1e-5)

    out = kernel_paged_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                 case["context_lens"], sliding_window=window).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    for r, n in enumerate(LENGTHS):  # poison the blocks behind each row's window: the output does not move
        for b in range(max(0, n - window) // block_size):
            k[tables[r, b]] = np.nan
    poisoned = kernel_paged_attention(case["q"], Tensor(k), case["v_cache"], case["block_tables"],
                                      case["context_lens"], sliding_window=window).numpy()
    np.testing.assert_array_equal(poisoned, out)


@pytest.mark.skipif(not can_emulate(), reason="needs clang++ on x86-64 Linux")
@pytest.mark.parametrize("language", ["cuda", "metal"])
def test_gpu_twins_window_under_cpu_emulation(language: str, tmp_path: Path):
    window, lengths = 20, [1, 9, 70, 200]  # 200: every warp has tiles inside the window
    case = make_case(8, 6, 2, 64, lengths, seed=5)
    q, k_cache, v_cache = (case[n].numpy() for n in ("q", "k_cache", "v_cache"))
    tables, context_lens = case["block_tables"].numpy(), case["context_lens"].numpy()
    out = np.full_like(q, np.nan)
    defines = {"TV_NUM_SEQS": len(lengths), "TV_NUM_HEADS": 6, "TV_NUM_KV_HEADS": 2, "TV_HEAD_DIM": 64,
               "TV_BLOCK_SIZE": 8, "TV_MAX_BLOCKS": tables.shape[1], "TV_SCALE": f"{float(1 / 8)!r}f",
               "TV_NUM_THREADS": kernel_backend.NUM_THREADS, "TV_T": "float", "TV_CACHE_T": "float",
               "TV_SLIDING_WINDOW": window}
    run_emulated(language, "paged_attention", defines, [out, q, k_cache, v_cache, tables, context_lens],
                 (2, len(lengths)), kernel_backend.NUM_THREADS, tmp_path)
    np.testing.assert_allclose(out, windowed_reference(case, window), atol=1e-5, rtol=1e-5)
