"""The benchmarks' llama.cpp output parsers and results-file helpers, on recorded output: no llama.cpp needed."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from peers.llama_cpp import (  # noqa: E402
    LlamaCpp,
    median_run,
    parse_batched_bench,
    parse_bench_json,
    result_key,
)
from sampling_chains import CHAINS, llama_server_fields, parse_sampling, sampling_params  # noqa: E402

# llama-bench -p 32,128 -n 128 -r 2 -o json, trimmed to the fields the parser reads and a few others
BENCH_JSON = json.dumps([
    {"build_commit": "abc1234", "build_number": 1, "model_type": "llama ?B all F32", "model_size": 538066944,
     "n_params": 134515008, "n_threads": 2, "n_prompt": 32, "n_gen": 0, "n_depth": 0, "avg_ns": 30000000,
     "stddev_ns": 100000, "avg_ts": 1066.5, "stddev_ts": 3.5, "samples_ts": [1063.0, 1070.0]},
    {"build_commit": "abc1234", "build_number": 1, "model_type": "llama ?B all F32", "model_size": 538066944,
     "n_params": 134515008, "n_threads": 2, "n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ns": 120000000,
     "stddev_ns": 100000, "avg_ts": 1046.25, "stddev_ts": 2.0, "samples_ts": [1044.25, 1048.25]},
    {"build_commit": "abc1234", "build_number": 1, "model_type": "llama ?B all F32", "model_size": 538066944,
     "n_params": 134515008, "n_threads": 2, "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ns": 1180000000,
     "stddev_ns": 100000, "avg_ts": 108.2, "stddev_ts": 0.4, "samples_ts": [107.8, 108.6]},
])

# llama-batched-bench -npp 32 -ntg 128 -npl 1,32 (markdown table; log lines around it as the tool prints them)
BATCHED_MD = """
main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |    128 |    1 |    160 |    0.031 |  1032.26 |    1.190 |   107.56 |    1.221 |   131.04 |
|    32 |    128 |   32 |   5120 |    1.000 |  1024.00 |    7.192 |   569.52 |    8.192 |   625.00 |

llama_perf_context_print: load time = 120.00 ms
"""

BATCHED_JSONL = "\n".join(json.dumps(r) for r in [
    {"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1,
     "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 128, "pl": 1, "n_kv": 160, "t_pp": 0.031,
     "speed_pp": 1032.26, "t_tg": 1.19, "speed_tg": 107.56, "t": 1.221, "speed": 131.04},
    {"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1,
     "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 128, "pl": 32, "n_kv": 5120, "t_pp": 1.0,
     "speed_pp": 1024.0, "t_tg": 7.192, "speed_tg": 569.52, "t": 8.192, "speed": 625.0},
])


def test_parse_bench_json():
    out = parse_bench_json(BENCH_JSON)
    # the median of the repetitions; llama-bench's own mean and stddev kept beside it
    assert out["tg128_tok_s"] == pytest.approx(108.2) and out["tg128_stddev"] == 0.4
    assert out["pp32_tok_s"] == pytest.approx(1066.5) and out["pp128_tok_s"] == pytest.approx(1046.25)
    assert out["model_bytes"] == 538066944


def test_parse_bench_json_median_ignores_an_outlier():
    test = {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "model_size": 1, "avg_ts": 80.0, "stddev_ts": 40.0,
            "samples_ts": [100.0, 101.0, 20.0, 99.0, 80.0]}
    out = parse_bench_json(json.dumps([test]))
    assert out["tg128_tok_s"] == 99.0 and out["tg128_mean_tok_s"] == 80.0


@pytest.mark.parametrize("text", [BATCHED_MD, BATCHED_JSONL], ids=["markdown", "jsonl"])
def test_parse_batched_bench(text):
    rows = parse_batched_bench(text)
    assert sorted(rows) == [1, 32]
    # total tok/s as bench_throughput counts it: generated tokens over the whole time, prefill included
    assert rows[32]["tok_s"] == pytest.approx(32 * 128 / 8.192)
    assert rows[1]["tok_s"] == pytest.approx(128 / 1.221)
    assert rows[32]["generation_tok_s"] == pytest.approx(569.52) and rows[32]["prompt_len"] == 32


def test_median_run():
    runs = [{"tok_s": 300.0, "total_s": 1.0}, {"tok_s": 40.0, "total_s": 7.5}, {"tok_s": 320.0, "total_s": 0.9}]
    assert median_run(runs) == {"tok_s": 300.0, "total_s": 1.0, "runs_tok_s": [300.0, 40.0, 320.0]}
    assert median_run(runs[:2])["tok_s"] == 40.0  # an even count: the lower middle, never an average of runs


def test_result_key():
    assert [result_key(f) for f in ("F32", "Q8_0", "Q4_1")] == ["llama_cpp_f32", "llama_cpp_q8_0", "llama_cpp_q4_1"]


def test_find_names_the_build_command(tmp_path):
    with pytest.raises(SystemExit, match="build_llama_cpp.py"):
        LlamaCpp.find(tmp_path)


def test_write_results(tmp_path, monkeypatch):
    import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "saved")
    monkeypatch.setattr(common, "SCRATCH_DIR", tmp_path / "scratch")
    path = common.write_results("bench_x", {"decode": {"tok_s": 70.4}}, {"peers": None})
    assert path == tmp_path / "scratch" / "bench_x.json"  # without --save the tracked results stay as they are
    doc = json.loads(path.read_text())
    assert doc["bench"] == "bench_x" and doc["decode"] == {"tok_s": 70.4} and doc["options"] == {"peers": None}
    assert {"date", "commit", "machine", "load_average"} <= set(doc)
    saved = common.write_results("bench_x", {"decode": {"tok_s": 70.4}}, {"peers": None, "save": True})
    assert saved == tmp_path / "saved" / "bench_x.json"


def test_sampling_chains_are_the_same_for_both_engines():
    """The benchmarks' --sampling names: llama.cpp's default chain as users run it, greedy unseeded, and every
    filter a chain leaves out explicitly off for llama-server (whose own defaults are llama.cpp's chain)."""
    import argparse

    assert parse_sampling("greedy, llama") == ["greedy", "llama"]
    with pytest.raises(argparse.ArgumentTypeError, match="top_p"):
        parse_sampling("greedy,hot")
    llama = sampling_params("llama", seed=3, max_tokens=8)
    assert (llama.temperature, llama.top_k, llama.top_p, llama.min_p, llama.seed) == (0.8, 40, 0.95, 0.05, 3)
    assert sampling_params("greedy", seed=3).is_greedy and sampling_params("greedy", seed=3).seed is None
    assert llama_server_fields("temperature") == {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                           "repeat_penalty": 1.0}
    for chain, fields in CHAINS.items():  # tinyvllm accepts every chain
        assert sampling_params(chain).temperature == fields["temperature"]


def test_check_speed_flags_a_dropped_ratio_and_never_a_tok_s():
    from check_speed import compare

    before = {"auto: decode / llama.cpp": 1.5, "ngram k=7, edit_code: on / off": 1.3, "auto: decode tok/s": 180.0,
              "64 at once / one by one": 6.0}
    now = {"auto: decode / llama.cpp": 1.45, "ngram k=7, edit_code: on / off": 1.0, "auto: decode tok/s": 90.0,
           "64 at once / one by one": 6.1, "q8_0: decode / llama.cpp": 1.2}
    rows, dropped = compare(now, before, tolerance=0.10)
    assert dropped == ["ngram k=7, edit_code: on / off"], "only a ratio more than 10% down is a drop"
    by_name = {row[0]: row for row in rows}
    assert by_name["auto: decode tok/s"][-1] == "(for reference)"  # tok/s moves with the machine: never a drop
    assert by_name["q8_0: decode / llama.cpp"][1] == "-"  # new in this run: nothing to compare with


def test_first_output_is_timed_at_the_first_byte_not_the_exit():
    from common import first_output_s

    cmd = [sys.executable, "-c", "import sys, time; sys.stdout.write('x'); sys.stdout.flush(); time.sleep(1.5)"]
    assert first_output_s(cmd) < 1.5  # the process runs on for 1.5 s after its first byte
    with pytest.raises(RuntimeError, match="failed .3.:\n.*the reason"):
        first_output_s([sys.executable, "-c", "import sys; sys.stderr.write('the reason'); sys.exit(3)"])
