"""Phase 6: weights kept in their GGUF blocks, end to end (loader -> model -> engine), and `--quantization`.

The kernels themselves are tested in test_qlinear.py (CPU) and test_qlinear_gpu.py (CUDA/Metal
sources under emulation); here: what the loader keeps, that nothing is dequantized at load, and that the engine's
tokens with quantized weights agree with the same weights dequantized."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

from test_weights import TINY, tiny_state_dict, write_tiny_gguf  # noqa: E402
from tinyvllm.model import quantization  # noqa: E402
from tinyvllm.model.llama import LlamaForCausalLM  # noqa: E402
from tinyvllm.model.quant import QuantizedArray  # noqa: E402
from tinyvllm.model.weights import load_checkpoint  # noqa: E402

Q4_0, Q4_1, Q5_1, Q8_0 = (int(GGMLQuantizationType[n]) for n in ("Q4_0", "Q4_1", "Q5_1", "Q8_0"))


def test_auto_keeps_the_default_models_blocks_without_reading_them(default_gguf):
    auto, none = load_checkpoint(default_gguf, quantization="auto"), load_checkpoint(default_gguf, quantization="none")
    q = auto.state_dict["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(q, QuantizedArray) and q.type_name == "Q4_1" and q.shape == (576, 1536)
    assert q.data.shape == (576, 1536 // 32 * 20) and q.data.dtype == np.uint8
    assert not q.data.flags.writeable  # a view of the memory-mapped file: no bytes were copied
    assert auto.state_dict["model.embed_tokens.weight"].type_name == "Q8_0"
    assert isinstance(auto.state_dict["model.norm.weight"], np.ndarray)  # norms stay float
    # q and k rows were reordered (HF's rotate_half layout) as whole blocks: the same floats as dequantizing first
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.gate_proj.weight"):
        np.testing.assert_array_equal(auto.state_dict[name].dequantize(), none.state_dict[name], err_msg=name)
    assert quantization.describe(auto.state_dict) == "Q4_1 79%, Q8_0 21%, F32 0%"


def test_quantization_method_is_checked(default_gguf):
    with pytest.raises(ValueError, match="must be one of auto, none, q8_0, q4_0, q4_1, iq4_nl, q4_k, got 'int4'"):
        load_checkpoint(default_gguf, quantization="int4")


def test_every_readable_block_format_has_a_kernel():
    from tinyvllm.ggml_types import KERNEL_TYPES
    from tinyvllm.model.quant import SUPPORTED_TYPES
    assert set(SUPPORTED_TYPES) - set(KERNEL_TYPES) == quantization.FLOAT_TYPES  # F32, F16, BF16 stay float


def test_a_format_without_kernel_is_dequantized_with_a_notice(tmp_path, capsys, monkeypatch):
    # take Q5_1's kernel away to see what a format without one gets
    from tinyvllm.model import weights_gguf
    without = {t: n for t, n in quantization.KERNEL_TYPES.items() if t != Q5_1}
    monkeypatch.setattr(quantization, "KERNEL_TYPES", without)
    monkeypatch.setattr(weights_gguf, "KERNEL_TYPES", without)
    sd = tiny_state_dict()
    path = write_tiny_gguf(tmp_path / "q5.gguf", sd, quantize={"model.layers.0.mlp.up_proj.weight": Q5_1,
                                                               "model.layers.0.mlp.down_proj.weight": Q8_0})
    ck = load_checkpoint(path, quantization="auto")
    err = capsys.readouterr().err
    assert "Q5_1 weights have no fused kernel" in err and "Q4_0, Q4_1, Q5_0, Q8_0, Q2_K" in err
    assert isinstance(ck.state_dict["model.layers.0.mlp.up_proj.weight"], np.ndarray)
    assert ck.state_dict["model.layers.0.mlp.down_proj.weight"].type_name == "Q8_0"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_decode_step_reads_every_weight_but_the_embedding_table(tmp_path, tied):
    from tinyvllm.model.config import ModelConfig

    config = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})
    sd = tiny_state_dict(config)
    path = write_tiny_gguf(tmp_path / "m.gguf", sd, config=config,
                           quantize={"model.embed_tokens.weight": Q8_0, "model.layers.0.mlp.up_proj.weight": Q4_0})
    ck = load_checkpoint(path, quantization="auto")
    model = LlamaForCausalLM(ck.config, ck.state_dict, quantization=ck.quantization)
    held = sum(model.weight_formats().values())
    embedding = 64 * 64 // 32 * 34  # vocab 64 x hidden 64 in Q8_0 blocks of 32 (34 bytes each)
    # tied: the lm_head is the embedding table, read whole; untied: one row of it per token, the lm_head whole
    assert model.weight_bytes_per_token() == (held if tied else held - embedding)


def tiny_logits(ck, ids: list[int]) -> np.ndarray:
    """Last-position logits of the tiny model, on the Phase 1 contiguous runner."""
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner

    model = LlamaForCausalLM(ck.config, ck.state_dict, quantization=ck.quantization)
    return ContiguousModelRunner(model, max_model_len=64).prefill(ids)


@pytest.mark.parametrize("qkv", [(Q4_0, Q4_0, Q4_0), (Q4_0, Q8_0, Q4_1)], ids=["one-format", "mixed"])
def test_quantized_model_matches_its_dequantized_twin(tmp_path, qkv):
    """q, k, v in one format fuse into one quantized qkv_proj; in several (as Q4_K_M files keep v in Q6_K) the
    model keeps one weight per part. Either way the logits are those of the dequantized weights, up to the
    kernels' 8-bit rounding of the activations: each quantized matmul's output moves by up to ~0.6% of its
    largest |value| (test_qlinear.py), and two layers of three such matmuls add up to a few percent."""
    # weights scaled as a trained model's are (std 1/sqrt(in_features)): activations stay O(1) through the layers,
    # instead of growing ~8x per matmul and amplifying every rounding with them
    sd = {k: (v / np.sqrt(v.shape[-1]) if v.ndim == 2 else v).astype(np.float32) for k, v in tiny_state_dict().items()}
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(TINY.num_hidden_layers) for p in "qkv"]
    types = {n: qkv["qkv".index(n.split(".")[-2][0])] for n in names}
    types.update({f"model.layers.{i}.mlp.{p}_proj.weight": Q4_1 for i in range(2) for p in ("gate", "up", "down")})
    path = write_tiny_gguf(tmp_path / "tiny.gguf", sd, quantize=types)
    ids = [1, 5, 9, 33, 2]
    auto, none = load_checkpoint(path, quantization="auto"), load_checkpoint(path, quantization="none")
    model = LlamaForCausalLM(auto.config, auto.state_dict, quantization="auto")
    assert isinstance(model.layers[0].qkv_proj, tuple) == (len(set(qkv)) > 1)
    a, b = tiny_logits(auto, ids), tiny_logits(none, ids)
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()


def test_every_format_end_to_end(tmp_path):
    """Each block format kernels compute, in one tiny model (rows of 256 and 512, so the 256-element super-blocks
    fit), one linear per format: loaded from a GGUF, kept in its blocks, and the logits those of the same weights
    dequantized, up to the kernels' 8-bit rounding of the activations. The 32-element formats are quantized from
    the float weights (gguf's quantizers, ours for IQ4_NL); the others are random blocks with valid scales, shaped
    as a weight is: this tests the kernels and the model's plumbing, not a quantizer."""
    import dataclasses

    from test_qlinear import random_blocks
    from test_weights import F16_FIELDS
    from tinyvllm.ggml_types import KERNEL_TYPES
    from tinyvllm.kernels.qlinear import QUANT_FORMATS
    from tinyvllm.model.quant import dequantize
    from tinyvllm.model.quantizer import quantize as our_quantize
    from tinyvllm.model.weights_gguf import gguf_name

    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    sd = {k: (v / np.sqrt(v.shape[-1]) if v.ndim == 2 else v).astype(np.float32)
          for k, v in tiny_state_dict(config).items()}
    linears = [f"model.layers.{i}.{part}.weight" for i in range(2) for part in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")]
    formats = sorted(KERNEL_TYPES)
    quantize, raw = {}, {}
    for i, name in enumerate(linears):
        t = formats[i % len(formats)]
        if t in (2, 3, 6, 7, 8):
            quantize[name] = t
        elif t == 20:
            raw[gguf_name(name)] = (our_quantize(sd.pop(name), 20), t)
        else:  # random blocks, their float16 scales rescaled so that the weights' RMS is a trained layer's
            N, K = sd.pop(name).shape
            blocks = random_blocks(t, N, K, seed=i)
            rms = np.sqrt(np.mean(dequantize(blocks.reshape(-1), t, (N, K)).astype(np.float64) ** 2))
            per_block = blocks.reshape(-1, QUANT_FORMATS[t].type_size)
            for at in F16_FIELDS[t]:
                scaled = per_block[:, at:at + 2].copy().view(np.float16).astype(np.float32) / (rms * np.sqrt(K))
                per_block[:, at:at + 2] = scaled.astype(np.float16).view(np.uint8)
            raw[gguf_name(name)] = (blocks, t)
    assert {t for _, t in raw.values()} | set(quantize.values()) == set(formats)
    path = write_tiny_gguf(tmp_path / "every.gguf", sd, config, quantize=quantize, raw=raw)
    auto, none = load_checkpoint(path, quantization="auto"), load_checkpoint(path, quantization="none")
    kept = {w.type_name for w in auto.state_dict.values() if isinstance(w, QuantizedArray)}
    assert kept == {KERNEL_TYPES[t] for t in formats}
    ids = [1, 5, 9, 33, 2]
    a, b = tiny_logits(auto, ids), tiny_logits(none, ids)
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


def test_online_quantization_of_a_float_checkpoint(tiny_model_dir):
    ck = load_checkpoint(tiny_model_dir, quantization="q8_0")
    w = ck.state_dict["model.layers.1.mlp.gate_proj.weight"]
    assert isinstance(w, QuantizedArray) and w.type_name == "Q8_0"
    floats = load_checkpoint(tiny_model_dir, quantization="none").state_dict["model.layers.1.mlp.gate_proj.weight"]
    # Q8_0: one scale d = max|w| / 127 per 32 weights, stored as float16 (relative error <= 2^-11), so
    # |error| <= d / 2 (rounding q) + 127 * d * 2^-11 (the scale's own rounding, times the largest |q|)
    err = np.abs(w.dequantize() - floats).reshape(-1, 32).max(axis=1)
    d = np.abs(floats).reshape(-1, 32).max(axis=1) / 127
    assert (err <= d * (0.5 + 127 * 2.0**-11) + 1e-7).all()
    assert isinstance(load_checkpoint(tiny_model_dir, quantization="auto").state_dict[
        "model.layers.1.mlp.gate_proj.weight"], np.ndarray)  # auto: a float checkpoint stays float


def test_online_iq4_nl(tiny_model_dir):
    """--quantization iq4_nl: every 2-D weight to IQ4_NL blocks, ggml's search for each block's scale (bit-exact,
    tests/test_quantize.py). The error is then bounded by the grid: each weight is at most half the widest gap
    between neighbouring values (24, from 89 to 113) times |d| from its value, plus the float16 rounding of d."""
    ck = load_checkpoint(tiny_model_dir, quantization="iq4_nl")
    w = ck.state_dict["model.layers.1.mlp.gate_proj.weight"]
    assert isinstance(w, QuantizedArray) and w.type_name == "IQ4_NL"
    floats = load_checkpoint(tiny_model_dir, quantization="none").state_dict["model.layers.1.mlp.gate_proj.weight"]
    d = np.abs(w.data.reshape(-1, 18)[:, 0:2].copy().view(np.float16).astype(np.float32))  # (blocks, 1)
    err = np.abs(w.dequantize() - floats).reshape(-1, 32)
    amax = np.abs(floats).reshape(-1, 32).max(axis=1, keepdims=True)
    assert (err <= np.maximum(12 * d, amax - 113 * d) * (1 + 2.0**-10) + 1e-7).all()


def test_online_q4_k(tiny_model_dir):
    """--quantization q4_k: Q4_K where a row is whole 256-element super-blocks, else Q5_0 (llama-quantize's fallback;
    the tiny model's rows, as SmolLM2's 576, are not). Q4_K's error per weight: at most half a step of its sub-block
    (d * sc / 2) plus the rounding of the 6-bit scale and min to their float16 super-block scales."""
    from tinyvllm.model.quantizer import quantize
    from tinyvllm.model.quant import dequantize
    ck = load_checkpoint(tiny_model_dir, quantization="q4_k")
    assert {w.type_name for w in ck.state_dict.values() if isinstance(w, QuantizedArray)} == {"Q5_0"}
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    blocks = quantize(w, 12)
    back = dequantize(blocks.reshape(-1), 12, w.shape)
    step = (w.reshape(-1, 32).max(1) - np.minimum(w.reshape(-1, 32).min(1), 0)) / 15  # a sub-block's first grid
    assert (np.abs(back - w).reshape(-1, 32).max(1) <= step).all()


@pytest.mark.slow
def test_engine_reports_weight_formats_and_agrees_with_dequantized(generator):
    """The shipped Q4_1 model served from its blocks against the same weights dequantized (the session's
    `generator`, quantization="none", the HF oracle's twin). The only difference is the kernels' rounding of each
    activation block to 8 bits (as llama.cpp does): perplexity moves by under 1% (tests/test_perplexity.py), and a
    token's logprob by a few hundredths of a nat, so greedy decoding agrees until the reference itself is within
    NEAR_TIE of a tie, where either token may win and the texts then go their own ways. Required: the same tokens
    up to that step on every prompt, and enough steps so compared."""
    from test_generate import PROMPTS, prompt_ids
    from test_quantize import NEAR_TIE, greedy_with_margins
    from tinyvllm.engine.generator import Generator

    quantized = Generator(None, max_model_len=512, kv_cache_memory="64MiB", quantization="auto")
    stats = quantized.engine.get_stats()
    assert stats["quantization"] == "auto" and set(stats["weight_bytes"]) == {"Q4_1", "Q8_0", "float32"}
    assert sum(stats["weight_bytes"].values()) < 100 * 2**20  # vs 538 MB of float32
    compared = 0
    for name in PROMPTS:
        ids = prompt_ids(generator, name)
        reference, margins = greedy_with_margins(generator, f"dequantized-{name}", ids)
        tokens, _ = greedy_with_margins(quantized, f"quantized-{name}", ids)
        n = next((step for step, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        assert tokens[:n] == reference[:n], (name, n, tokens, reference)
        compared += n
    assert compared >= 16, compared  # 23 on these prompts today: several meet a near-tie within a few tokens
