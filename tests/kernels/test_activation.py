"""act_and_mul, the MLP's gated activation (kernels/<device>/act_and_mul.*), against float64 numpy and tinygrad's ops.

On the CPU the C kernel runs through tinygrad's program path; the CUDA and Metal sources run on the CPU under the
emulation of the GPU thread model (tests/gpu_emulation.py), and the CUDA source is compiled to PTX (nvrtc or nvcc).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Device, Tensor
from tinygrad.helpers import GlobalCounters

from tinyvllm import ops
from tinyvllm.kernels import activation, cpu_threads, launcher
from tinyvllm.kernels.linear import linear

from gpu_emulation import can_emulate, check_ptx, compile_cuda, kernel_file_source, run_emulated

needs_kernel = pytest.mark.skipif(not launcher.has_kernel(activation.KERNEL, Device.DEFAULT),
                                  reason="no C kernel here")


def gate_up(rows: int, F: int, seed: int) -> np.ndarray:
    """[gate | up] rows: gates over the range a model's reach (and beyond, where exp would overflow), ups ~N(0, 1)."""
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal((rows, F)) * 4).astype(np.float32)
    gate[0, :6] = [0.0, -0.0, 95.0, -95.0, 30.0, -30.0]  # exp(-g) past float32's range both ways
    return np.concatenate([gate, rng.standard_normal((rows, F)).astype(np.float32)], axis=1)


def reference(x: np.ndarray, act: str) -> np.ndarray:
    """act(gate) * up in float64, by the definitions (silu: g sigmoid(g); gelu: 0.5 g (1 + tanh(...)))."""
    F = x.shape[-1] // 2
    g, u = x[..., :F].astype(np.float64), x[..., F:].astype(np.float64)
    if act == "silu":
        a = g / (1.0 + np.exp(-np.clip(g, -700, 700)))
    else:
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    return a * u


def assert_close(out: np.ndarray, x: np.ndarray, act: str) -> None:
    """Within float32 rounding of the float64 result: a few ulps of each output, relative to |act(g)| |u|."""
    ref = reference(x, act)
    F = x.shape[-1] // 2
    g, u = x[..., :F].astype(np.float64), x[..., F:].astype(np.float64)
    scale = np.abs(g * u) + 1e-30  # |act(g)| <= |g|
    assert np.all(np.abs(out - ref) <= 4e-6 * scale), float(np.max(np.abs(out - ref) / scale))


@needs_kernel
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,F", [(1, 1536), (37, 21), (64, 1536)])
def test_kernel_matches_float64_and_tinygrad(act: str, rows: int, F: int):
    # F = 21: two vectors of 8 and 5 left over; 64 rows: several chunks for the thread pool
    x = gate_up(rows, F, seed=rows + F)
    t = Tensor(x).realize()
    assert activation.uses_kernel(t)
    out = activation.act_and_mul(t, act).numpy()
    assert out.shape == (rows, F)
    assert_close(out, x, act)
    np.testing.assert_allclose(out, ops.act_and_mul(t, act).numpy(), rtol=2e-5, atol=2e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads():
    x = gate_up(64, 1536, seed=5)
    with cpu_threads.threads_enabled(True):
        batched = activation.act_and_mul(Tensor(x).realize(), "silu").numpy()
    with cpu_threads.threads_enabled(False):
        alone = activation.act_and_mul(Tensor(x[3:4]).realize(), "silu").numpy()
    np.testing.assert_array_equal(batched[3:4], alone)


@needs_kernel
def test_no_copy_between_two_kernels():
    """A kernel's output reshaped is already the next kernel's row-major input (tinygrad_ext.programs.kernel_input): the
    MLP runs as its three kernels, gate_up_proj, act_and_mul, down_proj, with no copy between them."""
    rng = np.random.default_rng(0)
    w_gate_up = Tensor(rng.standard_normal((64, 16), dtype=np.float32)).realize()
    w_down = Tensor(rng.standard_normal((16, 32), dtype=np.float32)).realize()
    x = Tensor(rng.standard_normal((2, 3, 16), dtype=np.float32)).realize()
    GlobalCounters.reset()
    h = activation.act_and_mul(linear(x, w_gate_up).reshape(2, 3, 1, 64), "silu").reshape(2, 3, 32)
    out = linear(h, w_down).realize()
    assert GlobalCounters.kernel_count == 3
    gu = x.numpy() @ w_gate_up.numpy().T
    want = reference(gu, "silu") @ w_down.numpy().T
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.phase8
def test_split_over_devices_as_tensor_parallel_splits_it():
    """Tensor parallel (Phase 8): gate_up (B, T, S, 2F) split on S, device s holding [gate_s | up_s]. The kernel runs
    once per device on its part, and the result is the one-device result, bit for bit."""
    x = gate_up(6, 2 * 24, seed=2).reshape(2, 3, 2, 48)  # 2 devices, F = 24 each
    split = Tensor(x).shard(("CPU:0", "CPU:1"), axis=2).realize()
    assert activation.uses_kernel(split)
    out = activation.act_and_mul(split, "silu")
    assert out.shape == (2, 3, 2, 24)
    np.testing.assert_array_equal(out.numpy(), activation.act_and_mul(Tensor(x).realize(), "silu").numpy())
    assert not activation.uses_kernel(Tensor(x).shard(("CPU:0", "CPU:1"), axis=3))  # [gate | up] itself cut in two


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="gated activation 'relu'.*silu, gelu_tanh"):
        activation.act_and_mul(Tensor(np.zeros((1, 4), np.float32)), "relu")


@pytest.mark.skipif(not can_emulate(), reason="the GPU emulation needs clang++ on x86-64 Linux")
@pytest.mark.parametrize("language", ["cuda", "metal"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_emulated_gpu_kernels_match_float64(language: str, act: str, tmp_path: Path):
    rows, F = 5, 37  # 185 outputs: the last thread block only partly used
    x = gate_up(rows, F, seed=11)
    out = np.zeros((rows, F), np.float32)
    defines = {"TV_R": rows, "TV_F": F, "TV_GELU": activation.ACTIVATIONS[act], "TV_NUM_THREADS": 64}
    run_emulated(language, activation.KERNEL, defines, [out, x], (-(-rows * F // 64), 1), 64, tmp_path)
    assert_close(out, x, act)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_cuda_source_compiles(act: str, tmp_path: Path):
    defines = {"TV_R": 64, "TV_F": 1536, "TV_GELU": activation.ACTIVATIONS[act],
               "TV_NUM_THREADS": activation.NUM_THREADS}
    ptx = compile_cuda(kernel_file_source("cuda", activation.KERNEL, defines), tmp_path)
    if ptx is None:
        pytest.skip("no CUDA compiler (libnvrtc or nvcc)")
    check_ptx(ptx, activation.KERNEL)


def test_every_device_with_a_kernel_has_its_twins():
    for kind in ("CPU", "CUDA", "METAL"):
        assert launcher.kernel_path(activation.KERNEL, kind).is_file()
