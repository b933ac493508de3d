"""Perplexity (tinyvllm/perplexity.py): llama-perplexity's method, and HF transformers as the oracle.

The method's rules are checked on their own (chunk count, which tokens are scored, BOS, the log-softmax);
the real model's chunked perplexity over LICENSE.txt is checked against HF transformers running the same
chunks on the same dequantized weights. llama.cpp's own figure is compared in benchmarks/bench_quality.py
(`--peers`): this suite's machines have no llama.cpp build.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.perplexity import (
    PerplexityResult,
    chunk_tokens,
    default_text_path,
    num_chunks,
    perplexity,
    read_text,
    scored_nll,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # benchmarks/peers/llama_cpp.py


def test_chunk_count_follows_llama_perplexity():
    assert num_chunks(3767, 512) == 7  # floor(3767 / 512): the last 183 tokens are not scored
    assert num_chunks(3767, 512, max_chunks=2) == 2
    assert num_chunks(3767, 512, max_chunks=100) == 7
    assert num_chunks(1024, 512) == 2
    with pytest.raises(ValueError, match="at least 1024"):
        num_chunks(1023, 512)  # llama-perplexity refuses fewer than 2 * n_ctx tokens
    with pytest.raises(ValueError, match="even"):
        num_chunks(3767, 511)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        num_chunks(3767, 512, max_chunks=0)


def test_bos_replaces_each_chunks_first_token():
    ids = list(range(10, 30))
    assert chunk_tokens(ids, 8, 2, None) == [ids[:8], ids[8:16]]
    assert chunk_tokens(ids, 8, 2, 1) == [[1, *ids[1:8]], [1, *ids[9:16]]]


def test_scored_nll_is_the_log_softmax():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 100)) * 4).astype(np.float32)
    targets = rng.integers(0, 100, 5)

    def naive(x: np.ndarray) -> list[float]:
        return [-math.log(math.exp(row[t]) / sum(math.exp(v) for v in row)) for row, t in zip(x, targets)]

    np.testing.assert_allclose(scored_nll(logits, targets), naive(logits.astype(np.float64)), rtol=1e-12)
    # logits past exp's range (e^800 overflows float64) must not overflow: only their differences matter
    shifted = logits + np.float32(800)
    np.testing.assert_allclose(scored_nll(shifted, targets), naive(shifted.astype(np.float64) - 800), rtol=1e-12)
    assert scored_nll(np.zeros((1, 50), np.float32), np.array([3]))[0] == pytest.approx(math.log(50))


def test_text_is_read_as_llama_perplexity_reads_it(tmp_path):
    assert default_text_path().name == "LICENSE.txt"
    (tmp_path / "a.txt").write_text("one\ntwo\n\n")
    assert read_text(tmp_path / "a.txt") == "one\ntwo\n"  # one trailing newline dropped, as -f does


# ---- llama-perplexity's output, as benchmarks/peers/llama_cpp.py reads it (recorded: no llama.cpp needed) ----

LLAMA_PERPLEXITY_OUTPUT = """\
0.00.358.338 I perplexity: tokenizing the input ..
0.00.365.527 I perplexity: tokenization took 7.179 ms
0.00.365.580 I perplexity: calculating perplexity over 7 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.06.858.918 I perplexity: 6.49 seconds per pass - ETA 0.18 minutes
[1]9.5235,[2]16.4192,[3]13.8962,[4]12.9222,[5]13.2070,[6]12.4830,[7]11.6892,
0.12.170.575 I Final estimate: PPL = 11.6892 +/- 0.78806
"""


def test_parse_llama_perplexity_output(tmp_path):
    import struct

    from peers.llama_cpp import parse_perplexity, read_logits_file_tokens

    parsed = parse_perplexity(LLAMA_PERPLEXITY_OUTPUT)
    assert parsed == {"ppl": 11.6892, "ppl_stderr": 0.78806, "chunks": 7, "n_ctx": 512,
                      "chunk_ppl": [9.5235, 16.4192, 13.8962, 12.9222, 13.207, 12.483, 11.6892]}
    with pytest.raises(ValueError, match="no perplexity"):
        parse_perplexity("main: error: failed to load model")
    # --kl-divergence-base FILE: magic, n_ctx, n_vocab, n_chunk, then the chunks' token ids (then log-probs)
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + struct.pack("<3i", 4, 100, 2) + struct.pack("<8i", *range(8)) + b"\0" * 64)
    assert read_logits_file_tokens(path) == list(range(8))
    path.write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(ValueError, match="not a llama-perplexity logits file"):
        read_logits_file_tokens(path)


# ---- the model ----

def test_chunks_are_evaluated_from_scratch(tiny_model_dir):
    """A chunk's logits do not depend on the chunk before it: each starts on an empty KV cache."""
    from tinyvllm.model.loader import load_model
    from tinyvllm.perplexity import ChunkScorer

    model, _, _ = load_model(tiny_model_dir)
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, 49152, 32).tolist() for _ in range(2))
    scorer = ChunkScorer(model, 32)
    after_a = (scorer(a), scorer(b))
    fresh = ChunkScorer(model, 32)(b)
    assert after_a[1].shape == (15, 49152)  # positions 16..30 score tokens 17..31
    np.testing.assert_array_equal(after_a[1], fresh)
    assert not np.allclose(after_a[0], after_a[1])
    with pytest.raises(ValueError, match="32 tokens"):
        scorer(a[:31])
    # fed 8 tokens per forward (positions 0-7, 8-15, ...), the chunk gives the same scored logits
    np.testing.assert_allclose(ChunkScorer(model, 32, tokens_per_step=8)(b), fresh, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must divide n_ctx"):
        ChunkScorer(model, 32, tokens_per_step=5)


@pytest.fixture(scope="module")
def dequantized_model():
    """The default model with every weight dequantized to float32: the numbers HF transformers computes with."""
    from tinyvllm.model.loader import load_model

    model, tokenizer, _ = load_model(quantization="none")
    return model, tokenizer


def hf_chunked_perplexity(hf_model, token_ids: list[int], n_ctx: int, chunks: int) -> float:
    """The same method on HF transformers: each chunk from scratch, the second half scored, float64 log-softmax."""
    import torch

    first, total, count = n_ctx // 2, 0.0, 0
    with torch.no_grad():
        for i in range(chunks):
            chunk = torch.tensor([token_ids[i * n_ctx:(i + 1) * n_ctx]])
            logits = hf_model(chunk).logits[0, first:n_ctx - 1].double()  # (n_ctx-1-first, V)
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = chunk[0, first + 1:]
            total -= float(logprobs[torch.arange(len(targets)), targets].sum())
            count += len(targets)
    return math.exp(total / count)


@pytest.mark.slow
@pytest.mark.oracle
def test_perplexity_matches_hf_transformers(dequantized_model, hf_model):
    model, tokenizer = dequantized_model
    text = read_text(default_text_path())
    n_ctx, chunks = 128, 2
    ours = perplexity(model, tokenizer, text, n_ctx=n_ctx, max_chunks=chunks)
    assert isinstance(ours, PerplexityResult)
    assert (ours.chunks, ours.tokens_scored) == (2, 2 * 63)
    assert ours.text_tokens == len(tokenizer.encode(text)) > 2 * n_ctx
    assert ours.ppl == pytest.approx(math.exp(ours.nll))
    theirs = hf_chunked_perplexity(hf_model, tokenizer.encode(text), n_ctx, chunks)
    assert ours.ppl == pytest.approx(theirs, rel=1e-3)
    assert 2 < ours.ppl < 100  # a trained model on English prose, not a broken one (uniform: 49152)


@pytest.mark.slow
def test_quantized_weights_keep_perplexity_within_one_percent(dequantized_model):
    """`auto` keeps the shipped Q4_1 blocks: the same weights as `none`, but the kernels round the activations to
    8 bits: the perplexity moves, by well under 1%. Fed 8 tokens per forward, as the engine's decode steps are,
    so that the kernels' optional float path for many rows (FLOAT_PATH_MIN_M) cannot take over."""
    from tinyvllm.kernels.qlinear import FLOAT_PATH_MIN_M
    from tinyvllm.model.loader import load_model

    model, tokenizer = dequantized_model
    quantized, _, _ = load_model(quantization="auto")
    assert "Q4_1" in quantized.weight_formats() and "Q4_1" not in model.weight_formats()
    text = read_text(default_text_path())
    none = perplexity(model, tokenizer, text, n_ctx=512, max_chunks=2)
    assert not 0 < FLOAT_PATH_MIN_M <= 8, "the float path would run: this test measures the integer one"
    auto = perplexity(quantized, tokenizer, text, n_ctx=512, max_chunks=2, tokens_per_step=8)
    assert auto.ppl == pytest.approx(none.ppl, rel=0.01)
    assert auto.ppl != none.ppl  # the integer kernels really ran: 8-bit activations give other numbers
