"""The sampler kernel's GPU twins (kernels/cuda/sampler.cu, kernels/metal/sampler.metal) under the CPU emulation of
the GPU thread model (tests/gpu_emulation.py): the same tokens and thresholds as the CPU kernel (which
tests/sample/test_device_sampler.py checks against the host reference), for greedy rows, the race alone, and every
filter; the CUDA source is also compiled with nvrtc at the model's shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_emulation import can_emulate, check_ptx, compile_cuda, kernel_file_source, run_emulated
from tinygrad import Tensor

from tinyvllm.sample import device_sampler, noise, sampler_kernel

pytestmark = pytest.mark.skipif(not can_emulate(), reason="the GPU emulation needs clang++ on x86-64 Linux")

NUM_THREADS = 64
# temperature, top_k (vocab = off), top_p, min_p per row
ROWS = [(0.0, 0, 1.0, 0.0), (0.8, 40, 0.95, 0.05), (1.0, 0, 0.95, 0.0), (0.7, 40, 1.0, 0.0), (1.0, 0, 1.0, 0.0),
        (1.5, 0, 1.0, 0.2), (0.9, 5, 0.5, 0.0), (1.2, 1, 1.0, 0.0)]


def case(vocab: int, seed: int) -> list[np.ndarray]:
    """The kernel's arguments after its outputs: logits (LM-like: a few large, a long tail, a tie), params, keys."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((len(ROWS), vocab)) * 2).astype(np.float32)
    logits[:, rng.integers(0, vocab, 20)] += rng.uniform(3, 8, 20).astype(np.float32)
    logits[6, :12] = logits[6].max()  # a 12-way tie at the top
    logits[3, vocab // 2:] = -np.inf  # a row a grammar masked in half
    temperature, top_k, top_p, min_p = (np.array(c, dtype) for c, dtype in
                                        zip(zip(*ROWS), (np.float32, np.int32, np.float32, np.float32)))
    top_k = np.where(top_k > 0, top_k, vocab).astype(np.int32)
    return [logits, temperature, top_k, top_p, min_p, noise.draw_keys(rng, len(ROWS))]


@pytest.mark.parametrize("language", ["cuda", "metal"])
@pytest.mark.parametrize("vocab", [1003])
def test_emulated_kernel_matches_the_cpu_kernel(language: str, vocab: int, tmp_path: Path):
    ins = case(vocab, seed=vocab)
    tokens, thresholds = device_sampler.draw(*[Tensor(a) for a in ins])
    rows = len(ROWS)
    out_tokens, out_thresholds = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    scratch = np.zeros((rows, 2 * vocab), np.int32)
    run_emulated(language, "sampler", {"TV_NUM_ROWS": rows, "TV_VOCAB": vocab, "TV_NUM_THREADS": NUM_THREADS},
                 [out_tokens, out_thresholds, scratch, *ins], (rows, 1), NUM_THREADS, tmp_path)
    np.testing.assert_array_equal(out_thresholds, thresholds.numpy()[:, 0])
    np.testing.assert_array_equal(out_tokens, tokens.numpy())


@pytest.mark.parametrize("rows", [32])
def test_cuda_source_compiles(rows: int, tmp_path: Path):
    source = kernel_file_source("cuda", "sampler", {"TV_NUM_ROWS": rows, "TV_VOCAB": 49152,
                                                    "TV_NUM_THREADS": sampler_kernel.NUM_THREADS})
    ptx = compile_cuda(source, tmp_path)
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, "sampler")

