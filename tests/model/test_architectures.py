"""The architectures beside LLaMA (Qwen2/2.5, Qwen3, Mistral with its sliding window, Gemma 3, Llama 3.1's
scaled RoPE), each against HF transformers' own implementation, with no model hub: every checkpoint is built
here from an HF config with random weights (`Qwen2ForCausalLM(Qwen2Config(...))`), saved by HF itself as
safetensors, and written again as GGUF by `tinyvllm.quantize` with the architecture's own metadata keys.

    HF config --> HF model (random) --save_pretrained--> dir --tinyvllm.quantize f32 / q8_0--> .gguf
                       |                                  |                                      |
                  logits, greedy tokens  ==  tinyvllm on dir  ==  tinyvllm on .gguf

The tokenizer is Qwen's kind, built here with the `tokenizers` library (byte-level BPE trained on the text
below, Qwen2's split regex, NFC) and checked against HF tokenizers on text it was not trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.oracle
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import torch_threads  # noqa: E402
from tinyvllm.model.bpe import QWEN2_PATTERN  # noqa: E402
from tinyvllm.model.config import ModelConfig  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.quantize import quantize_model  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 384
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
# name -> (HF model class, HF config class, config arguments)
ARCHS = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(SMALL, tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(SMALL, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(SMALL, head_dim=32, tie_word_embeddings=True)),
    # a window of 8 keys, far shorter than the prompt: the window decides every token after the 8th
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(SMALL, sliding_window=8)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(SMALL, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "llama3.1-rope": ("LlamaForCausalLM", "LlamaConfig", dict(SMALL, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
}

TRAIN_TEXT = ("The quick brown fox jumps over the lazy dog. It's 2024 and we'll see 12345 numbers!\n"
              "Café déjà vu: naïve façade, résumé. Qwen splits digits one by one: 3.14159, 2718.\n"
              "def main():\n    return [x * 2 for x in range(10)]\n\n") * 4
TEST_TEXT = ("Hello world! The dog's 987 cafe\u0301s (decomposed accent, NFC composes it) don't jump.\n\n"
             "   spaces  and\ttabs; 1234567 <|im_start|>user\nhi<|im_end|>")
PROMPT = "The quick brown fox jumps over the lazy dog. It's 2024 and we'll see numbers: 3.14159!"


def write_qwen_tokenizer(model_dir: Path) -> None:
    """A byte-level BPE tokenizer.json the way Qwen2 builds one: NFC, its split regex, ByteLevel bytes."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    # every id the model can produce is a token (a Qwen checkpoint pads its embedding past the tokenizer instead)
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    tok.save(str(model_dir / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": template}))


def randomize(model, gemma: bool) -> None:
    """Weights big enough that every part of the block moves the logits (HF's init, std 0.02, barely does)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms multiply by (1 + w): w near 0, not near 1
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> an HF model directory with random weights, saved by transformers (config.json as it writes it)."""
    import shutil

    torch.set_num_threads(torch_threads())
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    write_qwen_tokenizer(tokenizer_dir)
    dirs = {}
    for name, (model_cls, config_cls, args) in ARCHS.items():
        out = tmp_path_factory.mktemp(name)
        config = getattr(transformers, config_cls)(**args)
        model = getattr(transformers, model_cls)(config).eval()
        randomize(model, gemma=name.startswith("gemma"))
        model.save_pretrained(out)
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, out / file.name)
        dirs[name] = out
    return dirs


@functools.lru_cache(maxsize=None)
def _hf_reference(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """HF's greedy continuation and the log-softmax of its logits before each generated token (N, V)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits), dim=-1).numpy()
    return out.sequences[0, len(prompt):].tolist(), logprobs


def hf_reference(model_dir: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    return _hf_reference(model_dir, tuple(prompt), max_new_tokens)  # once per checkpoint, prompt and length


def our_greedy(path: Path, prompt: list[int], n: int, **engine_args) -> tuple[list[int], list]:
    """tinyvllm's greedy tokens and their top-20 logprobs, through the engine: a paged KV cache of 4-token blocks
    (so a window of 8 leaves whole blocks behind), and the C paged-attention kernel."""
    from tinyvllm.llm import LLM

    args = dict(max_model_len=128, kv_cache_memory="4MiB", quantization="none", block_size=4) | engine_args
    llm = LLM(path, **args)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=20)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.logprobs


def assert_same(ours: tuple[list[int], list], hf: tuple[list[int], np.ndarray], tol: float = 1e-4) -> None:
    """Same greedy tokens; every top-20 logprob within `tol` of HF's (a logit error shows up in them)."""
    assert ours[0] == hf[0]
    for (_, top), expected in zip(ours[1], hf[1]):
        ids, values = [t for t, _ in top], np.array([v for _, v in top])
        assert np.abs(values - expected[ids]).max() < tol


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_matches_hf(checkpoints, tmp_path, name):
    """HF form, and GGUF form (float32, written by tinyvllm.quantize): HF's greedy tokens, logprobs within 1e-4."""
    model_dir = checkpoints[name]
    prompt = load_tokenizer(model_dir).encode(PROMPT)
    assert len(prompt) > 2 * 8  # longer than the sliding windows, so that they matter
    expected = hf_reference(model_dir, prompt, 6)
    assert_same(our_greedy(model_dir, prompt, 6), expected)
    if name == "llama3.1-rope":  # llama.cpp keeps Llama 3.1's scaling in a rope_freqs tensor, not read (config.py)
        with pytest.raises(ValueError, match="rope_freqs"):
            quantize_model(model_dir, tmp_path / f"{name}.gguf", "f32", out=io.StringIO())
        return
    gguf = quantize_model(model_dir, tmp_path / f"{name}.gguf", "f32", out=io.StringIO())
    assert_same(our_greedy(gguf, prompt, 6), expected)


def test_gguf_metadata_is_the_architectures_own(checkpoints, tmp_path):
    """The GGUF files carry llama.cpp's keys for their architecture, read back into the same config."""
    for name, arch in (("qwen2", "qwen2"), ("qwen3", "qwen3"), ("mistral", "llama"), ("gemma3", "gemma3")):
        gguf = quantize_model(checkpoints[name], tmp_path / f"{name}.gguf", "f32", out=io.StringIO())
        f = GGUFFile(gguf)
        assert f.metadata["general.architecture"] == arch
        assert f.metadata[f"{arch}.block_count"] == ARCHS[name][2].get("num_hidden_layers", 2)
        hf_config = ModelConfig.from_hf_config(json.loads((checkpoints[name] / "config.json").read_text()))
        from_gguf = ModelConfig.from_gguf_metadata(f.metadata, set(f.tensors))
        assert from_gguf.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # stored as float32
        assert dataclasses.replace(from_gguf, rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    assert "blk.0.attn_q.bias" in GGUFFile(tmp_path / "qwen2.gguf").tensors
    assert "blk.0.attn_k_norm.weight" in GGUFFile(tmp_path / "qwen3.gguf").tensors
    assert GGUFFile(tmp_path / "mistral.gguf").metadata["llama.attention.sliding_window"] == 8


def test_qwen_tokenizer_matches_hf(checkpoints, tmp_path):
    """Qwen's byte-level BPE (its regex: digits one by one; NFC) from tokenizer.json and from the GGUF."""
    model_dir = checkpoints["qwen2"]
    hf = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = hf.encode(TEST_TEXT, add_special_tokens=False).ids
    ours = load_tokenizer(model_dir)
    assert ours.encode(TEST_TEXT, add_special_tokens=False) == expected
    assert ours.decode(expected) == hf.decode(expected, skip_special_tokens=False)
    gguf = quantize_model(model_dir, tmp_path / "qwen2.gguf", "f32", out=io.StringIO())
    assert GGUFFile(gguf).metadata["tokenizer.ggml.pre"] == "qwen2"
    assert load_tokenizer(gguf).encode(TEST_TEXT, add_special_tokens=False) == expected


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'Phi3ForCausalLM'.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'phi3'.*'qwen2'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "phi3"})


# ---- every engine path, on one new architecture each ----

def test_mistral_window_through_every_attention_path(checkpoints):
    """Mistral's window (8 keys, blocks of 4) through the portable paged path with an int8 KV cache (its rounding:
    logprobs within 0.05), prefix caching (a second request whose prompt shares the first's cached blocks) and
    ngram speculative decoding (verify rows of one sequence, each with its own window)."""
    from tinyvllm.llm import LLM

    model_dir = checkpoints["mistral"]
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode(PROMPT)
    expected = hf_reference(model_dir, prompt, 6)
    assert_same(our_greedy(model_dir, prompt, 6, portable_attention=True, kv_cache_dtype="int8"), expected, tol=0.05)

    # a prompt holding over a quarter of the vocabulary, so that the ngram proposer finds most generated tokens in
    # it and drafts what followed them there
    repeat = list(range(8, 120))
    expected_repeat = hf_reference(model_dir, repeat, 8)
    llm = LLM(model_dir, max_model_len=128, kv_cache_memory="4MiB", quantization="none", block_size=4,
              enable_prefix_caching=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # (a request asking for logprobs
    for _ in range(2):  # does not speculate) the second time every full block of the prompt is a prefix-cache hit
        assert llm.generate([repeat], params, use_tqdm=False)[0].outputs[0].token_ids == expected_repeat[0]
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats


def test_qwen2_quantized_weights(checkpoints, tmp_path):
    """Qwen2 (biases) in Q8_0, quantized at load (the fused dequant-matmul kernels): HF's float32 tokens, logprobs
    within 0.05; and its Q8_0 GGUF written by tinyvllm.quantize: matrices in Q8_0, biases and norms kept F32."""
    model_dir = checkpoints["qwen2"]
    prompt = load_tokenizer(model_dir).encode(PROMPT)
    assert_same(our_greedy(model_dir, prompt, 6, quantization="q8_0"), hf_reference(model_dir, prompt, 6), tol=0.05)
    tensors = GGUFFile(quantize_model(model_dir, tmp_path / "qwen2-q8_0.gguf", "q8_0", out=io.StringIO())).tensors
    assert tensors["blk.0.attn_q.weight"].ggml_type == 8 and tensors["blk.0.attn_q.bias"].ggml_type == 0


def test_tinyvllm_serve_answers_the_openai_client(checkpoints):
    """`tinyvllm serve MODEL` (a process of its own) on Qwen2: the openai client gets HF's greedy text."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx
    import openai

    model_dir = checkpoints["qwen2"]
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode(PROMPT)
    tokens, _ = hf_reference(model_dir, prompt, 6)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "tinyvllm.cli", "serve", str(model_dir), "--port", str(port),
                             "--max-model-len", "128", "--kv-cache-memory", "4MiB", "--quantization", "none",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        (model,) = [m.id for m in client.models.list().data]
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)  # as the server does
        assert out.usage.completion_tokens == 6
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_gemma_sentencepiece_tokenizer_matches_hf(tmp_path):
    """Gemma's kind of sentencepiece (BPE, byte fallback, no dummy prefix, digits split, its <bos>/<eos> names and
    turn markers), trained here, against HF's GemmaTokenizer on text with bytes it never saw."""
    import sentencepiece

    (tmp_path / "train.txt").write_text(TRAIN_TEXT)
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
        eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = TEST_TEXT.replace("<|im_start|>", "<start_of_turn>").replace("<|im_end|>", "<end_of_turn>") + " 日本"
    expected = hf(text).input_ids
    ours = load_tokenizer(tmp_path)
    assert ours.encode(text) == expected and expected[0] == 2  # <bos> first
    assert ours.decode(expected, skip_special_tokens=True) == hf.decode(expected, skip_special_tokens=True)
