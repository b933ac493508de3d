"""Phase 6: numpy quantizers, the GGUF writer and `python -m tinyvllm.quantize`.

Oracles: the `gguf` package (llama.cpp's own Python package: its `quants.quantize` follows ggml's reference
quantizers bit for bit, and its `GGUFReader` is an independent GGUF parser), HF-free round trips through
our loader, and the shipped Q4_1 model itself (its greedy text before and after requantizing to Q8_0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from conftest import TINY_CONFIG, write_tiny_model  # noqa: E402
from tinyvllm.model import gguf_writer as gw  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.quant import dequantize, tensor_nbytes  # noqa: E402
from tinyvllm.model.quantizer import QUANTIZE_TYPES, quantize  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.weights import default_model_path, load_checkpoint  # noqa: E402
from tinyvllm.model.weights_gguf import permute_qk, unpermute_qk  # noqa: E402
from tinyvllm.quantize import quantize_model  # noqa: E402

TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3}
SENTENCE = "The capital of France is Paris. 12345 + 3.14 = x² café 🤖 <|im_start|>user"


def block_test_data(rng: np.random.Generator) -> np.ndarray:
    """(64, 1024) float32 whose blocks span scales 1e-4..1e3 and hold the rounding edge cases."""
    x = (rng.standard_normal((64, 1024)) * 10.0 ** rng.uniform(-4, 3, (64, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0, q = 0
    x[1, :32] = np.arange(-16, 16) / 2  # exact halves: Q8_0 rounds them away from zero, Q4 types truncate +0.5
    x[1, 0] = -127 / 2  # so that Q8_0's d is exactly 0.5 and x / d lands on .5 ties
    x[2, :32] = -x[2, :32].max()  # every element the same: Q4_1's d is 0
    x[3, :32], x[3, 5], x[3, 9] = 0.1, 2.0, -2.0  # +amax and -amax both present: the first wins (Q4_0)
    x[4, :32] = rng.uniform(-1, 1, 32).astype(np.float32) * np.float32(1e-30)  # scales below float16's range
    return x


# ---------------------------------------------------------------- quantizers

@pytest.mark.parametrize("name", list(TYPES))
def test_quantize_is_bit_exact_with_gguf(name):
    x = block_test_data(np.random.default_rng(TYPES[name]))
    got = quantize(x, TYPES[name])
    expected = gguf_quantize(x, GGMLQuantizationType(TYPES[name]))
    type_size = {8: 34, 2: 18, 3: 20}[TYPES[name]]
    assert got.dtype == np.uint8 and got.shape == expected.shape == (64, 1024 // 32 * type_size)
    np.testing.assert_array_equal(got, expected)
    # many threads over chunks give the same bytes as one call per row (a row is one chunk)
    np.testing.assert_array_equal(np.concatenate([quantize(row[None], TYPES[name]) for row in x]), got)


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_quantize_within_half_a_step(name):
    """|x - dequantize(quantize(x))| <= step/2, plus what the float16 rounding of the scale (and min) adds.

    A block's q is x/d rounded to nearest, so x = d * (q + e) with |e| <= 1/2. The file keeps d16 = float16(d),
    so the dequantized value is off by d * e + (d - d16) * q: at most d/2 + |d - d16| * |q| (Q8_0, Q4_0);
    Q4_1 adds |m - m16|. Q4_0 is the exception: its range is -8d..+7d, so an element of the opposite sign to
    the block's largest one that reaches past +7.5d (x / d up to +8) clamps to q = 15: a full step at most."""
    ggml_type = TYPES[name]
    x = block_test_data(np.random.default_rng(10 + ggml_type))
    raw = quantize(x, ggml_type)
    back = dequantize(raw.reshape(-1), ggml_type, x.shape).reshape(-1, 32)
    blocks = x.reshape(-1, 32).astype(np.float64)
    stored = raw.reshape(-1, raw.shape[-1] // (1024 // 32))
    d16 = stored[:, 0:2].copy().view(np.float16).astype(np.float64)  # (n, 1)
    if ggml_type == 8:
        d = np.abs(blocks).max(axis=1, keepdims=True) / 127
        q = stored[:, 2:].view(np.int8).astype(np.float64)
        bound = d / 2 + np.abs(d - d16) * np.abs(q)
    elif ggml_type == 2:
        big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = big / -8
        q = np.concatenate([stored[:, 2:] & 15, stored[:, 2:] >> 4], axis=1).astype(np.float64) - 8
        over = np.divide(blocks, d, out=np.zeros_like(blocks), where=d != 0) > 7.5  # clamped to q = 15 - 8
        bound = np.where(over, np.abs(d), np.abs(d) / 2) + np.abs(d - d16) * np.abs(q)
    else:
        lo = blocks.min(axis=1, keepdims=True)
        d = (blocks.max(axis=1, keepdims=True) - lo) / 15
        m16 = stored[:, 2:4].copy().view(np.float16).astype(np.float64)
        q = np.concatenate([stored[:, 4:] & 15, stored[:, 4:] >> 4], axis=1).astype(np.float64)
        bound = d / 2 + np.abs(d - d16) * q + np.abs(lo - m16)
    err = np.abs(back - blocks)
    tolerance = 1e-6 * np.abs(blocks) + 1e-45  # float32 arithmetic on the way
    assert (err <= bound + tolerance).all(), float((err - bound).max())
    if ggml_type != 2:  # and the bound is not loose: some element sits near half a step
        assert (err > 0.4 * d).any()


def searching_test_data(rows: int = 48, cols: int = 1024) -> np.ndarray:
    """(rows, cols) float32 made by integer arithmetic alone (the same bits on every machine and numpy version): sums
    of four 16-bit uniforms of a 64-bit hash, roughly Gaussian, each row scaled by a power of two from 2^-31 to 2^-14;
    then edge blocks: zeros, one spike, all equal, values near float32's smallest."""
    n = rows * cols * 4
    state = np.uint64(0x9E3779B97F4A7C15) * (np.arange(n, dtype=np.uint64) + np.uint64(1))
    state ^= state >> np.uint64(29)
    state *= np.uint64(0xBF58476D1CE4E5B9)
    state ^= state >> np.uint64(32)
    u = (state & np.uint64(0xFFFF)).astype(np.int64).reshape(rows, cols, 4).sum(-1) - 2 * 65535
    x = (u * np.exp2(np.arange(rows) % 18 - 31.0)[:, None]).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = 0
    x[1, 7] = 1.0
    x[2, :256] = -0.25
    x[3, :256] *= np.float32(2.0 ** -100)
    return x


# sha256 of what ggml's own quantizers (libggml-base, ggml_quantize_chunk: what llama-quantize runs without an
# importance matrix) write for searching_test_data(); IQ4_NL's reference variant (ntry -1) on rows 4.. (its blocks of
# zeros keep whatever ggml's stack held)
GGML_DIGESTS = {
    6: "be31bb16485c3362b271bc744dad22ab77c75d12d7bf52b76adb12e9b1838417",  # Q5_0
    12: "c9b2bbf4df67d672958ea5c962ae1ed9ab9c4ae4d8ed7f07c2a5c8163a8fd9f7",  # Q4_K
    20: "adbeda489b939af2bd1ee0b442ea32925de12fdfa939005d8b2c88ef87d86e9c",  # IQ4_NL
    "iq4_nl_ref": "7c60e8f644a8eca610118b189517805da8767af7b1d5f2633f4ddfbd082d6b48",
}


@pytest.mark.parametrize("ggml_type", [6, 12, 20], ids=["Q5_0", "Q4_K", "IQ4_NL"])
def test_quantize_is_bit_exact_with_ggml(ggml_type):
    import hashlib
    x = searching_test_data()
    got = quantize(x, ggml_type)
    assert hashlib.sha256(got.tobytes()).hexdigest() == GGML_DIGESTS[ggml_type]
    if ggml_type == 6:  # and with the gguf package, on the other test data
        y = block_test_data(np.random.default_rng(6))
        np.testing.assert_array_equal(quantize(y, 6), gguf_quantize(y, GGMLQuantizationType.Q5_0))


def test_iq4_nl_reference_variant():
    import hashlib
    from tinyvllm.model.quantizer_search import quantize_iq4_nl
    x = np.ascontiguousarray(searching_test_data()[4:])
    out = np.empty((x.size // 32, 18), np.uint8)
    quantize_iq4_nl(x.reshape(-1, 32), out, ntry=-1)
    assert hashlib.sha256(out.tobytes()).hexdigest() == GGML_DIGESTS["iq4_nl_ref"]


def test_iq4_nl_search_beats_the_plain_scale():
    """Each block's scale and assignment fit x at least as well (weighted by x^2, ggml's measure) as the plain
    scale max / 127 with every x rounded to its nearest value: the search only keeps better fits (to within the
    float16 rounding of the scale: blocks whose scale float16 holds to 11 bits)."""
    x = block_test_data(np.random.default_rng(20))[5:].reshape(-1, 32).astype(np.float64)
    x = x[np.abs(x).max(axis=1) / 127 > 2.0 ** -10]
    back = dequantize(quantize(x.astype(np.float32), 20).reshape(-1), 20, x.shape).astype(np.float64)
    values = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = big / -127
    plain = values[np.abs(x[..., None] / d[..., None] - values).argmin(-1)] * d
    weighted = lambda y: (x * x * (y - x) ** 2).sum(1)  # noqa: E731
    assert (weighted(back) <= weighted(plain) * (1 + 1e-2) + 1e-30).all()


def test_quantize_errors():
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"ggml type 14 \(Q6_K\); supported: Q4_0 \(2\), Q4_1 \(3\)"):
        quantize(x, 14)
    with pytest.raises(ValueError, match=r"multiple of 32 elements, got shape \(2, 48\)"):
        quantize(np.ones((2, 48), np.float32), 8)
    with pytest.raises(ValueError, match="float weights, got dtype int32"):
        quantize(np.ones((2, 64), np.int32), 8)
    for bad in (np.nan, np.inf, 1e9):
        y = x.copy()
        y[1, 40] = bad
        for ggml_type in (*TYPES.values(), 6, 20):
            with pytest.raises(ValueError, match="float16 cannot hold"):
                quantize(y, ggml_type)
        y256 = np.ones((2, 256), np.float32)
        y256[1, 40] = bad
        with pytest.raises(ValueError, match="float16 cannot hold"):
            quantize(y256, 12)
    assert quantize(np.zeros((0, 64), np.float32), 3).shape == (0, 40)
    np.testing.assert_array_equal(quantize(x.astype(np.float16), 8), quantize(x, 8))  # float16 in: widened first


# ---------------------------------------------------------------- the GGUF writer

EVERY_TYPE = {
    "t.u8": gw.MetadataValue(200, gw.UINT8), "t.i8": gw.MetadataValue(-100, gw.INT8),
    "t.u16": gw.MetadataValue(60000, gw.UINT16), "t.i16": gw.MetadataValue(-30000, gw.INT16),
    "t.u32": 4_000_000_000, "t.i32": -2_000_000_000, "t.f32": 0.5, "t.bool": True, "t.str": "héllo 🤖",
    "t.u64": 2**63 + 5, "t.i64": -(2**40), "t.f64": gw.MetadataValue(1 / 3, gw.FLOAT64),
    "t.strings": ["a", "", "Ġthe", "<|im_end|>"], "t.ints": [3, -1, 7], "t.floats": [0.25, -2.0],
    "t.bools": [True, False], "t.u8s": gw.MetadataValue([1, 2, 255], gw.ARRAY, gw.UINT8), "t.empty": [],
    "general.alignment": gw.MetadataValue(64, gw.UINT32),
}
EXPECTED_GGUF_TYPES = {  # gguf.GGUFReader's view: the value type, then an array's item type
    "t.u8": [0], "t.i8": [1], "t.u16": [2], "t.i16": [3], "t.u32": [4], "t.i32": [5], "t.f32": [6], "t.bool": [7],
    "t.str": [8], "t.u64": [10], "t.i64": [11], "t.f64": [12], "t.strings": [9, 8], "t.ints": [9, 5],
    "t.floats": [9, 6], "t.bools": [9, 7], "t.u8s": [9, 0], "general.alignment": [4],
}


def small_tensors(rng: np.random.Generator) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """name -> (ggml type, bytes or values to write, the float32 values they hold)."""
    w = rng.standard_normal((3, 64)).astype(np.float32)
    q = quantize(w, 8)
    v = rng.standard_normal(5).astype(np.float32)  # 20 bytes: the next tensor needs padding
    h = rng.standard_normal((2, 3)).astype(np.float16)
    return {"w.q8": (8, q, dequantize(q.reshape(-1), 8, (3, 64))), "v.f32": (0, v, v),
            "h.f16": (1, h, h.astype(np.float32))}


def test_writer_round_trip(tmp_path):
    tensors = small_tensors(np.random.default_rng(0))
    path = tmp_path / "all.gguf"
    size = gw.write_gguf(path, EVERY_TYPE, [gw.TensorData(n, v.shape, t, data) for n, (t, data, v) in tensors.items()])
    assert size == path.stat().st_size

    ours = GGUFFile(path)  # our reader
    for key, value in EVERY_TYPE.items():
        expected = value.value if isinstance(value, gw.MetadataValue) else value
        got = ours.metadata[key]
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key
    for name, (ggml_type, _, values) in tensors.items():
        info = ours.tensors[name]
        assert info.ggml_type == ggml_type and info.offset % 64 == 0
        raw = ours.raw(name, tensor_nbytes(ggml_type, info.shape))
        np.testing.assert_array_equal(dequantize(raw, ggml_type, info.shape), values)

    reader = gguf.GGUFReader(path)  # llama.cpp's Python reader
    for key, types in EXPECTED_GGUF_TYPES.items():
        assert [int(t) for t in reader.fields[key].types] == types, key
    assert reader.fields["t.str"].contents() == "héllo 🤖"
    assert reader.fields["t.strings"].contents() == ["a", "", "Ġthe", "<|im_end|>"]
    assert reader.fields["t.u64"].contents() == 2**63 + 5
    assert reader.alignment == 64
    for t in reader.tensors:
        ggml_type, _, values = tensors[t.name]
        assert int(t.tensor_type) == ggml_type
        got = gguf.quants.dequantize(t.data, GGMLQuantizationType(ggml_type)) if ggml_type == 8 else t.data
        np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(values.shape), values)

    typed = gw.read_metadata(path)  # types read back as written: a rewrite keeps them
    assert {k: v.type for k, v in typed.items()} == {k: gw.typed(v).type for k, v in EVERY_TYPE.items()}
    assert typed["t.u8s"].item_type == gw.UINT8 and typed["t.ints"].item_type == gw.INT32


def test_writer_layout_by_hand(tmp_path):
    """The bytes themselves, for one key and one tensor, against the GGUF spec."""
    path = tmp_path / "one.gguf"
    data = np.arange(4, dtype=np.float32)
    gw.write_gguf(path, {"k": gw.MetadataValue(7, gw.UINT32)}, [gw.TensorData("t", (4,), 0, data)])
    raw = path.read_bytes()
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    kv = struct.pack("<Q", 1) + b"k" + struct.pack("<II", 4, 7)
    info = struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 4, 0, 0)
    head = header + kv + info
    assert raw[:len(head)] == head
    start = (len(head) + 31) // 32 * 32
    assert raw[len(head):start] == bytes(start - len(head))  # zeros up to the alignment
    assert raw[start:start + 16] == data.tobytes() and len(raw) == start + 32  # the tensor padded to 32 too


def test_default_types():
    """A value without a stated type gets the one llama.cpp's writers use for it."""
    assert gw.typed(5).type == gw.UINT32 and gw.typed(-5).type == gw.INT32 and gw.typed(2**40).type == gw.INT64
    assert gw.typed(np.int64(3)) == gw.MetadataValue(3, gw.UINT32)  # numpy scalars as the numbers they hold
    assert gw.typed(np.float32(0.5)) == gw.MetadataValue(0.5, gw.FLOAT32) and gw.typed(True).type == gw.BOOL
    assert gw.typed([1, -2]).item_type == gw.INT32  # token types
    assert gw.typed([1, 2**31]).item_type == gw.UINT32 and gw.typed([2**63]).item_type == gw.UINT64


def test_writer_errors(tmp_path):
    path = tmp_path / "bad.gguf"
    t = gw.TensorData("t", (4,), 0, np.zeros(4, np.float32))
    cases = [
        ({"general.alignment": 12}, [t], "general.alignment must be a positive multiple of 8"),
        ({}, [t, t], r"tensor names must be unique; repeated: \['t'\]"),
        ({}, [gw.TensorData("t", (5,), 0, np.zeros(4, np.float32))], "is 20 bytes, the data given is 16"),
        ({"k": gw.MetadataValue(300, gw.UINT8)}, [], r"'k': 300 is not a value of GGUF type 0"),
        ({"k": gw.MetadataValue([1, -1], gw.ARRAY, gw.UINT32)}, [], "do not all fit GGUF type 4"),
        ({"k": [1, "a"]}, [], "items of one type"),
        ({"k": {"a": 1}}, [], "cannot write a dict"),
        ({"k": 2**64}, [], "does not fit a GGUF integer"),
    ]
    for metadata, tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            gw.write_gguf(path, metadata, tensors)


# ---------------------------------------------------------------- python -m tinyvllm.quantize

def logits(path) -> np.ndarray:
    """The last position's logits of a fixed prompt through tinyvllm's model, loaded from `path`."""
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
    from tinyvllm.model.loader import load_model

    model, _, _ = load_model(path)
    prompt = [int(t) for t in np.random.default_rng(5).integers(100, 40000, size=24)]
    return ContiguousModelRunner(model, 64).prefill(prompt)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Two tiny HF checkpoints: untied (a separate lm_head) and tied, and their float logits."""
    base = tmp_path_factory.mktemp("quantize")
    untied = write_tiny_model(base / "untied")
    tied = write_tiny_model(base / "tied", dataclasses.replace(TINY_CONFIG, tie_word_embeddings=True), seed=1)
    return {"untied": untied, "tied": tied}


@pytest.fixture(scope="module")
def tiny_float_logits(tiny_dirs):
    return logits(tiny_dirs["untied"])


# Relative RMS error of the tiny model's logits, ||quantized - float|| / ||float||, measured: q8_0 0.021-0.025,
# q4_0 0.31, q4_1 0.29 (the lower figure with weights dequantized at load, the higher on the fused kernels, which
# also round activations to 8 bits). Why those sizes: a weight's rounding error is uniform within half a step, RMS
# step / sqrt(12); a step is a block's largest |w| / 127 for Q8_0 (~2.1 sigma / 127 for 32 gaussian weights: 0.5%
# of sigma RMS) and its range / 15 for Q4 (~4.2 sigma / 15: 8%), so Q4's error is ~16x Q8_0's, as measured; the
# random 2-layer network (embedding, 7 linears a layer, lm_head in series) amplifies either about 4x. The bounds
# are twice the measurements; the logits of another random model (seed 3) are off by 1.39.
LOGIT_BOUNDS = {"q8_0": 0.05, "q4_0": 0.6, "q4_1": 0.6, "iq4_nl": 0.6}


@pytest.mark.parametrize("name", [*TYPES, "iq4_nl"])
def test_hf_round_trip(tiny_dirs, tiny_float_logits, tmp_path, name, capsys):
    out = quantize_model(tiny_dirs["untied"], tmp_path / f"tiny-{name}.gguf", name)
    printed = capsys.readouterr().out
    assert "blk.0.attn_q.weight" in printed and "MiB ->" in printed and " s" in printed.splitlines()[-1]

    f = GGUFFile(out)
    types = {n: i.ggml_type for n, i in f.tensors.items()}
    assert types["output.weight"] == 8  # llama.cpp spends more bits on the output matrix
    assert types["token_embd.weight"] == types["blk.1.ffn_down.weight"] == QUANTIZE_TYPES[name]  # untied: --type
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == 0  # norms stay F32
    assert f.metadata["general.file_type"] == {"q8_0": 7, "q4_0": 2, "q4_1": 3, "iq4_nl": 25}[name]

    float_ck, quant_ck = load_checkpoint(tiny_dirs["untied"]), load_checkpoint(out)
    # GGUF keeps the epsilon as float32 (llama.attention.layer_norm_rms_epsilon), config.json as a decimal
    eps32 = float(np.float32(float_ck.config.rms_norm_eps))
    assert quant_ck.config == dataclasses.replace(float_ck.config, rms_norm_eps=eps32)
    heads = {"q_proj": TINY_CONFIG.num_attention_heads, "k_proj": TINY_CONFIG.num_key_value_heads}
    for hf, w in float_ck.state_dict.items():  # exactly the blocks' values, q/k rows back in HF order
        ggml_type = 0 if w.ndim == 1 else 8 if hf == "lm_head.weight" else QUANTIZE_TYPES[name]
        head = heads.get(hf.split(".")[-2])
        expected = permute_qk(w, head) if head else w
        if ggml_type:
            expected = dequantize(quantize(expected, ggml_type).reshape(-1), ggml_type, w.shape)
        np.testing.assert_array_equal(quant_ck.state_dict[hf], unpermute_qk(expected, head) if head else expected)

    ours, expected = logits(out), tiny_float_logits
    rel = np.linalg.norm(ours - expected) / np.linalg.norm(expected)
    assert rel < LOGIT_BOUNDS[name], rel


def test_tied_model_gets_a_q8_0_embedding_and_reads_back_in_gguf(tiny_dirs, tmp_path, capsys):
    out = quantize_model(tiny_dirs["tied"], tmp_path / "tied.gguf", "q4_0")
    f = GGUFFile(out)
    assert "output.weight" not in f.tensors and f.tensors["token_embd.weight"].ggml_type == 8
    assert f.tensors["blk.0.attn_q.weight"].ggml_type == 2

    reader = gguf.GGUFReader(out)
    assert {t.name: int(t.tensor_type) for t in reader.tensors} == {n: i.ggml_type for n, i in f.tensors.items()}
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    np.testing.assert_array_equal(gguf.quants.dequantize(q.data, GGMLQuantizationType.Q4_0),
                                  dequantize(f.raw(q.name, q.n_bytes), 2, f.tensors[q.name].shape))
    # requantizing a GGUF: Q4_0 -> Q8_0 reads the Q4_0 values and rounds them again: within half a Q8_0 step,
    # plus the float16 scale's rounding (relative 2**-11) times |q| <= 127
    again = quantize_model(out, tmp_path / "tied-q8.gguf", "q8_0")
    a, b = load_checkpoint(out).state_dict, load_checkpoint(again).state_dict
    for name, w in a.items():
        assert np.abs(b[name] - w).max() <= np.abs(w).max() / 127 * (0.5 + 127 * 2**-11), name


def test_hf_tokenizer_becomes_gguf_metadata(tiny_dirs, tmp_path, capsys):
    """The tiny checkpoint's tokenizer files are convert.py's rebuild of the shipped GGUF's tokenizer: writing
    them back must give the shipped tokenizer.* keys, and the same ids for a sentence."""
    out = quantize_model(tiny_dirs["untied"], tmp_path / "tok.gguf", "q8_0")
    shipped, written = GGUFFile(default_model_path()).metadata, GGUFFile(out).metadata
    for key in ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]:
        assert written[key] == shipped[key], key
    for key in ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length", "vocab_size"]:
        assert written[f"llama.{key}"] > 0
    assert load_tokenizer(out).encode(SENTENCE) == load_tokenizer(default_model_path()).encode(SENTENCE)


@pytest.fixture(scope="module")
def default_q8_0(tmp_path_factory):
    """The shipped Q4_1 model requantized to Q8_0 through the command line."""
    out = tmp_path_factory.mktemp("default-q8") / "smollm2-q8_0.gguf"
    cmd = [sys.executable, "-m", "tinyvllm.quantize", str(default_model_path()), str(out), "--type", "q8_0"]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out, result.stdout


@pytest.mark.slow
def test_default_model_metadata_kept(default_q8_0):
    out, printed = default_q8_0
    lines = printed.splitlines()
    assert len(lines) == 273 and lines[0].startswith("[   1/272] token_embd.weight")
    shipped = GGUFFile(default_model_path())
    before = sum(tensor_nbytes(i.ggml_type, i.shape) for i in shipped.tensors.values())
    after = sum(tensor_nbytes(8 if len(i.shape) == 2 else 0, i.shape) for i in shipped.tensors.values())
    assert "Q4_1 -> Q8_0" in printed and f"tensors: {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB" in lines[-1]

    source, written = gw.read_metadata(default_model_path()), gw.read_metadata(out)
    assert list(written) == list(source)  # every key, in its place
    for key, value in source.items():
        if key != "general.file_type":
            assert written[key] == value, key  # same value and same GGUF type
    assert written["general.file_type"] == gw.MetadataValue(7, gw.UINT32)  # LLAMA_FTYPE_MOSTLY_Q8_0

    types = {n: i.ggml_type for n, i in GGUFFile(out).tensors.items()}
    assert sorted(set(types.values())) == [0, 8] and types["token_embd.weight"] == 8
    assert load_tokenizer(out).encode(SENTENCE) == load_tokenizer(default_model_path()).encode(SENTENCE)
    reader = gguf.GGUFReader(out)
    assert len(reader.tensors) == 272 and reader.fields["general.file_type"].contents() == 7


@pytest.mark.slow
def test_same_type_is_copied_byte_for_byte(tmp_path, capsys):
    """Q4_1 -> q4_1: every tensor is already its target type, so the blocks are copied, not requantized."""
    out = quantize_model(default_model_path(), tmp_path / "same.gguf", "q4_1")
    a, b = GGUFFile(default_model_path()), GGUFFile(out)
    for name, info in a.tensors.items():
        nbytes = tensor_nbytes(info.ggml_type, info.shape)
        assert b.tensors[name].ggml_type == info.ggml_type
        assert np.array_equal(a.raw(name, nbytes), b.raw(name, nbytes)), name


# The greedy continuations of the shipped Q4_1 model and of its Q8_0 requantization. Q8_0 moves each Q4_1 weight
# by at most half a Q8_0 step (~0.4% of its block's largest weight); measured on these prompts, the chosen token's
# logprob moves by 0.12 nats at most, so the gap between the top two tokens moves by ~0.25 at most. Greedy decoding
# follows whichever of two near-tied tokens is ahead, and once the texts differ they go separate ways (the Q4_1
# model's own first token for the code prompt is a 0.13-nat tie). Required: the same tokens up to the first step
# where the original's top two are within NEAR_TIE = 0.5 nats (twice the largest move), at least 12 tokens so
# compared over the prompts (21 today), and the Q8_0 model still knows that Paris is the capital of France.
GREEDY_PROMPTS = [("The capital of France is", False), ("What is the tallest mountain in the world?", True),
                  ("def fibonacci(n):\n    ", False)]
NEAR_TIE = 0.5


def greedy_with_margins(generator, request_id: str, ids: list[int]) -> tuple[list[int], list[float]]:
    """16 greedy tokens, and at each step the logprob gap between the best and the second-best token."""
    from tinyvllm.sampling_params import SamplingParams

    engine = generator.engine
    engine.add_request(request_id, ids, SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                completion = output.outputs[0]
    margins = []
    for _, top in completion.logprobs:
        first, second = sorted((lp for _, lp in top), reverse=True)[:2]
        margins.append(first - second)
    return list(completion.token_ids), margins


@pytest.mark.slow
def test_default_model_q8_0_generates_the_same_text(default_q8_0, generator):
    from tinyvllm.engine.generator import Generator

    q8 = Generator(str(default_q8_0[0]), max_model_len=512, kv_cache_memory="64MiB")
    compared = 0
    for i, (prompt, chat) in enumerate(GREEDY_PROMPTS):
        ids = generator.encode_prompt(prompt, chat=chat)
        assert q8.encode_prompt(prompt, chat=chat) == ids
        original, margins = greedy_with_margins(generator, f"quantize-test-q4_1-{i}", ids)
        requantized, _ = greedy_with_margins(q8, f"quantize-test-q8_0-{i}", ids)
        n = next((step for step, m in enumerate(margins) if m < NEAR_TIE), len(margins))
        texts = q8.tokenizer.decode(original), q8.tokenizer.decode(requantized)
        assert original[:n] == requantized[:n], (prompt, *texts)
        compared += n
        if i == 0:
            assert q8.tokenizer.decode(requantized).startswith(" Paris")
    assert compared >= 12


def test_command_line_errors(tmp_path, tiny_dirs):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope")
    out = tmp_path / "out.gguf"
    for args, message in [
        ([str(tmp_path / "missing.gguf"), str(out), "--type", "q8_0"], "no model at"),
        ([str(not_gguf), str(out), "--type", "q8_0"], "is not a GGUF file"),
        ([str(tmp_path), str(out), "--type", "q8_0"], "has no config.json"),
        ([str(tiny_dirs["untied"]), str(out), "--type", "q5_k"], "invalid choice: 'q5_k'"),
        ([str(not_gguf), str(not_gguf), "--type", "q8_0"], "is the input"),
        ([str(not_gguf), str(tmp_path), "--type", "q8_0"], "must be a file path in an existing directory"),
        ([str(not_gguf), str(tmp_path / "no" / "x.gguf"), "--type", "q8_0"], "in an existing directory"),
    ]:
        result = subprocess.run([sys.executable, "-m", "tinyvllm.quantize", *args], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert "q8_0" in result.stderr and "q4_0" in result.stderr and "q4_1" in result.stderr  # the usage line
    assert not out.exists() and not (tmp_path / "out.gguf.tmp").exists()
    with pytest.raises(ValueError, match="unknown quantization type 'q2_k'; supported: q8_0, q4_0, q4_1"):
        quantize_model(tiny_dirs["untied"], out, "q2_k")


def test_unsupported_inputs(tmp_path, tiny_dirs):
    # a GGUF holding a block type tinyvllm cannot read (written by the gguf package itself)
    writer = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    for key, value in [("llama.block_count", 1), ("llama.context_length", 64), ("llama.embedding_length", 256),
                       ("llama.feed_forward_length", 256), ("llama.attention.head_count", 4)]:
        writer.add_uint32(key, value)
    writer.add_token_list(["a", "b"])
    # IQ2_XXS: 66 bytes per 256 elements
    writer.add_tensor("token_embd.weight", np.zeros((2, 66), np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'token_embd.weight'.*IQ2_XXS \(id 16\) is not supported.*Q4_1\(3\)"):
        quantize_model(tmp_path / "iq2.gguf", tmp_path / "out.gguf", "q8_0")

    # an HF directory whose config asks for llama3 RoPE scaling: GGUF keeps that in a tensor we do not read
    config = json.loads((tiny_dirs["untied"] / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in tiny_dirs["untied"].iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling 'llama3' cannot be written"):
        quantize_model(scaled, tmp_path / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.skipif(not os.environ.get("TINYVLLM_PEERS"), reason="set TINYVLLM_PEERS to a --peers directory "
                    "(benchmarks/peers/build_llama_cpp.py) to compare with llama.cpp's llama-quantize")
@pytest.mark.parametrize("name", [*TYPES, "iq4_nl", "q4_k"])
def test_same_bytes_as_llama_quantize(tmp_path, name, capsys):
    """llama.cpp itself as the oracle: from the same F32 GGUF, llama-quantize and tinyvllm write the same file,
    byte for byte (metadata, tensor types, blocks, padding). IQ4_NL and Q4_K: llama-quantize's mixtures for them
    put some tensors in Q5_K or Q6_K, which tinyvllm cannot write, so against its --pure file (every matrix in the
    type, Q4_K's rows of 576 in Q5_0) with the embedding in Q8_0, as tinyvllm writes it."""
    peers = Path(os.environ["TINYVLLM_PEERS"])
    source = peers / "models" / "SmolLM2-135M-Instruct.F32.gguf"
    theirs, ours = tmp_path / "llama.cpp.gguf", tmp_path / "tinyvllm.gguf"
    pure = ["--pure", "--token-embedding-type", "q8_0"] if name not in TYPES else []
    cmd = [str(peers / "llama.cpp" / "build" / "bin" / "llama-quantize"), *pure, str(source), str(theirs),
           name.upper(), "2"]
    subprocess.run(cmd, check=True, capture_output=True)
    quantize_model(source, ours, name)
    assert theirs.read_bytes() == ours.read_bytes()
