"""Phase 6: `python -m tinyvllm.quantize` (the quantizers: tests/model/test_quantizer.py; the GGUF writer:
tests/model/test_gguf_writer.py).

Oracles: HF-free round trips through our loader, the `gguf` package's GGUFReader, llama-quantize's bytes, and the
shipped Q4_1 model itself (its greedy text before and after requantizing to Q8_0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

from conftest import TINY_CONFIG, write_tiny_model  # noqa: E402
from tinyvllm.model import gguf_writer as gw  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.quant import dequantize, tensor_nbytes  # noqa: E402
from tinyvllm.model.quantizer import QUANTIZE_TYPES, quantize  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.weights import default_model_path, load_checkpoint  # noqa: E402
from tinyvllm.model.weights_gguf import permute_qk, unpermute_qk  # noqa: E402
from tinyvllm.quantize import quantize_model  # noqa: E402
from test_quantizer import TYPES  # noqa: E402

SENTENCE = "The capital of France is Paris. 12345 + 3.14 = x² café 🤖 <|im_start|>user"

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
