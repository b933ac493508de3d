"""GGUF -> HF directory conversion: weights round-trip exactly, shards, bfloat16, and the rebuilt tokenizer.

The default model is converted once per module three ways: with the command line (float32, one
file), sharded, and bfloat16. HF tokenizers, loading the written tokenizer.json, is the oracle for
the tokenizer: it must give the same ids as HF's own GGUF tokenizer loading.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from tinyvllm.convert import convert, parse_size, tokenizer_json
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.weights import default_model_path, load_checkpoint

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris. 12345 + 3.14 = x²",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "café naïve 日本語 🤖 Ünïcödé",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
]


@pytest.fixture(scope="module")
def gguf_checkpoint():
    return load_checkpoint()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default model written as one float32 file, through the command line."""
    out = tmp_path_factory.mktemp("convert") / "smollm2"
    cmd = [sys.executable, "-m", "tinyvllm.convert", str(default_model_path()), str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def converted_sharded(tmp_path_factory):
    return convert(default_model_path(), tmp_path_factory.mktemp("convert") / "sharded", max_shard_size=100_000_000)


def assert_same_checkpoint(a, b):
    assert a.config == b.config
    assert set(a.state_dict) == set(b.state_dict)
    for name, t in a.state_dict.items():
        np.testing.assert_array_equal(t, b.state_dict[name], err_msg=name)


@pytest.mark.slow
def test_round_trip_single_file(converted, gguf_checkpoint):
    files = sorted(p.name for p in converted.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    ck = load_checkpoint(converted)
    assert ck.path == converted
    assert_same_checkpoint(ck, gguf_checkpoint)


@pytest.mark.slow
def test_round_trip_sharded(converted_sharded, gguf_checkpoint):
    shards = sorted(converted_sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) == 6 and shards[0].name == "model-00001-of-00006.safetensors"
    assert not (converted_sharded / "model.safetensors").exists()
    index = json.loads((converted_sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(gguf_checkpoint.state_dict)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in gguf_checkpoint.state_dict.values())
    # the limit counts tensor bytes, as HF's does; the 113 MB embedding alone exceeds it and gets a shard of its own
    shard_tensors = {p.name: [] for p in shards}
    for name, file in index["weight_map"].items():
        shard_tensors[file].append(gguf_checkpoint.state_dict[name].nbytes)
    assert all(sum(sizes) <= 100_000_000 or len(sizes) == 1 for sizes in shard_tensors.values())
    assert shard_tensors[shards[0].name] == [gguf_checkpoint.state_dict["model.embed_tokens.weight"].nbytes]
    assert_same_checkpoint(load_checkpoint(converted_sharded), gguf_checkpoint)


@pytest.mark.slow
def test_bfloat16(tmp_path, gguf_checkpoint):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    out = convert(default_model_path(), tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16
    ck = load_checkpoint(out)
    for name, t in gguf_checkpoint.state_dict.items():  # rounded to nearest even, as torch rounds
        expected = torch.from_numpy(t).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(ck.state_dict[name], expected, err_msg=name)


@pytest.mark.slow
def test_metadata_files(converted, gguf_checkpoint):
    md = GGUFFile(default_model_path()).metadata
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert json.loads((converted / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == md["tokenizer.chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["add_bos_token"] is False
    header_len = int.from_bytes((converted / "model.safetensors").open("rb").read(8), "little")
    with (converted / "model.safetensors").open("rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    assert "lm_head.weight" not in header  # tied: the embedding serves as lm_head
    assert header["__metadata__"] == {"format": "pt"}


@pytest.fixture(scope="module")
def hf_tokenizers(converted):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = transformers.AutoTokenizer.from_pretrained(converted)
    return reference, ours


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_matches_hf_gguf_tokenizer(hf_tokenizers, text):
    reference, ours = hf_tokenizers
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == text


@pytest.mark.oracle
@pytest.mark.slow
def test_chat_template_and_special_tokens(hf_tokenizers):
    reference, ours = hf_tokenizers
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == reference.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.decode(ids, skip_special_tokens=True).startswith("system\nYou are a helpful AI assistant")


@pytest.mark.slow
def test_our_tokenizer_reads_the_converted_dir(converted):
    tokenizer = pytest.importorskip("tinyvllm.model.tokenizer")
    from_gguf, from_dir = tokenizer.load_tokenizer(default_model_path()), tokenizer.load_tokenizer(converted)
    for text in TEXTS:
        assert from_dir.encode(text) == from_gguf.encode(text)


# ---------------------------------------------------------------- tokenizer.json by hand

def tiny_bpe_metadata(**extra) -> dict:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<s>", "</s>"] + alphabet + ["ab", "Ġab"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
            "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1, **extra}


def test_tokenizer_json_by_hand():
    tokenizers = pytest.importorskip("tokenizers")
    md = tiny_bpe_metadata()
    tok = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(md)))
    ab, space_ab = len(md["tokenizer.ggml.tokens"]) - 2, len(md["tokenizer.ggml.tokens"]) - 1
    assert tok.encode("ab ab").ids == [ab, space_ab]
    assert tok.encode("</s>").ids == [1]  # a special token written in the text is found whole
    assert tok.decode([ab, space_ab]) == "ab ab"

    # add_bos_token: the post-processor puts BOS in front
    md = tiny_bpe_metadata(**{"tokenizer.ggml.add_bos_token": True})
    tok = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(md)))
    assert tok.encode("ab").ids == [0, ab]


def test_tokenizer_json_errors():
    with pytest.raises(ValueError, match=r"'llama'.*only byte-level BPE"):
        tokenizer_json({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<s>"]})
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='mystery'.*smollm"):
        tokenizer_json(tiny_bpe_metadata(**{"tokenizer.ggml.pre": "mystery"}))


def test_parse_size():
    assert parse_size("100MB") == 100_000_000
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="cannot read 'big'"):
        parse_size("big")


def test_command_line_errors(tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope")
    for args, message in [([str(tmp_path / "missing.gguf"), str(tmp_path / "out")], "GGUF file not found"),
                          ([str(not_gguf), str(tmp_path / "out")], "is not a GGUF file"),
                          ([str(not_gguf), str(tmp_path / "out"), "--dtype", "int8"], "invalid choice")]:
        result = subprocess.run([sys.executable, "-m", "tinyvllm.convert", *args], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
