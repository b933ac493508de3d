"""Q4_K repacked 8 rows at a time for the CPU (tinyvllm/kernels/repack.py, kernels/cpu/qmatmul_k_x8.c).

The repacked weight must be the same weight: its tinygrad dequantization equals the GGUF's bit for bit, and the x8
kernel's products match test_qlinear's two oracles (the kernel's own arithmetic in numpy, and the float product) at
the M = 1 stream and the M > 1 tiles, on the AVX-512 VNNI, AVX2 and portable C routes alike.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from test_qlinear import check_both_oracles, random_blocks, weight  # noqa: E402
from tinyvllm.kernels import launcher, repack
from tinyvllm.kernels.qlinear import QuantizedWeight, dequantize_weight, embedding, qlinear, scratch_bytes, uses_kernel

Q4_K = 12
needs_kernel = pytest.mark.skipif(not launcher.has_kernel("qmatmul_k_x8", Device.DEFAULT), reason="no C kernel here")


def repacked(blocks: np.ndarray, K: int) -> QuantizedWeight:
    data = Tensor(repack.repack_q4_k_x8(blocks)).realize()
    return QuantizedWeight(data, Q4_K, (blocks.shape[0], K), layout="x8")


def test_same_bytes_reordered():
    blocks = random_blocks(Q4_K, 16, 512, seed=1)
    packed = repack.repack_q4_k_x8(blocks)
    assert packed.shape == (2, 2 * 1152) and packed.nbytes == blocks.nbytes
    # the nibbles are the GGUF's bytes moved: the same multiset of bytes per group and super-block
    gguf_qs = blocks.reshape(2, 8, 2, 144)[..., 16:].transpose(0, 2, 1, 3).reshape(2, 2, 1024)
    np.testing.assert_array_equal(np.sort(packed.reshape(2, 2, 1152)[..., 128:], -1), np.sort(gguf_qs, -1))


def test_dequantized_weight_is_the_ggufs():
    for N, K in ((16, 256), (24, 768)):
        blocks = random_blocks(Q4_K, N, K, seed=N)
        np.testing.assert_array_equal(dequantize_weight(repacked(blocks, K)).numpy(),
                                      dequantize_weight(weight(blocks, Q4_K, K)).numpy())


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 37])
def test_kernel_matches_both_oracles(M: int):
    for N, K in ((40, 512), (16, 256)):  # 5 groups, and 2: chunks of whole groups; K of 2 super-blocks and 1
        blocks = random_blocks(Q4_K, N, K, seed=N + M)
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        w, xt = repacked(blocks, K), Tensor(x).realize()
        assert uses_kernel(xt, w) and w.kernel == "qmatmul_k_x8"
        check_both_oracles(qlinear(xt, w).numpy(), x, blocks, Q4_K)


@needs_kernel
@pytest.mark.parametrize("route", [{"TV_NO_VNNI": 1}, {"TV_SCALAR": 1}], ids=["avx2", "portable"])
def test_other_routes_match(route: dict):
    N, K = 24, 768
    blocks = random_blocks(Q4_K, N, K, seed=5)
    data = Tensor(repack.repack_q4_k_x8(blocks)).realize()
    for M in (1, 6):
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        out = Tensor.empty(M, N, dtype=dtypes.float32)
        scratch = Tensor.empty(scratch_bytes(Q4_K, M, K), dtype=dtypes.uint8)
        out, _ = launcher.launch("qmatmul_k_x8", outs=[out, scratch], ins=[Tensor(x).realize(), data],
                                 defines={"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": Q4_K, **route})
        check_both_oracles(out.numpy(), x, blocks, Q4_K)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    blocks = random_blocks(Q4_K, 40, 512, seed=9)
    w = repacked(blocks, 512)
    x = np.random.default_rng(9).standard_normal((37, 512), dtype=np.float32)
    alone = qlinear(Tensor(x[:1]), w).numpy()[0]
    for M in (2, 5, 37):
        np.testing.assert_array_equal(qlinear(Tensor(x[:M]), w).numpy()[0], alone, err_msg=f"M={M}")


def test_which_weights_are_repacked(monkeypatch: pytest.MonkeyPatch):
    cpu = launcher.has_kernel("qmatmul_k_x8", "CPU")
    assert repack.repack_for(Q4_K, 64, "CPU") == ("x8" if cpu else None)
    assert repack.repack_for(Q4_K, 60, "CPU") is None  # not whole groups of 8 rows
    assert repack.repack_for(14, 64, "CPU") is None  # Q6_K: the GGUF's rows
    assert repack.repack_for(Q4_K, 64, ("CPU:0", "CPU:1")) is None  # split over devices
    monkeypatch.setattr(repack, "ENABLED", False)
    assert repack.repack_for(Q4_K, 64, "CPU") is None


def test_bad_layouts_are_clear_errors():
    blocks = random_blocks(Q4_K, 16, 256, seed=2)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        QuantizedWeight(Tensor(blocks[:12]), Q4_K, (12, 256), layout="x8")
    with pytest.raises(ValueError, match="'x8'"):
        QuantizedWeight(Tensor(blocks), Q4_K, (16, 256), layout="x4")
    with pytest.raises(ValueError, match="needs data of shape"):
        QuantizedWeight(Tensor(blocks), Q4_K, (16, 256), layout="x8")  # rows, not groups
    with pytest.raises(ValueError, match="GGUF's layout"):
        embedding(repacked(blocks, 256), Tensor([1, 2]))


@needs_kernel
@pytest.mark.parametrize("path", ["integrated", "discrete"])
def test_a_q4_k_model_gives_the_same_logits_repacked(tmp_path, monkeypatch: pytest.MonkeyPatch, path: str):
    """A tiny model whose layers are Q4_K, loaded both ways: the repacked weights are the file's (a copy, on the
    discrete GPU's path bytes copied in) and its logits those of the file's layout up to float summation order. The
    embedding, looked up by rows, keeps the file's layout."""
    import dataclasses

    from test_weights import TINY, tiny_state_dict, write_tiny_gguf
    from tinyvllm import platforms
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
    from tinyvllm.model.llama import LlamaForCausalLM
    from tinyvllm.model.quantizer import quantize
    from tinyvllm.model.weights import load_checkpoint
    from tinyvllm.model.weights_gguf import gguf_name

    monkeypatch.setattr(platforms, "DEVICE_PATH", path)
    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    sd = {k: (v / np.sqrt(v.shape[-1]) if v.ndim == 2 else v).astype(np.float32)
          for k, v in tiny_state_dict(config).items()}
    # Q4_K by the project's quantizer (the gguf package has none); q and k, whose rows the file permutes, stay float
    names = [n for n in sd if n.startswith("model.layers.") and sd[n].ndim == 2 and "q_proj" not in n
             and "k_proj" not in n] + ["model.embed_tokens.weight"]
    raw = {gguf_name(n): (quantize(sd.pop(n), Q4_K), Q4_K) for n in names}
    path_ = write_tiny_gguf(tmp_path / "q4_k.gguf", sd, config, raw=raw)
    logits = {}
    for enabled in (False, True):
        monkeypatch.setattr(repack, "ENABLED", enabled)
        ck = load_checkpoint(path_, quantization="auto")
        model = LlamaForCausalLM(ck.config, ck.state_dict, quantization=ck.quantization)
        weights = [w for layer in model.layers for w in layer.weights() for w in (w if isinstance(w, tuple) else (w,))]
        layouts = {w.layout for w in weights if isinstance(w, QuantizedWeight)}
        assert layouts == ({"x8"} if enabled else {None}) and model.embed_tokens.layout is None
        logits[enabled] = ContiguousModelRunner(model, max_model_len=64).prefill([1, 5, 9, 33, 2])
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-4 * np.abs(logits[False]).max())
