"""Phase 6: the GPU twins of the fused dequantize-matmul (kernels/cuda/qmatmul*.cu, kernels/metal/qmatmul*.metal).

No GPU here: each kernel runs under the CPU emulation of the GPU thread model (tests/gpu_emulation.py) on random
valid blocks of every format (and on the shipped model's own Q4_1 and Q8_0 rows), and is compared with numpy:
x @ dequantize(w).T, the weights dequantized by tinyvllm/model/quant.py (bit-exact with the `gguf` package). The
CUDA sources are also compiled with nvrtc at every shape the engine launches. The GEMV route (M <= 8) dequantizes in
registers and multiplies in float32 (no 8-bit rounding of x), so it agrees with the reference to float32 rounding:
the bound below is 1e-5 of sum_k |x_k w_k| (the errors measured are ~1e-3 of the bound; a swapped nibble order is far
outside it). The tiled route (M > 8) quantizes x to 8 bits as the CPU kernels do (`quantize_x`, compared byte for
byte with test_qlinear's numpy quantizer), then sums integer products: it agrees to the same bound with
x_hat @ w.T, x_hat the dequantized 8-bit x, and with the CPU kernel (kernels/cpu/qmatmul.c) itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_emulation import (
    can_emulate,
    check_ptx,
    compile_cuda,
    device_or_skip,
    kernel_file_source,
    nvrtc_compiler,
    run_emulated,
    run_emulated_source,
)

from test_qlinear import quantize_x

from tinygrad import Tensor

from tinyvllm.kernels.qlinear import (
    GPU_GEMV_MAX_M,
    QUANT_FORMATS,
    QuantizedWeight,
    gpu_launches,
    gpu_scratch_bytes,
    qlinear,
    uses_kernel,
)
from tinyvllm.model import quant
from tinyvllm.model.gguf import GGUFFile

FORMATS = QUANT_FORMATS  # ggml type -> name, block_size, type_size, kernel file
THREADS = 128  # local_size (128, 1, 1): 4 warps, one output each
RTOL = 1e-5

emulated = pytest.mark.skipif(not can_emulate(), reason="needs clang++ on x86-64 Linux")


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, type_size) uint8: random quants and packed scales, finite float16 scales where the format has
    them (d > 0 as quantizers write it; Q4_1's min and Q4_K's dmin sized as real blocks have them)."""
    type_size = FORMATS[ggml_type].type_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)

    def put_f16(offset: int, values: np.ndarray) -> None:
        blocks[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    d = rng.uniform(1e-3, 2e-2, n_blocks)
    put_f16({14: 208, 10: 80, 11: 108}.get(ggml_type, 0), d)
    if ggml_type == 10:
        put_f16(82, d * rng.uniform(0.5, 2, n_blocks))  # dmin
    if ggml_type in (3, 7):
        put_f16(2, -d * rng.uniform(4, 11, n_blocks))  # m: the block's minimum, about -8 d
    if ggml_type in (12, 13):
        put_f16(2, d * rng.uniform(0.5, 2, n_blocks))  # dmin
    return blocks


def make_case(ggml_type: int, M: int, N: int, K: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (M, K) float32, w (N, K / block * type_size) uint8, and w dequantized (N, K) float32."""
    rng = np.random.default_rng(seed)
    block_size, type_size = FORMATS[ggml_type].block_size, FORMATS[ggml_type].type_size
    w = random_blocks(ggml_type, N * K // block_size, rng).reshape(N, K // block_size * type_size)
    assert w.size == quant.tensor_nbytes(ggml_type, (N, K))  # the table agrees with quant.py
    x = rng.standard_normal((M, K), dtype=np.float32)
    return x, w, quant.dequantize(w.reshape(-1), ggml_type, (N, K))


def check_against_reference(out: np.ndarray, x: np.ndarray, w_float: np.ndarray,
                            reference: np.ndarray | None = None) -> None:
    """|out - x @ w.T| <= RTOL * (|x| @ |w|.T), elementwise: float32 rounding of a dot product of length K, with room
    for the order of the sums (per block, then across the lanes). `reference`: another result to hold out to."""
    if reference is None:
        reference = x.astype(np.float64) @ w_float.astype(np.float64).T
    bound = RTOL * (np.abs(x).astype(np.float64) @ np.abs(w_float).astype(np.float64).T)
    error = np.abs(out - reference)
    worst = np.unravel_index(np.argmax(error / bound), error.shape)
    assert (error <= bound).all(), (f"out{list(worst)} = {out[worst]!r}, reference {reference[worst]!r}: error "
                                    f"{error[worst]:.3g} over the bound {bound[worst]:.3g}")


def run_qmatmul(language: str, ggml_type: int, x: np.ndarray, w: np.ndarray, N: int, tmp_path: Path,
                scratch: np.ndarray | None = None) -> np.ndarray:
    """The kernels under emulation, launched as qlinear launches them on a GPU (qlinear.gpu_launches: the GEMV route
    for M <= 8, quantize_x then qmatmul_tiled above). `scratch`, if given, receives the tiled route's quantized x."""
    M, K = x.shape
    out = np.full((M, N), np.nan, np.float32)
    if scratch is None:
        scratch = np.zeros(max(1, gpu_scratch_bytes(M, K)), np.uint8)
    defines = {"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type}
    for step in gpu_launches(ggml_type, M, N, K):
        args = [scratch, x] if step.entry == "quantize_x" else [out, scratch, x, w]
        run_emulated(language, FORMATS[ggml_type].kernel, defines, args, step.grid[:2], step.threads, tmp_path,
                     entry=step.entry)
    return out


def x_hat(x: np.ndarray) -> np.ndarray:
    """x as the tiled route sees it: quantized to 8 bits per block of 32 as the CPU kernels do, then dequantized."""
    q, d = quantize_x(x, 32)
    return (q * d[..., None].astype(np.float64)).reshape(x.shape)


def xblocks(x: np.ndarray) -> np.ndarray:
    """The scratch bytes quantize_x must write: per block of 32, float d, float s = d * sum(q), int8 q[32]."""
    q, d = quantize_x(x, 32)
    s = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    blocks = np.zeros(d.shape, np.dtype([("d", "<f4"), ("s", "<f4"), ("q", "i1", 32)]))
    blocks["d"], blocks["s"], blocks["q"] = d, s, q
    return blocks.reshape(-1).view(np.uint8)


@emulated
@pytest.mark.parametrize("language", ["cuda", "metal"])
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=[f.name for f in FORMATS.values()])
def test_qmatmul_under_emulation_matches_numpy(language: str, ggml_type: int, tmp_path: Path):
    # K = 1280: 40 blocks (or 40 units of 32 in 5 super-blocks) per row, so lanes 0-7 take two and the rest one;
    # N = 6: the last thread block has 2 spare warps
    N, K = 6, 1280
    for M in (1, 3):
        x, w, w_float = make_case(ggml_type, M, N, K, seed=ggml_type * 10 + M)
        out = run_qmatmul(language, ggml_type, x, w, N, tmp_path)
        check_against_reference(out, x, w_float)


# every format in CUDA and in Metal (Q4_1's Metal tiles in the next test)
TILED_CASES = [("cuda", t) for t in FORMATS] + [("metal", t) for t in FORMATS if t != 3]
TILED_IDS = [f"{language}-{FORMATS[t].name}" for language, t in TILED_CASES]


@emulated
@pytest.mark.parametrize("language,ggml_type", TILED_CASES, ids=TILED_IDS)
def test_tiled_qmatmul_under_emulation_matches_numpy(language: str, ggml_type: int, tmp_path: Path):
    # M = 70, N = 72: a second row tile and a second column tile, each mostly past M and N (computed on zeros, not
    # written); K = 576 (SmolLM2's hidden size: 18 units, 9 steps of 2) for the 32-element formats, 768 (3
    # super-blocks) for the K-quants. qmatmul_tiled alone, on the scratch quantize_x would write (the next test runs
    # both); the reference is x_hat @ w.T: the integer sums are exact, so only float32 rounding separates them
    M, N = 70, 72
    K = 576 if FORMATS[ggml_type].kernel == "qmatmul" else 768
    assert [s.entry for s in gpu_launches(ggml_type, M, N, K)] == ["quantize_x", "qmatmul_tiled"]
    x, w, w_float = make_case(ggml_type, M, N, K, seed=ggml_type)
    out = np.full((M, N), np.nan, np.float32)
    tiled = gpu_launches(ggml_type, M, N, K)[1]
    run_emulated(language, FORMATS[ggml_type].kernel, {"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type},
                 [out, xblocks(x), x, w], tiled.grid[:2], tiled.threads, tmp_path, entry=tiled.entry)
    check_against_reference(out, x_hat(x).astype(np.float32), w_float)


@emulated
@pytest.mark.parametrize("language,tensor,M", [("cuda", "blk.0.ffn_down.weight", 256),
                                               ("metal", "blk.0.attn_q.weight", 64)])
def test_tiled_route_on_the_shipped_models_blocks(language: str, tensor: str, M: int, default_gguf: Path,
                                                  tmp_path: Path):
    # the whole tiled route at the engine's shapes: down_proj (K 1536) with 256 rows, q_proj (K 576) with 64, on
    # the real model's first 64 rows of the weight. quantize_x must write the CPU's 8-bit blocks bit for bit, and
    # the result must match both x_hat @ w.T and the CPU kernel (kernels/cpu/qmatmul.c), which quantizes x alike
    gguf = GGUFFile(default_gguf)
    info = gguf.tensors[tensor]
    N, K = 64, info.shape[1]
    w = gguf.raw(tensor, quant.tensor_nbytes(info.ggml_type, (N, K))).reshape(N, -1).copy()
    x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
    x[1, 32:64] = 0.0  # an all-zero block of x: d = 0, q = 0
    scratch = np.zeros(gpu_scratch_bytes(M, K), np.uint8)
    out = run_qmatmul(language, info.ggml_type, x, w, N, tmp_path, scratch)
    np.testing.assert_array_equal(scratch, xblocks(x))
    w_float = quant.dequantize(w.reshape(-1), info.ggml_type, (N, K))
    check_against_reference(out, x_hat(x).astype(np.float32), w_float)
    cpu = qlinear(Tensor(x), QuantizedWeight(Tensor(w), info.ggml_type, (N, K))).numpy()
    check_against_reference(out, x_hat(x).astype(np.float32), w_float, cpu)


@pytest.mark.parametrize("M,entries", [(1, ["qmatmul"]), (8, ["qmatmul"]), (9, ["quantize_x", "qmatmul_tiled"]),
                                       (256, ["quantize_x", "qmatmul_tiled"])])
def test_qlinear_launches_the_route_for_its_rows(M: int, entries: list[str], monkeypatch: pytest.MonkeyPatch):
    # what qlinear puts into the graph on a GPU (its launches recorded, the device kind said to be CUDA): the GEMV
    # kernel up to 8 rows, quantize_x then qmatmul_tiled beyond, with gpu_launches' grids, and the kernel arguments
    # (out, scratch, x, w) in the order every twin takes them
    import tinyvllm.kernels.qlinear as qlinear_module

    launches = []

    def record(name, outs, ins, defines, estimates=None, entry=None, grid=(1, 1, 1), local_size=None):
        launches.append((name, entry, grid, local_size, [tuple(t.shape) for t in outs + ins]))
        return outs

    monkeypatch.setattr(qlinear_module, "device_kind", lambda device: "CUDA")
    monkeypatch.setattr(qlinear_module, "launch", record)
    N, K = 64, 576
    w = QuantizedWeight(Tensor.empty(N, K // 32 * 20, dtype="uint8"), 3, (N, K))
    assert qlinear(Tensor.empty(M, K), w).shape == (M, N)
    assert [entry for _, entry, *_ in launches] == entries
    for (name, _, grid, local_size, _), step in zip(launches, gpu_launches(3, M, N, K)):
        assert (name, grid, local_size) == ("qmatmul", step.grid, (step.threads, 1, 1))
    scratch = (max(1, gpu_scratch_bytes(M, K)),)
    assert launches[-1][-1] == [(M, N), scratch, (M, K), (N, K // 32 * 20)]


@emulated
@pytest.mark.parametrize("language,tensor", [("cuda", "blk.0.ffn_gate.weight"), ("metal", "token_embd.weight")])
def test_qmatmul_on_the_shipped_models_blocks(language: str, tensor: str, default_gguf: Path, tmp_path: Path):
    # the real model's first 7 rows (Q4_1 linear, Q8_0 embedding) at K = 576: 18 blocks a row, so 14 lanes of each
    # warp have nothing to add and the warp sum must not care
    gguf = GGUFFile(default_gguf)
    info = gguf.tensors[tensor]
    N, K = 7, info.shape[1]
    w = gguf.raw(tensor, quant.tensor_nbytes(info.ggml_type, (N, K))).reshape(N, -1).copy()
    x = np.random.default_rng(0).standard_normal((2, K), dtype=np.float32)
    out = run_qmatmul(language, info.ggml_type, x, w, N, tmp_path)
    check_against_reference(out, x, quant.dequantize(w.reshape(-1), info.ggml_type, (N, K)))


@emulated
def test_a_wrong_nibble_order_fails(tmp_path: Path):
    # the check can fail: the kernel's output against the weights with each byte's two nibbles swapped (the
    # likeliest layout mistake) is far outside the bound
    x, w, _ = make_case(2, 1, 6, 256, seed=1)
    out = run_qmatmul("cuda", 2, x, w, 6, tmp_path)
    swapped = w.reshape(-1, 18).copy()
    swapped[:, 2:] = (swapped[:, 2:] << 4) | (swapped[:, 2:] >> 4)
    with pytest.raises(AssertionError, match="over the bound"):
        check_against_reference(out, x, quant.dequantize(swapped.reshape(-1), 2, (6, 256)))


@emulated
def test_misaligned_vector_load_is_caught(tmp_path: Path):
    # the emulation traps a load its address does not align: a float4 read one float past a 16-byte boundary
    source = """
    extern "C" __global__ void shifted(float* out, const float* x) {
      out[threadIdx.x] = ((const float4*)(x + 1))[threadIdx.x].x;
    }
    """
    with pytest.raises(AssertionError, match="not aligned"):
        run_emulated_source("cuda", source, "shifted", [np.zeros(32, np.float32), np.zeros(256, np.float32)], (1, 1),
                            32, tmp_path)


@emulated
@pytest.mark.parametrize("language", ["cuda", "metal"])
def test_emulated_float16_is_ieee(language: str, tmp_path: Path):
    # every float16 bit pattern to float (infinities, subnormals, -0 included), and floats to float16 (the ties
    # between neighbouring halves included: round to nearest even), as numpy converts them
    cuda = """
    extern "C" __global__ void halves(float* wide, __half* narrow, const __half* h, const float* f) {
      for (int i = threadIdx.x; i < 65536; i += blockDim.x) {
        wide[i] = __half2float(h[i]);
        narrow[i] = __float2half(f[i]);
      }
    }
    """
    metal = """
    kernel void halves(device float* wide, device half* narrow, const device half* h, const device float* f,
                       uint3 gid, uint3 lid) {
      for (int i = lid.x; i < 65536; i += 128) {
        wide[i] = float(h[i]);
        narrow[i] = half(f[i]);
      }
    }
    """
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = every[np.isfinite(every)].astype(np.float64)
    ties = (np.sort(finite)[:-1] + np.diff(np.sort(finite)) / 2).astype(np.float32)  # halfway between neighbours
    rng = np.random.default_rng(0)
    f = np.concatenate([ties, rng.standard_normal(65536, dtype=np.float32) * 1e3])[:65536].astype(np.float32)
    wide, narrow = np.zeros(65536, np.float32), np.zeros(65536, np.float16)
    run_emulated_source(language, cuda if language == "cuda" else metal, "halves", [wide, narrow, every.copy(), f],
                        (1, 1), 128, tmp_path)
    nan = np.isnan(every)  # NaNs stay NaN (F16C quiets a signalling one, numpy keeps its payload)
    assert np.isnan(wide[nan]).all()
    np.testing.assert_array_equal(wide[~nan].view(np.uint32), every[~nan].astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(narrow.view(np.uint16), f.astype(np.float16).view(np.uint16))


# ---- CUDA: compiled with nvrtc (or nvcc) at the shapes the engine launches ----

# SmolLM2-135M's linears (N, K) as the model fuses them, Q4_1 in the shipped GGUF, and its tied lm_head in Q8_0
ENGINE_SHAPES = {"qkv_proj": (3, 960, 576), "o_proj": (3, 576, 576), "gate_up_proj": (3, 3072, 576),
                 "down_proj": (3, 576, 1536), "lm_head": (8, 49152, 576)}


def cuda_sources(ggml_type: int, M: int, N: int, K: int) -> list[tuple[str, str]]:
    """(entry, full source) of every launch qlinear makes on a GPU for x (M, K) @ w(N, K).T."""
    kernel, defines = FORMATS[ggml_type].kernel, {"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type}
    return [(s.entry, kernel_file_source("cuda", kernel, defines, s.entry)) for s in gpu_launches(ggml_type, M, N, K)]


def compile_checked(entry: str, source: str, tmp_path: Path, arch: str) -> None:
    ptx = compile_cuda(source, tmp_path, arch)
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, entry)


@pytest.mark.parametrize("layer", list(ENGINE_SHAPES))
def test_cuda_sources_compile_at_the_engines_shapes(layer: str, tmp_path: Path):
    # sm_90 (H100), every launch of both routes: M = 1 (GEMV; the source does not read TV_M, so 3 compiles alike)
    # and M = 256 (quantize_x, qmatmul_tiled; 64 takes the same code with one row tile)
    ggml_type, N, K = ENGINE_SHAPES[layer]
    for M in (1, 256):
        for entry, source in cuda_sources(ggml_type, M, N, K):
            compile_checked(entry, source, tmp_path, "sm_90")


@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=[f.name for f in FORMATS.values()])
@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_cuda_sources_compile_for_every_format(ggml_type: int, arch: str, tmp_path: Path):
    # every format's three entries, on the H100's arch and an older one (Turing: dp4a is there from sm_61); the
    # K-quants at down_proj's shape, whose K = 1536 is whole super-blocks of 256
    N, K = (3072, 576) if FORMATS[ggml_type].kernel == "qmatmul" else (576, 1536)
    for M in (1, 64):
        for entry, source in cuda_sources(ggml_type, M, N, K):
            compile_checked(entry, source, tmp_path, arch)


@pytest.mark.parametrize("name,ggml_type", [("qmatmul", 12), ("qmatmul_k", 3)])
def test_cuda_source_refuses_a_format_it_does_not_have(name: str, ggml_type: int):
    if nvrtc_compiler() is None:
        pytest.skip("no libnvrtc")
    source = kernel_file_source("cuda", name, {"TV_M": 1, "TV_N": 4, "TV_K": 256, "TV_QTYPE": ggml_type})
    with pytest.raises(Exception, match="takes TV_QTYPE"):  # the #error names the formats the file has
        nvrtc_compiler().compile(source)


# ---- on a real device: both routes at the model's full shapes (skipped where the device is absent) ----

def check_qlinear_on_device(device: str, default_gguf: Path) -> None:
    # the shipped model's whole tensors (Q4_1 linears, the Q8_0 embedding as lm_head) at the rows the engine sends:
    # 1 and 3 (GEMV, against x @ w.T) and 64 and 256 (tiled, against x_hat @ w.T)
    gguf = GGUFFile(default_gguf)
    for tensor, M in [("blk.0.ffn_down.weight", 1), ("blk.0.attn_q.weight", 3), ("blk.0.ffn_gate.weight", 64),
                      ("blk.0.ffn_down.weight", 256), ("token_embd.weight", 256)]:
        info = gguf.tensors[tensor]
        N, K = info.shape
        w = gguf.raw(tensor, quant.tensor_nbytes(info.ggml_type, (N, K))).reshape(N, -1).copy()
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        weight = QuantizedWeight(Tensor(w, device=device).realize(), info.ggml_type, (N, K))
        assert uses_kernel(Tensor.empty(M, K, device=device), weight)
        out = qlinear(Tensor(x, device=device), weight).numpy()
        w_float = quant.dequantize(w.reshape(-1), info.ggml_type, (N, K))
        check_against_reference(out, x if M <= GPU_GEMV_MAX_M else x_hat(x).astype(np.float32), w_float)


@pytest.mark.cuda
def test_cuda_qlinear_matches_numpy(default_gguf: Path):
    check_qlinear_on_device(device_or_skip("CUDA"), default_gguf)


@pytest.mark.metal
@pytest.mark.skipif(sys.platform != "darwin", reason="Metal is macOS only")
def test_metal_qlinear_matches_numpy(default_gguf: Path):
    check_qlinear_on_device(device_or_skip("METAL"), default_gguf)
