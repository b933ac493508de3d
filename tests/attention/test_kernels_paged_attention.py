"""Phase 5: the paged-attention kernels (kernels/<device>/paged_attention.*) against the portable paged attention.

On the CPU the C kernel runs through the same tinygrad program path the GPU kernels take. The CUDA source is
compiled here (nvrtc through tinygrad's own CUDA compiler, or nvcc) and run only where a CUDA device exists;
the Metal source runs only on macOS.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_emulation import can_emulate, check_ptx, compile_cuda, device_or_skip, run_emulated
from tinygrad import Tensor, TinyJit, UOp, dtypes, function

from tinyvllm.attention import kernel_backend
from tinyvllm.attention.kernel_backend import (
    KernelPagedAttentionMetadata,
    kernel_paged_attention,
    kernel_reshape_and_cache,
    uses_kernels,
)
from tinyvllm.attention.paged import PagedAttentionMetadata, paged_attention, reshape_and_cache
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels.launcher import device_kind

on_cpu = pytest.mark.skipif(not kernel_backend.has_kernel("CPU"), reason="no C kernel for this CPU compiler")


def make_case(block_size: int, n_heads: int, n_kv_heads: int, head_dim: int, lengths: list[int], seed: int,
              device: str | None = None, cache_dtype=dtypes.float32) -> dict:
    """A batch of rows of different lengths, their blocks scattered over a pool filled with random K/V
    (slots past a row's length hold noise too: they must never be read)."""
    rng = np.random.default_rng(seed)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1  # one padding entry past the longest row
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    free = list(rng.permutation(num_blocks))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    for i, n in enumerate(lengths):
        tables[i, : -(-n // block_size)] = [free.pop() for _ in range(-(-n // block_size))]
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    return {
        "q": Tensor(rng.standard_normal((len(lengths), n_heads, head_dim), dtype=np.float32), device=device),
        "k_cache": Tensor(rng.standard_normal(shape, dtype=np.float32), device=device).cast(cache_dtype).realize(),
        "v_cache": Tensor(rng.standard_normal(shape, dtype=np.float32), device=device).cast(cache_dtype).realize(),
        "block_tables": Tensor(tables, device=device),
        "context_lens": Tensor(np.array(lengths, np.int32), device=device),
    }


def portable_reference(case: dict) -> np.ndarray:
    """The Phase 2 paged attention on the same tensors: each row one query at position context_len - 1."""
    q, R = case["q"], case["q"].shape[0]
    out = paged_attention(q.reshape(R, 1, *q.shape[1:]), case["k_cache"], case["v_cache"], case["block_tables"],
                          case["block_tables"].shape[1], (case["context_lens"] - 1).reshape(R, 1))
    return out.numpy().reshape(q.shape)


def kernel_output(case: dict) -> np.ndarray:
    return kernel_paged_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                  case["context_lens"]).numpy()


# every pair of (block size, GQA ratio, head dim) appears once: 9 shapes instead of 18 compilations of both paths
SHAPES = [(8, 1, 64), (8, 3, 128), (8, 4, 64), (16, 1, 128), (16, 3, 64), (16, 4, 128), (32, 1, 64), (32, 3, 128),
          (32, 4, 64)]


@on_cpu
@pytest.mark.parametrize("block_size,group,head_dim", SHAPES)
def test_attention_matches_portable(block_size: int, group: int, head_dim: int):
    n_kv_heads = 2 if group > 1 else 3
    # lengths: one token, a block minus one, a full block, partial last blocks, a long row
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70]
    case = make_case(block_size, group * n_kv_heads, n_kv_heads, head_dim, lengths, seed=block_size + group + head_dim)
    assert uses_kernels(case["q"], case["k_cache"])
    np.testing.assert_allclose(kernel_output(case), portable_reference(case), atol=1e-5, rtol=1e-5)


@on_cpu
def test_reshape_and_cache_matches_portable():
    rng = np.random.default_rng(3)
    k_cache, v_cache = (Tensor(rng.standard_normal((7, 8, 3, 64), dtype=np.float32)).realize() for _ in range(2))
    key, value = (Tensor(rng.standard_normal((5, 3, 64), dtype=np.float32)) for _ in range(2))
    slots = Tensor(np.array([9, 0, 55, 17, 30], np.int32))
    k_ref = reshape_and_cache(key, k_cache.clone().realize(), slots).numpy()
    v_ref = reshape_and_cache(value, v_cache.clone().realize(), slots).numpy()
    k_out, v_out = kernel_reshape_and_cache(key, value, k_cache, v_cache, slots)
    np.testing.assert_array_equal(k_out.numpy(), k_ref)
    np.testing.assert_array_equal(v_out.numpy(), v_ref)


@on_cpu
def test_reshape_and_cache_skips_negative_slots():
    cache = Tensor.zeros(4, 2, 1, 8).contiguous().realize()  # 8 slots
    new = np.arange(3 * 8, dtype=np.float32).reshape(3, 1, 8) + 1
    k_out, v_out = kernel_reshape_and_cache(Tensor(new), Tensor(-new), cache, cache.clone().realize(),
                                            Tensor(np.array([5, -1, 2], np.int32)))
    expected = np.zeros((8, 1, 8), np.float32)
    expected[5], expected[2] = new[0], new[2]
    np.testing.assert_array_equal(k_out.numpy().reshape(8, 1, 8), expected)
    np.testing.assert_array_equal(v_out.numpy().reshape(8, 1, 8), -expected)


@on_cpu
def test_prompt_chunks_attend_causally():
    """(B, T) tokens with one block table row per sequence, as a single-sequence prompt chunk comes: each token
    becomes its own query row over keys 0 .. its position, equal to the portable causal mask."""
    B, T, H, KvH, Hd, bs = 2, 5, 4, 2, 64, 4
    rng = np.random.default_rng(6)
    tables = np.array([[3, 0, 4], [1, 5, 2]], np.int32)
    positions = np.array([np.arange(2, 2 + T), np.arange(6, 6 + T)], np.int32)  # chunks after 2 and 6 cached tokens
    slots = np.concatenate([tables[b, positions[b] // bs] * bs + positions[b] % bs for b in range(B)]).astype(np.int32)
    q, k, v = (Tensor(rng.standard_normal(s, dtype=np.float32)) for s in [(B, T, H, Hd)] + [(B, T, KvH, Hd)] * 2)
    cached = [rng.standard_normal((6, bs, KvH, Hd), dtype=np.float32) for _ in range(2)]  # the earlier tokens' K/V
    outs = {}
    for cls in (KernelPagedAttentionMetadata, PagedAttentionMetadata):
        caches = tuple(Tensor(c).realize() for c in cached)  # the same start for both paths
        metadata = cls(Tensor(slots), Tensor(tables), Tensor(positions), 3)
        outs[cls.__name__] = metadata.attend(q, k, v, caches).numpy()
    np.testing.assert_allclose(outs["KernelPagedAttentionMetadata"], outs["PagedAttentionMetadata"], atol=1e-5,
                               rtol=1e-5)


def random_cache(rng, shape: tuple[int, ...], cache: str) -> tuple[Tensor, Tensor | None]:
    """A cache of `cache` elements holding random values, and its per-token scales (int8 and fp8)."""
    scales = Tensor(rng.uniform(0.01, 0.1, shape[:-1]).astype(np.float32)) if cache in ("int8", "fp8") else None
    if cache == "int8":
        return Tensor(rng.integers(-127, 128, shape).astype(np.int8)), scales
    if cache == "fp8":  # any e4m3 code but the NaNs (0x7F, 0xFF)
        return Tensor((rng.integers(0, 0x7F, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)), scales
    return Tensor(rng.standard_normal(shape, dtype=np.float32)).cast(getattr(dtypes, cache)).realize(), None


@on_cpu
@pytest.mark.parametrize("cache,group,head_dim,block_size",
                         [("float32", 3, 64, 16), ("float32", 1, 128, 8), ("float32", 4, 64, 32),
                          ("float16", 3, 64, 16), ("int8", 3, 64, 16), ("fp8", 2, 64, 8)])
def test_rows_attended_together_give_each_row_its_bits_alone(cache: str, group: int, head_dim: int, block_size: int):
    """The rows of one prompt chunk (the same block table, context lengths one apart) walk their keys together in
    one pass (paged_attention.c's attend_rows); a row alone takes the decode route (attend_chunk). Every row's
    output must be the bits of a launch of that row alone, whichever rows share its pass: so a prompt's tokens,
    chunked or not, and a decoded token get the same attention."""
    rng = np.random.default_rng(11 + group + head_dim)
    n_kv_heads, num_blocks = 2, 40
    k_cache, k_scale = random_cache(rng, (num_blocks, block_size, n_kv_heads, head_dim), cache)
    v_cache, v_scale = random_cache(rng, (num_blocks, block_size, n_kv_heads, head_dim), cache)
    max_blocks = 12
    seq_a, seq_b = rng.permutation(num_blocks)[:max_blocks], rng.permutation(num_blocks)[:max_blocks]
    # rows: a decode row; 13 tokens of sequence A after 40 cached ones; a decode row of B; B's first 3 tokens;
    # a row over A's table far past the chunk (it must not join it); A's last token again
    rows = ([(seq_b, 77)] + [(seq_a, n) for n in range(41, 54)] + [(seq_b, 90)] + [(seq_b, n) for n in (1, 2, 3)]
            + [(seq_a, 150), (seq_a, 53)])
    tables = np.stack([t for t, _ in rows]).astype(np.int32)
    lengths = np.array([n for _, n in rows], np.int32)
    q = rng.standard_normal((len(rows), group * n_kv_heads, head_dim)).astype(np.float32)
    scales = (k_scale, v_scale) if k_scale is not None else (None, None)

    def attend(i: slice) -> np.ndarray:
        return kernel_paged_attention(Tensor(q[i]), k_cache, v_cache, Tensor(tables[i]), Tensor(lengths[i]), None,
                                      *scales).numpy()

    together = attend(slice(None))
    alone = np.concatenate([attend(slice(i, i + 1)) for i in range(len(rows))])
    assert np.isfinite(together).all()
    np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32))


@on_cpu
def test_layer_under_tinyjit_replays_with_new_inputs():
    """As in the model: write then attend inside function(precompile=True), under TinyJit, one step after another
    on the same caches; the kernel path and the portable path stay equal step by step."""
    B, T, H, KvH, Hd, bs, max_blocks = 3, 1, 6, 2, 64, 8, 4
    rng = np.random.default_rng(5)
    caches = {name: [Tensor.zeros(10, bs, KvH, Hd).contiguous().realize() for _ in range(2)]
              for name in ("kernel", "portable")}

    @function(precompile=True)
    def layer(q, k, v, k_cache, v_cache, metadata):
        return metadata.attend(q, k, v, (k_cache, v_cache))

    def step(q, k, v, slots, tables, positions, num_blocks, name):
        cls = KernelPagedAttentionMetadata if name == "kernel" else PagedAttentionMetadata
        metadata = cls(slots, tables, positions, num_blocks)
        return (layer(q, k, v, *caches[name], metadata) * 1).realize()  # an op after the function's output

    jits = {name: TinyJit(lambda *a, name=name: step(*a, name=name)) for name in caches}
    v_num_blocks = UOp.variable("num_blocks", 1, max_blocks)
    tables = np.array([[1, 4, 7, 2], [0, 3, 9, 5], [6, 8, 2, 1]], np.int32)
    for pos in range(9, 13):  # run, capture, replay, replay; position 16 would start the third block
        q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in [(B, T, H, Hd)] + [(B, T, KvH, Hd)] * 2)
        positions = np.array([[pos], [pos - 9], [pos - 4]], np.int32)
        slots = np.array([tables[b, p // bs] * bs + p % bs for b, p in enumerate(positions[:, 0])], np.int32)
        outs = {name: jit(*(Tensor(a).realize() for a in (q, k, v, slots, tables, positions)),
                          v_num_blocks.bind(int(positions.max()) // bs + 1)).numpy() for name, jit in jits.items()}
        np.testing.assert_allclose(outs["kernel"], outs["portable"], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(caches["kernel"][0].numpy(), caches["portable"][0].numpy())
    names = [c.src[0].arg.name for c in jits["kernel"].captured.linear.src if c.src[0].op.name == "PROGRAM"]
    assert any(n.startswith("paged_attention_") for n in names), names


@on_cpu
def test_greedy_tokens_identical_on_the_real_model(generator):
    from fake_engine import run_offline
    from tinyvllm.sampling_params import SamplingParams

    prompt = [504, 3575, 282, 4649, 314, 253, 3469, 338, 1296, 5145, 28, 672, 314, 3575, 282, 4649, 30, 198]
    # 18 prompt tokens and 4 new ones over blocks of 16: the decodes cross into the second block
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    # the session's Generator runs the kernels (the default; its engine's graphs are shared with the other tests)
    assert not generator.engine.model_runner.portable_attention
    kernel = run_offline(generator.engine, prompt, params).outputs[0]
    portable_engine = LLMEngine(generator.model, tokenizer=generator.tokenizer, max_model_len=64,
                                num_gpu_blocks_override=4, portable_attention=True)
    portable = run_offline(portable_engine, prompt, params).outputs[0]
    assert kernel.token_ids == portable.token_ids
    np.testing.assert_allclose([lp for _, lp in kernel.logprobs[0][1]], [lp for _, lp in portable.logprobs[0][1]],
                               atol=1e-4, rtol=1e-4)


def test_selection_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    q, cache = Tensor.empty(2, 4, 64), Tensor.empty(3, 8, 2, 64)
    assert not uses_kernels(q, cache, portable=True)
    monkeypatch.setattr(kernel_backend, "PORTABLE", True)
    assert not uses_kernels(q, cache)
    monkeypatch.setattr(kernel_backend, "PORTABLE", False)
    if device_kind(q.device) == "CPU":
        assert uses_kernels(q, cache.cast(dtypes.float16)) and uses_kernels(q, cache.cast(dtypes.int8))  # Phase 7c
        assert not uses_kernels(q.cast(dtypes.float16), cache)  # the C kernel's queries are float32
        assert not uses_kernels(Tensor.empty(2, 4, 12), Tensor.empty(3, 8, 2, 12))  # head_dim not a multiple of 8
    assert kernel_backend.has_kernel("CUDA") and kernel_backend.has_kernel("METAL")
    assert not kernel_backend.has_kernel("PYTHON")
    # a GPU thread block's shared memory: SmolLM2 (3 heads per KV head, 64) and Llama-3-70B (8, 128) fit in 48 KiB
    limit = kernel_backend.GPU_SHARED_BYTES
    assert kernel_backend.gpu_shared_bytes(8, 128) <= limit < kernel_backend.gpu_shared_bytes(16, 256)
    # a device without a kernel: the portable path, said once
    monkeypatch.setattr(kernel_backend, "has_kernel", lambda device: False)
    monkeypatch.setattr(kernel_backend, "_noticed", set())
    with caplog.at_level(logging.WARNING, logger="tinyvllm.attention"):
        assert not uses_kernels(q, cache) and not uses_kernels(q, cache)
    assert len([r for r in caplog.records if "portable paged attention" in r.getMessage()]) == 1


# ---- CUDA: compiled here; run where a CUDA device exists ----

CUDA_CASES = [("paged_attention", {"TV_NUM_SEQS": 4, "TV_NUM_HEADS": 9, "TV_NUM_KV_HEADS": 3, "TV_HEAD_DIM": 64,
                                   "TV_BLOCK_SIZE": 16, "TV_MAX_BLOCKS": 8, "TV_SCALE": "0.125f"}),
              ("paged_attention", {"TV_NUM_SEQS": 32, "TV_NUM_HEADS": 8, "TV_NUM_KV_HEADS": 2, "TV_HEAD_DIM": 128,
                                   "TV_BLOCK_SIZE": 32, "TV_MAX_BLOCKS": 64, "TV_SCALE": "0.08838834764831845f"}),
              ("reshape_and_cache", {"TV_NUM_TOKENS": 8, "TV_NUM_KV_HEADS": 3, "TV_HEAD_DIM": 64, "TV_NUM_SLOTS": 512})]
# flash-decoding's two kernels at SmolLM2's shapes with the engine's table (block_size 16, 8192 keys: 16 partitions)
SPLIT = {"TV_NUM_SEQS": 64, "TV_NUM_HEADS": 9, "TV_NUM_KV_HEADS": 3, "TV_HEAD_DIM": 64, "TV_BLOCK_SIZE": 16,
         "TV_MAX_BLOCKS": 512, "TV_SCALE": "0.125f", "TV_PARTITION_SIZE": kernel_backend.PARTITION_SIZE}
CUDA_CASES += [("paged_attention_split", SPLIT), ("paged_attention_reduce", SPLIT)]


@pytest.mark.parametrize("entry,defines", CUDA_CASES)
@pytest.mark.parametrize("t,cache_t", [("float", "float"), ("float", "half"), ("half", "half")])
def test_cuda_source_compiles(entry: str, defines: dict, t: str, cache_t: str, tmp_path: Path):
    defines = {**defines, "TV_NUM_THREADS": kernel_backend.NUM_THREADS, "TV_T": t, "TV_CACHE_T": cache_t}
    name, source = kernel_backend.kernel_source(entry, "CUDA", defines)
    ptx = compile_cuda(source, tmp_path)
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, name)  # the name tinygrad's CUDA runtime looks up; no spills


@pytest.mark.parametrize("entry", ["paged_attention", "paged_attention_split", "paged_attention_reduce"])
def test_cuda_source_compiles_for_an_older_arch(entry: str, tmp_path: Path):
    # Turing (sm_75), an fp8 cache: the e4m3 bit arithmetic where sm_89+ has cvt instructions
    defines = {**SPLIT, "TV_NUM_THREADS": kernel_backend.NUM_THREADS, "TV_T": "half", "TV_CACHE_T": "unsigned char",
               "TV_CACHE_BITS": 8, "TV_KV_QUANT": 2}
    name, source = kernel_backend.kernel_source(entry, "CUDA", defines)
    ptx = compile_cuda(source, tmp_path, arch="sm_75")
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, name)


# ---- the GPU sources, run on the CPU under a small emulation of the GPU thread model (tests/gpu_emulation.py) ----
# This checks the kernels' index arithmetic, their online softmax, the warps' merge and the float16 caches where no
# GPU is available; not the real compilers (CUDA is compiled above; Metal is not), nor timing, nor memory-model
# subtleties a real GPU could expose.

@pytest.mark.skipif(not can_emulate(), reason="needs clang++ on x86-64 Linux")
@pytest.mark.parametrize("language,block_size,group,head_dim,cache_t",
                         [("cuda", 8, 4, 128, "float"), ("metal", 16, 3, 64, "float"), ("cuda", 16, 3, 64, "half")])
def test_gpu_kernels_under_cpu_emulation(language: str, block_size: int, group: int, head_dim: int, cache_t: str,
                                         tmp_path: Path):
    # one shape per language keeps this short; the CPU tests cover the grid of shapes
    cache_dtype, tol = (dtypes.float32, 1e-5) if cache_t == "float" else (dtypes.float16, 1e-4)
    lengths = [1, block_size + 1, 70, 200]  # 200: all 4 warps get tiles, and the merge has work to do
    case = make_case(block_size, group * 2, 2, head_dim, lengths, seed=11, cache_dtype=cache_dtype)
    q, k_cache, v_cache = (case[n].numpy() for n in ("q", "k_cache", "v_cache"))
    tables, context_lens = case["block_tables"].numpy(), case["context_lens"].numpy()
    out = np.full_like(q, np.nan)
    types = {"TV_NUM_THREADS": kernel_backend.NUM_THREADS, "TV_T": "float", "TV_CACHE_T": cache_t}
    defines = {"TV_NUM_SEQS": len(lengths), "TV_NUM_HEADS": group * 2, "TV_NUM_KV_HEADS": 2,
               "TV_HEAD_DIM": head_dim, "TV_BLOCK_SIZE": block_size, "TV_MAX_BLOCKS": tables.shape[1],
               "TV_SCALE": f"{float(1 / np.sqrt(head_dim))!r}f", **types}
    run_emulated(language, "paged_attention", defines, [out, q, k_cache, v_cache, tables, context_lens],
                 (2, len(lengths)), kernel_backend.NUM_THREADS, tmp_path)
    np.testing.assert_allclose(out, portable_reference(case), atol=tol, rtol=tol)
    # the write: K and V rows at their slots (rounded to the cache's type), a negative slot skipped
    key, value = np.full((3, 2, 64), 1 / 3, np.float32), -np.ones((3, 2, 64), np.float32)
    k_cache, v_cache = (np.zeros((4, 8, 2, 64), k_cache.dtype) for _ in range(2))
    slots = np.array([5, -1, 30], np.int32)
    run_emulated(language, "paged_attention", {"TV_NUM_TOKENS": 3, "TV_NUM_KV_HEADS": 2, "TV_HEAD_DIM": 64,
                                               "TV_NUM_SLOTS": 32, **types},
                 [k_cache, v_cache, key, value, slots], (3, 1), kernel_backend.NUM_THREADS, tmp_path,
                 entry="reshape_and_cache")
    written = np.flatnonzero(k_cache.reshape(32, -1).any(axis=1))
    assert list(written) == [5, 30] and (v_cache.reshape(32, -1)[written] == -1).all()
    assert (k_cache.reshape(32, -1)[written] == k_cache.dtype.type(1 / 3)).all()  # float16: round to nearest even


@pytest.mark.skipif(not can_emulate(), reason="needs clang++ on x86-64 Linux")
@pytest.mark.parametrize("language,cache_t", [("cuda", "half"), ("metal", "float")])
def test_split_attention_under_cpu_emulation(language: str, cache_t: str, tmp_path: Path):
    # flash-decoding as gpu_attention_launches lays it out, with partitions of 128 keys so that short rows span
    # several (the engine's are 512): row lengths 1, 70 and 200 fill 1, 1 and 2 partitions of the table's 2 (14
    # blocks of 16; a partition past a row's keys has m = -inf, skipped by the merge); SmolLM2's 9 heads, 3 KV heads
    cache_dtype, tol = (dtypes.float32, 1e-5) if cache_t == "float" else (dtypes.float16, 1e-4)
    block_size, heads, kv_heads, head_dim, lengths = 16, 9, 3, 64, [1, 70, 200]
    case = make_case(block_size, heads, kv_heads, head_dim, lengths, seed=5, cache_dtype=cache_dtype)
    q, k_cache, v_cache = (case[n].numpy() for n in ("q", "k_cache", "v_cache"))
    tables, context_lens = case["block_tables"].numpy(), case["context_lens"].numpy()
    split, reduce = kernel_backend.gpu_attention_launches(len(lengths), heads, kv_heads, tables.shape[1] * block_size,
                                                          partition_size=128)
    parts = split.grid[0] // kv_heads
    assert (split.entry, reduce.entry, parts) == ("paged_attention_split", "paged_attention_reduce", 2)
    defines = {"TV_NUM_SEQS": len(lengths), "TV_NUM_HEADS": heads, "TV_NUM_KV_HEADS": kv_heads,
               "TV_HEAD_DIM": head_dim, "TV_BLOCK_SIZE": block_size, "TV_MAX_BLOCKS": tables.shape[1],
               "TV_SCALE": f"{float(1 / np.sqrt(head_dim))!r}f", "TV_NUM_THREADS": kernel_backend.NUM_THREADS,
               "TV_T": "float", "TV_CACHE_T": cache_t, "TV_PARTITION_SIZE": 128}
    partials = np.full((len(lengths), heads, parts, 2 + head_dim), np.nan, np.float32)
    run_emulated(language, "paged_attention", defines, [partials, q, k_cache, v_cache, tables, context_lens],
                 split.grid[:2], kernel_backend.NUM_THREADS, tmp_path, entry=split.entry)
    assert not np.isnan(partials).any()  # every (row, head, partition) written
    assert (partials[0, :, 1:, 0] == -np.inf).all() and (partials[0, :, 1:, 1:] == 0).all()  # past the context
    out = np.full_like(q, np.nan)
    run_emulated(language, "paged_attention", defines, [out, partials, context_lens], reduce.grid[:2],
                 kernel_backend.NUM_THREADS, tmp_path, entry=reduce.entry)
    np.testing.assert_allclose(out, portable_reference(case), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,max_keys,entries", [(1, 8192, ["paged_attention_split", "paged_attention_reduce"]),
                                                   (64, 8192, ["paged_attention_split", "paged_attention_reduce"]),
                                                   (256, 8192, ["paged_attention"]),
                                                   (1, 512, ["paged_attention"])])
def test_gpu_attention_route(rows: int, max_keys: int, entries: list[str], monkeypatch: pytest.MonkeyPatch):
    # what kernel_paged_attention puts into the graph on a GPU (launches recorded, the device said to be CUDA), at
    # SmolLM2's heads: split while rows x 3 KV heads <= 512 and the table holds more than one partition of 512 keys
    launches = []

    def record(entry, outs, ins, defines, grid):
        launches.append((entry, grid, [tuple(t.shape) for t in outs + ins], defines.get("TV_PARTITION_SIZE")))
        return outs

    monkeypatch.setattr(kernel_backend.launcher, "device_kind", lambda device: "CUDA")
    monkeypatch.setattr(kernel_backend, "_launch", record)
    block_size, heads, kv_heads, head_dim = 16, 9, 3, 64
    cache = Tensor.empty(8, block_size, kv_heads, head_dim)
    out = kernel_paged_attention(Tensor.empty(rows, heads, head_dim), cache, cache,
                                 Tensor.empty(rows, max_keys // block_size, dtype=dtypes.int32),
                                 Tensor.empty(rows, dtype=dtypes.int32))
    assert out.shape == (rows, heads, head_dim) and [entry for entry, *_ in launches] == entries
    expected = kernel_backend.gpu_attention_launches(rows, heads, kv_heads, max_keys)
    assert [grid for _, grid, *_ in launches] == [s.grid for s in expected]
    if len(entries) == 2:
        parts = max_keys // kernel_backend.PARTITION_SIZE
        assert launches[0][2][0] == (rows, heads, parts, 2 + head_dim) and launches[0][3] == 512
        assert launches[1][2] == [(rows, heads, head_dim), (rows, heads, parts, 2 + head_dim), (rows,)]


def check_on_device(device: str):
    for cache_dtype, tol in [(dtypes.float32, 1e-5), (dtypes.float16, 1e-4)]:
        for block_size, group, head_dim in SHAPES[::2]:
            lengths = [1, block_size + 1, 3 * block_size + 5, 300]
            case = make_case(block_size, 2 * group, 2, head_dim, lengths, seed=7, device=device,
                             cache_dtype=cache_dtype)
            assert uses_kernels(case["q"], case["k_cache"])
            np.testing.assert_allclose(kernel_output(case), portable_reference(case), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_kernel_matches_portable():
    check_on_device(device_or_skip("CUDA"))


@pytest.mark.metal
@pytest.mark.skipif(sys.platform != "darwin", reason="Metal is macOS only")
def test_metal_kernel_matches_portable():
    check_on_device(device_or_skip("METAL"))
