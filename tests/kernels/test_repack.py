"""Weights repacked 8 rows at a time for the CPU (tinyvllm/kernels/repack.py): Q4_K (kernels/cpu/qmatmul_k_x8.c)
and the 32-element Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (kernels/cpu/qmatmul_x8.c), and kept on disk for the next
start (tinyvllm/model/repacked_cache.py).

The repacked weight must be the same weight: its tinygrad dequantization equals the GGUF's bit for bit, and the x8
kernels' products match test_qlinear's two oracles (the kernel's own arithmetic in numpy, and the float product) at
the M = 1 stream and the M > 1 tiles, on the AVX-512 VNNI, AVX2 and portable C routes alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinygrad import Device, Tensor, dtypes

from test_qlinear import check_both_oracles, random_blocks, weight  # noqa: E402
from tinyvllm.kernels import launcher, repack
from tinyvllm.kernels.qlinear import (QUANT_FORMATS, QuantizedWeight, dequantize_weight, embedding, qlinear,
                                      scratch_bytes, uses_kernel)
from tinyvllm.tinygrad_ext import buffers

Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, IQ4_NL = 2, 3, 6, 7, 12, 20
X8_TYPES = [Q4_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL]
IDS = [QUANT_FORMATS[t].name for t in X8_TYPES]
needs_kernel = pytest.mark.skipif(
    not all(launcher.has_kernel(k, Device.DEFAULT) for k in set(repack.X8_KERNELS.values())), reason="no C kernel here")


def repacked(blocks: np.ndarray, ggml_type: int, K: int) -> QuantizedWeight:
    data = Tensor(repack.REPACK[ggml_type](blocks)).realize()
    return QuantizedWeight(data, ggml_type, (blocks.shape[0], K), layout="x8")


def shapes(ggml_type: int) -> tuple[tuple[int, int], ...]:
    """(N, K): 5 groups and 2 (chunks of whole groups), K of 2 super-blocks and 1, or of 3 blocks and 18"""
    return ((40, 512), (16, 256)) if ggml_type == Q4_K else ((40, 96), (16, 576))


def test_same_bytes_reordered():
    blocks = random_blocks(Q4_K, 16, 512, seed=1)
    packed = repack.repack_q4_k_x8(blocks)
    assert packed.shape == (2, 2 * 1152) and packed.nbytes == blocks.nbytes
    # the nibbles are the GGUF's bytes moved: the same multiset of bytes per group and super-block
    gguf_qs = blocks.reshape(2, 8, 2, 144)[..., 16:].transpose(0, 2, 1, 3).reshape(2, 2, 1024)
    np.testing.assert_array_equal(np.sort(packed.reshape(2, 2, 1152)[..., 128:], -1), np.sort(gguf_qs, -1))


def test_32_element_blocks_same_bytes_reordered():
    for t in (Q4_0, Q4_1, IQ4_NL):  # (Q5's fifth bits are regrouped bit by bit: the dequantization test checks them)
        B = QUANT_FORMATS[t].type_size
        blocks = random_blocks(t, 16, 64, seed=t)
        packed = repack.REPACK[t](blocks)
        assert packed.shape == (2, 2 * 8 * B) and packed.nbytes == blocks.nbytes
        gguf = np.sort(blocks.reshape(2, 8, 2, B).transpose(0, 2, 1, 3).reshape(2, 2, 8 * B), -1)
        np.testing.assert_array_equal(np.sort(packed.reshape(2, 2, 8 * B), -1), gguf)


@pytest.mark.parametrize("ggml_type", X8_TYPES, ids=IDS)
def test_dequantized_weight_is_the_ggufs(ggml_type: int):
    for N, K in shapes(ggml_type):
        blocks = random_blocks(ggml_type, N, K, seed=N)
        np.testing.assert_array_equal(dequantize_weight(repacked(blocks, ggml_type, K)).numpy(),
                                      dequantize_weight(weight(blocks, ggml_type, K)).numpy())


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 37])
@pytest.mark.parametrize("ggml_type", X8_TYPES, ids=IDS)
def test_kernel_matches_both_oracles(ggml_type: int, M: int):
    for N, K in shapes(ggml_type):
        blocks = random_blocks(ggml_type, N, K, seed=N + M)
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        w, xt = repacked(blocks, ggml_type, K), Tensor(x).realize()
        assert uses_kernel(xt, w) and w.kernel == repack.X8_KERNELS[ggml_type]
        check_both_oracles(qlinear(xt, w).numpy(), x, blocks, ggml_type)


@needs_kernel
@pytest.mark.parametrize("route", [{"TV_NO_VNNI": 1}, {"TV_SCALAR": 1}], ids=["avx2", "portable"])
@pytest.mark.parametrize("ggml_type", X8_TYPES, ids=IDS)
def test_other_routes_match(ggml_type: int, route: dict):
    N, K = (24, 768) if ggml_type == Q4_K else (24, 160)
    blocks = random_blocks(ggml_type, N, K, seed=5)
    data = Tensor(repack.REPACK[ggml_type](blocks)).realize()
    for M in (1, 6):
        x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
        out = Tensor.empty(M, N, dtype=dtypes.float32)
        scratch = Tensor.empty(scratch_bytes(ggml_type, M, K), dtype=dtypes.uint8)
        out, _ = launcher.launch(repack.X8_KERNELS[ggml_type], outs=[out, scratch], ins=[Tensor(x).realize(), data],
                                 defines={"TV_M": M, "TV_N": N, "TV_K": K, "TV_QTYPE": ggml_type, **route})
        check_both_oracles(out.numpy(), x, blocks, ggml_type)


@needs_kernel
@pytest.mark.parametrize("ggml_type", X8_TYPES, ids=IDS)
def test_a_rows_result_does_not_depend_on_its_batch(ggml_type: int):
    N, K = shapes(ggml_type)[0]
    w = repacked(random_blocks(ggml_type, N, K, seed=9), ggml_type, K)
    x = np.random.default_rng(9).standard_normal((37, K), dtype=np.float32)
    alone = qlinear(Tensor(x[:1]), w).numpy()[0]
    for M in (2, 5, 37):
        np.testing.assert_array_equal(qlinear(Tensor(x[:M]), w).numpy()[0], alone, err_msg=f"M={M}")


def test_which_weights_are_repacked(monkeypatch: pytest.MonkeyPatch):
    cpu = launcher.has_kernel("qmatmul_k_x8", "CPU")
    assert repack.repack_for(Q4_K, 64, "CPU") == ("x8" if cpu else None)
    assert repack.repack_for(Q4_K, 60, "CPU") is None  # not whole groups of 8 rows
    assert repack.repack_for(14, 64, "CPU") is None  # Q6_K: the GGUF's rows
    assert repack.repack_for(8, 64, "CPU") is None  # Q8_0, too
    for t in (Q4_0, Q4_1, IQ4_NL):
        assert repack.repack_for(t, 64, "CPU") == ("x8" if launcher.has_kernel("qmatmul_x8", "CPU") else None)
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
        embedding(repacked(blocks, Q4_K, 256), Tensor([1, 2]))
    with pytest.raises(ValueError, match="Q4_K, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL"):
        QuantizedWeight(Tensor(random_blocks(8, 8, 64, seed=2)), 8, (8, 64), layout="x8")  # Q8_0 is not repacked


def tiny_x8_gguf(folder) -> Path:
    """A tiny model's GGUF whose two layers are Q4_K, Q4_0, Q4_1, Q5_0 and IQ4_NL (the project's quantizer: the gguf
    package has no Q4_K); q and k, whose rows the file permutes, stay float."""
    import dataclasses

    from test_weights import TINY, tiny_state_dict, write_tiny_gguf
    from tinyvllm.model.quantizer import quantize
    from tinyvllm.model.weights_gguf import gguf_name

    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    sd = {k: (v / np.sqrt(v.shape[-1]) if v.ndim == 2 else v).astype(np.float32)
          for k, v in tiny_state_dict(config).items()}
    names = [n for n in sd if n.startswith("model.layers.") and sd[n].ndim == 2 and "q_proj" not in n
             and "k_proj" not in n] + ["model.embed_tokens.weight"]
    kinds = [{"gate_proj": Q4_K, "up_proj": Q4_K, "down_proj": Q4_0, "o_proj": IQ4_NL, "v_proj": Q4_1},
             {"gate_proj": Q5_0, "up_proj": Q5_0, "down_proj": Q4_K, "o_proj": Q4_0, "v_proj": Q5_0}]
    types = {n: next((t for part, t in kinds[int(n.split(".")[2]) if n.startswith("model.layers.") else 0].items()
                      if part in n), Q4_K) for n in names}
    raw = {gguf_name(n): (quantize(sd.pop(n), types[n]), types[n]) for n in names}
    return write_tiny_gguf(folder / "x8.gguf", sd, config, raw=raw)


def quantized_weights(model) -> list[QuantizedWeight]:
    weights = [w for layer in model.layers for w in layer.weights() for w in (w if isinstance(w, tuple) else (w,))]
    return [w for w in weights if isinstance(w, QuantizedWeight)]


def prefill_logits(model) -> np.ndarray:
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner

    return ContiguousModelRunner(model, max_model_len=64).prefill([1, 5, 9, 33, 2])


@needs_kernel
@pytest.mark.parametrize("path", ["integrated", "discrete"])
def test_a_model_gives_the_same_logits_repacked(tmp_path, monkeypatch: pytest.MonkeyPatch, path: str):
    """The tiny model loaded both ways: the repacked weights are the file's (a copy, on the discrete GPU's path bytes
    copied in) and its logits those of the file's layout up to float summation order. The embedding, looked up by
    rows, keeps the file's layout."""
    from tinyvllm import platforms
    from tinyvllm.model.llama import LlamaForCausalLM
    from tinyvllm.model.weights import load_checkpoint

    monkeypatch.setattr(platforms, "DEVICE_PATH", path)
    gguf = tiny_x8_gguf(tmp_path)
    logits = {}
    for enabled in (False, True):
        monkeypatch.setattr(repack, "ENABLED", enabled)
        ck = load_checkpoint(gguf, quantization="auto")
        model = LlamaForCausalLM(ck.config, ck.state_dict, quantization=ck.quantization)
        weights = quantized_weights(model)
        assert {w.layout for w in weights} == ({"x8"} if enabled else {None}) and model.embed_tokens.layout is None
        assert {w.ggml_type for w in weights} == {Q4_K, Q4_0, Q4_1, Q5_0, IQ4_NL}
        logits[enabled] = prefill_logits(model)
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-4 * np.abs(logits[False]).max())


# ---- the repacked weights kept on disk (tinyvllm/model/repacked_cache.py) ----

@pytest.fixture
def kept_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    from tinyvllm.model import repacked_cache

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(repacked_cache, "ENABLED", True)
    return repacked_cache


def load_tiny(gguf):
    """The model as load_model builds it (its weights' source named, so that their repacked copies are kept)."""
    from tinyvllm.model import repacked_cache
    from tinyvllm.model.llama import LlamaForCausalLM
    from tinyvllm.model.weights import load_checkpoint

    ck = load_checkpoint(gguf, quantization="auto")
    return LlamaForCausalLM(ck.config, ck.state_dict, quantization=ck.quantization,
                            model_id=repacked_cache.model_identity(ck.path, ck.quantization))


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path` (Linux's /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


@needs_kernel
def test_a_warm_start_maps_the_weights_an_earlier_start_repacked(tmp_path, kept_cache, monkeypatch):
    """The first load repacks and writes one file; the next maps it (nothing repacked: REPACK would raise), each
    weight a view of that file, and computes the same logits."""
    gguf = tiny_x8_gguf(tmp_path)
    first = load_tiny(gguf)
    files = list(kept_cache.cache_dir().glob("*.x8"))
    assert len(files) == 1 and not list(kept_cache.cache_dir().glob("*.tmp"))
    logits = prefill_logits(first)

    def no_repack(*args, **kwargs):
        raise AssertionError("repacked again: the kept file was not used")
    monkeypatch.setattr(repack, "REPACK", {t: no_repack for t in repack.REPACK})
    again = load_tiny(gguf)
    ranges = mapped_ranges(files[0])
    for w in quantized_weights(again):  # every repacked weight lies in the kept file's pages
        address = buffers.buffer_address(w.data)
        assert w.layout == "x8" and any(a <= address < b for a, b in ranges)
    np.testing.assert_array_equal(prefill_logits(again), logits)


@needs_kernel
def test_a_foreign_or_damaged_file_is_repacked_and_written_again(tmp_path, kept_cache):
    gguf = tiny_x8_gguf(tmp_path)
    logits = prefill_logits(load_tiny(gguf))
    (file,) = kept_cache.cache_dir().glob("*.x8")
    for damage in (b"not a cache file", file.read_bytes()[:5000]):  # another file; one cut short
        file.unlink()  # (a new inode: this process's mappings of the old file keep their pages)
        file.write_bytes(damage)
        assert kept_cache.KeptWeights(kept_cache.model_identity(gguf, "auto")).mapping is None
        np.testing.assert_array_equal(prefill_logits(load_tiny(gguf)), logits)
        assert kept_cache.KeptWeights(kept_cache.model_identity(gguf, "auto")).mapping is not None


@needs_kernel
def test_a_cache_that_cannot_be_written_leaves_the_model_whole(tmp_path, kept_cache, monkeypatch):
    gguf = tiny_x8_gguf(tmp_path)
    (tmp_path / "cache").write_text("a file where the cache's folder would be")
    model = load_tiny(gguf)
    assert {w.layout for w in quantized_weights(model)} == {"x8"}
    monkeypatch.setattr(kept_cache, "ENABLED", False)
    (tmp_path / "cache").unlink()
    np.testing.assert_array_equal(prefill_logits(model), prefill_logits(load_tiny(gguf)))
    assert not (tmp_path / "cache").exists()  # off: nothing written
