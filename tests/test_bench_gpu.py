"""The GPU benchmark (benchmarks/bench_gpu.py) runs end to end on the CPU with a tiny model, so that it cannot rot
before the next GPU run: tinyvllm through bench_throughput's run_engine (no one-by-one runs: `--one-by-one 0`), the
step profile, HF transformers as the same-run peer on the same device, the results file. And the ceiling's
bandwidth is measured on the device a run uses (benchmarks/bandwidth.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.phase6  # the benchmark times a step's phases with Phase 6's StepTimer
def test_bench_gpu_runs_on_the_cpu_with_a_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    import bench_gpu
    import common

    peers = ["--peers", "hf"] if _has_transformers() else []
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert bench_gpu.main(["--save", "--model", str(tiny_model_dir), "--concurrency", "1,2", "--prompt-len", "8",
                           "--output-len", "3", "--max-num-batched-tokens", "16", "--max-model-len", "64",
                           "--kv-cache-memory", "4MiB", "--configs", "auto", *peers]) == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())  # the CPU: no device suffix
    ours = results["tinyvllm"]["auto"]
    assert results["device"].startswith("CPU") and ours["dtype"] == "float32" and results["skipped"] == []
    assert "failed" not in results
    assert set(ours["concurrency"]) == {"1", "2"} and all(r["tok_s"] > 0 for r in ours["concurrency"].values())
    assert ours["single_stream_decode_tok_s"] > 0
    profile = ours["step_profile"]
    assert profile["batch"] == 2 and profile["decode_steps"] >= 1 and "forward" in profile["ms_per_step"]
    if peers:
        assert set(results["peers"]["hf"]["concurrency"]) == {"1", "2"} and set(ours["hf_ratio"]) == {"1", "2"}


def test_bandwidth_is_measured_on_the_runs_device():
    from bandwidth import measure_device_read_bandwidth

    read = measure_device_read_bandwidth("CPU", nbytes=1 << 22, repeats=2)  # what a GPU run measures, on the CPU
    assert read["bytes_per_s"][1] > 0 and read["buffer_bytes"] == 1 << 22 and "tinygrad" in read["method"]


def _has_transformers() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
