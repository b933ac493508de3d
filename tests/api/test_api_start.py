"""Phase 9: a server whose engine fails to load exits non-zero with the reason, as vLLM's does (a supervisor such as
systemd or Kubernetes restarts or alerts on the exit); in-process, BackgroundServer raises the cause at once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("command", [[sys.executable, "-m", "tinyvllm.api.server"],
                                     [sys.executable, "-m", "tinyvllm.cli", "serve"]], ids=["api.server", "serve"])
def test_a_context_longer_than_the_model_exits_with_the_reason(command, tiny_model_dir):
    start = time.monotonic()
    done = subprocess.run([*command, "--model", str(tiny_model_dir), "--max-model-len", "18192", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "error: the engine failed to load" in done.stderr and "max_model_len" in done.stderr, done.stderr[-2000:]
    assert "18192" in done.stderr.splitlines()[-1]
    assert time.monotonic() - start < 120


def test_a_missing_model_exits_with_the_reason(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tinyvllm.api.server", "--model", str(tmp_path / "nothing.gguf"),
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "nothing.gguf" in done.stderr.splitlines()[-1], done.stderr[-2000:]


def test_background_server_raises_the_load_error_at_once():
    def factory():
        raise ValueError("max_model_len must be in [2, 8192], got 18192")

    app = build_app(AsyncLLMEngine(factory))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to load: max_model_len must be in"):
        BackgroundServer(app, timeout=600).start()
    assert time.monotonic() - start < 30
