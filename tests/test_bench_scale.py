"""benchmarks/bench_scale.py on its `tiny` shape, without llama.cpp: the random checkpoint its GGUF writer makes,
and a whole run (its measuring process, one figure of each kind) writing its results file."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_scale  # noqa: E402
import common  # noqa: E402

from tinyvllm.model.config import ModelConfig  # noqa: E402
from tinyvllm.model.gguf import GGUFFile  # noqa: E402
from tinyvllm.model.weights import default_model_path  # noqa: E402


def test_random_checkpoint_has_the_shape_and_a_padded_vocabulary(tmp_path):
    shipped = len(GGUFFile(default_model_path()).metadata["tokenizer.ggml.tokens"])
    config = dataclasses.replace(bench_scale.SHAPES["tiny"], vocab_size=shipped + 64, num_hidden_layers=1,
                                 architecture="Qwen2ForCausalLM", attention_bias=True)
    path = bench_scale.write_random_gguf(config, tmp_path / "random.gguf")
    gguf = GGUFFile(path)
    read = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    assert read == dataclasses.replace(config, rms_norm_eps=read.rms_norm_eps)  # stored as a float32
    tokens, types = gguf.metadata["tokenizer.ggml.tokens"], gguf.metadata["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == config.vocab_size
    assert tokens[-1] == f"[PAD{config.vocab_size - 1}]" and types[-1] == 5  # unused
    assert gguf.tensors["token_embd.weight"].shape == (config.vocab_size, config.hidden_size)
    assert "blk.0.attn_q.bias" in gguf.tensors


def test_a_run_on_the_tiny_shape_writes_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "SCRATCH_DIR", tmp_path / "results")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "saved")
    bench_scale.main(["--shapes", "tiny", "--formats", "q8_0", "--concurrency", "2", "--decode-tokens", "4",
                      "--prefill-tokens", "16", "--max-model-len", "128", "--kv-cache-memory", "8MiB",
                      "--no-cold-start", "--work-dir", str(tmp_path / "models")])
    results = json.loads((tmp_path / "results" / "bench_scale.json").read_text())
    fig = results["shapes"]["tiny"]["formats"]["q8_0"]
    assert fig["file"] == "random-tiny.Q8_0.gguf" and "llama_cpp" not in fig
    ours = fig["tinyvllm"]
    assert "Q8_0" in ours["weight_formats"]
    assert ours["decode"]["tok_s"] > 0 and ours["prefill"]["tok_s"] > 0 and ours["concurrency"]["2"]["tok_s"] > 0
    assert 0 < ours["load_s"] < ours["process_s"] and ours["peak_rss_bytes"] > 2**20
    assert ours["first_request_s"] > 0 and ours["cold"] is None  # --no-cold-start: one process
    # tied embeddings: the lm_head is the embedding table, read whole each token, so every weight is read once
    assert ours["weight_bytes_per_token"] == sum(ours["weight_formats"].values())
    ceiling = fig["ceiling"]
    # no peer
    assert len(ceiling["read_bandwidth_runs_bytes_per_s"]) == 2 and ceiling["read_bandwidth_bytes_per_s"] > 1e9
    assert ceiling["tinyvllm"]["decode_bytes_per_s"] == ours["decode"]["tok_s"] * ours["weight_bytes_per_token"]
    bound = ceiling["decode_tok_s_bound"] * ours["weight_bytes_per_token"]
    assert bound == pytest.approx(ceiling["read_bandwidth_bytes_per_s"])
    # prefill: 2 operations per weight of the layers (tiny: 2 layers of 4 d^2 + 3 d f, d 256, f 512, 2 heads of KV)
    d, f, q, kv = 256, 512, 4 * 64, 2 * 64
    assert ceiling["prefill_ops_per_token"] == 2 * 2 * (2 * d * q + 2 * d * kv + 3 * d * f)
    # Q8_0's kernel runs dpbusd (the "vnni" step; the K-quants' rate on a CPU without it): every layer weight there
    steps = ceiling["int8_steps"]
    assert list(steps) == ["vnni"] and steps["vnni"]["weights"] == ceiling["prefill_ops_per_token"] // 2
    seconds_per_token = ceiling["prefill_ops_per_token"] / steps["vnni"]["ops_per_s"]
    assert 1 / ceiling["prefill_tok_s_bound"] == pytest.approx(seconds_per_token)
    assert ceiling["int8_ops_per_s"] == pytest.approx(steps["vnni"]["ops_per_s"]) and ceiling["int8_ops_per_s"] > 1e9
    assert ceiling["tinyvllm"]["prefill_ops_per_s"] == ours["prefill"]["tok_s"] * ceiling["prefill_ops_per_token"]
