"""copy_blocks, the copy-on-write kernel (kernels/<device>/copy_blocks.*), against the portable tinygrad copy and numpy.

On the CPU the C kernel runs through tinygrad's program path, inside a captured graph; the CUDA source is compiled
to PTX here (nvrtc or nvcc); the CUDA and Metal sources also run on the CPU under the emulation of the GPU thread
model (tests/gpu_emulation.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tinyvllm.attention import copy_blocks as cb
from tinyvllm.kernels import launcher

from gpu_emulation import can_emulate, check_ptx, compile_cuda, run_emulated

on_cpu = pytest.mark.skipif(not cb.has_kernel("CPU"), reason="no C kernel for this CPU compiler")

# per-layer tensors of one KV cache, block first: K/V of every dtype a cache may have, and a quantized cache's scales
SHAPES = {"float32": ((9, 4, 3, 8), np.float32), "float16": ((9, 4, 3, 8), np.float16),
          "int8": ((9, 4, 3, 8), np.int8), "scales": ((9, 4, 3), np.float32)}
PAIRS = [(1, 5), (1, 6), (3, 0), (8, 8)]  # one source twice, a block copied down, a padding pair (src == dst)


def random_cache(name: str, seed: int = 0) -> np.ndarray:
    shape, dtype = SHAPES[name]
    rng = np.random.default_rng(seed)
    if dtype == np.int8:
        return rng.integers(-128, 128, shape).astype(np.int8)
    return rng.standard_normal(shape).astype(dtype)


def expected(cache: np.ndarray, pairs) -> np.ndarray:
    out = cache.copy()
    for src, dst in pairs:
        out[dst] = cache[src]
    return out


@on_cpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_matches_portable_and_numpy(name):
    host = random_cache(name)
    mapping = Tensor(np.array(PAIRS, np.int32))
    by_kernel, by_portable = Tensor(host).realize(), Tensor(host).realize()
    assert cb.uses_kernel(by_kernel) and not cb.uses_kernel(by_portable, portable=True)
    cb.kernel_copy_blocks(by_kernel, mapping).realize()
    cb.copy_blocks_portable(by_portable, mapping).realize()
    want = expected(host, PAIRS)
    assert (want != host).any()  # the copies change something
    np.testing.assert_array_equal(by_kernel.numpy(), want)  # in place: the caches' own buffers hold the copies
    np.testing.assert_array_equal(by_portable.numpy(), want)


@pytest.mark.parametrize("portable", [False, True])
def test_copies_of_a_step_in_a_captured_graph_over_every_cache_tensor(portable):
    hosts = [random_cache(name, seed) for seed, name in enumerate(SHAPES)]
    caches = [Tensor(h).realize() for h in hosts]
    copier = cb.CopyBlocks(caches, null_block=8, portable=portable)
    for pairs in ([(2, 4)], [(0, 7), (5, 1), (6, 3)], [(7, 2)], [(1, 0), (3, 2), (5, 4)]):  # sizes 1, 4 (padded), 1, 4
        copier(pairs)
        hosts = [expected(h, pairs) for h in hosts]
        for cache, host in zip(caches, hosts):
            np.testing.assert_array_equal(cache.numpy(), host)
    assert sorted(copier._jits) == [1, 4]  # one graph per padded size, replayed with new pairs


# ---- the GPU sources ----

@pytest.mark.parametrize("t", ["unsigned char", "unsigned short", "unsigned int"])
def test_cuda_source_compiles(t: str, tmp_path: Path):
    defines = {"TV_NUM_PAIRS": 8, "TV_NUM_BLOCKS": 1025, "TV_BLOCK_NUMEL": 3072, "TV_NUM_THREADS": cb.NUM_THREADS,
               "TV_T": t}
    name, source = launcher.program_source(cb.KERNEL, "CUDA", defines)
    ptx = compile_cuda(source, tmp_path)
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, name)


@pytest.mark.skipif(not can_emulate(), reason="needs clang++ on x86-64 Linux")
@pytest.mark.parametrize("language,t", [("cuda", "unsigned int"), ("metal", "uint")])
def test_gpu_sources_under_cpu_emulation(language: str, t: str, tmp_path: Path):
    host = random_cache("float32", seed=3)
    cache = host.reshape(host.shape[0], -1).view(np.uint32).copy()  # bits: the kernel copies unsigned ints
    pairs = PAIRS + [(-1, 2), (4, 99)]  # out-of-range pairs are skipped too
    defines = {"TV_NUM_PAIRS": len(pairs), "TV_NUM_BLOCKS": cache.shape[0], "TV_BLOCK_NUMEL": cache.shape[1],
               "TV_NUM_THREADS": 64, "TV_T": t}  # 64 threads over 96 elements: some threads copy two
    run_emulated(language, cb.KERNEL, defines, [cache, np.array(pairs, np.int32)], (len(pairs), 1), 64, tmp_path)
    np.testing.assert_array_equal(cache.view(np.float32).reshape(host.shape), expected(host, PAIRS))


def test_a_cache_of_any_dtype_takes_the_kernel_of_its_element_size():
    assert cb.BITS_TYPES["CPU"][dtypes.float16.itemsize] == "unsigned short"
    assert all(size in cb.BITS_TYPES[kind] for kind in cb.BITS_TYPES for size in (1, 2, 4))
