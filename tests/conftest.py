"""Fixtures shared across phases: the real shipped model, a tiny random model, the HF oracle.

Loading and compiling a model is the slow part of the suite, so each is built once per session.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# Captured graphs (tinyvllm/kernels/graph_cache.py) are kept in a directory of this run's own: an engine that a later
# test builds with the same model and settings replays the graph an earlier one built (tracing a graph is most of a
# test's time), and nothing an earlier run kept on disk is read. A process given a directory keeps it: pytest-xdist's
# workers inherit the controller's, so they share it. TINYVLLM_GRAPH_CACHE=0 builds every graph in every engine.
if os.environ.get("TINYVLLM_GRAPH_CACHE") != "0" and not os.environ.get("TINYVLLM_GRAPH_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["TINYVLLM_GRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="tinyvllm-test-graphs-")
    atexit.register(shutil.rmtree, os.environ["TINYVLLM_GRAPH_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("TINYVLLM_TOKENIZER_CACHE", "0")  # tokenizers built as before (test_cold_start turns it on)
os.environ.setdefault("TINYVLLM_REPACK_CACHE", "0")  # weights repacked at every load (test_repack turns it on)
os.environ.setdefault("TINYVLLM_GGUF_HEADER_CACHE", "0")  # GGUF headers parsed as before (test_cold_start turns it on)

# the test files live in folders that mirror the package (tests/core/, tests/engine/, ...); the helpers beside this file
# (api_helpers, fake_engine, phases, ...) and the test files that other tests import (`from test_engine import engine`)
# are imported by plain name from any folder: tests/ and each of its folders go on sys.path (names are unique across
# the folders: tests/phases.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from phases import folders_of_tests, paths_of_test_files  # noqa: E402

sys.path[:0] = [str(folder) for folder in folders_of_tests() if str(folder) not in sys.path]

# TINYVLLM_HIDE_AFTER_PHASE=k (`make test-phase P=k`): the modules of Phases k+1.. cannot be imported, as if not built
# yet, and their test files are not collected (tests/phases.py)
if os.environ.get("TINYVLLM_HIDE_AFTER_PHASE"):
    from phases import PHASE_OF_TEST_FILE, hide_after_phase

    _hidden = hide_after_phase(int(os.environ["TINYVLLM_HIDE_AFTER_PHASE"]))
    collect_ignore = [str(path.relative_to(Path(__file__).resolve().parent))  # `core/test_scheduler.py`
                      for name, path in paths_of_test_files().items()
                      if PHASE_OF_TEST_FILE.get(name, 0) > _hidden.phase]

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.weights import default_model_path, expected_shapes
from tinyvllm.model.weights_hf import save_hf_weights

# a LLaMA small enough to compile and run in seconds, sharing SmolLM2's tokenizer (so vocab 49152)
TINY_CONFIG = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                          rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


def write_tiny_model(out_dir: Path, config: ModelConfig = TINY_CONFIG, seed: int = 0) -> Path:
    """An HF checkpoint directory with random weights and SmolLM2's tokenizer files."""
    from tinyvllm.convert import write_tokenizer

    rng = np.random.default_rng(seed)
    state_dict = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            state_dict[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            state_dict[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
    save_hf_weights(state_dict, out_dir)
    write_tokenizer(out_dir, GGUFFile(default_model_path()).metadata)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def idefics3_dir(tmp_path_factory) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture) written by HF transformers (tests/vision_models.py)."""
    pytest.importorskip("transformers")
    from vision_models import write_tiny_idefics3

    return write_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA-1.5 (CLIP ViT, projector, LLaMA) written by HF transformers (tests/llava_models.py)."""
    pytest.importorskip("transformers")
    from llava_models import write_tiny_llava

    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 vision-language model written by HF transformers (tests/gemma3_models.py)."""
    pytest.importorskip("transformers")
    from gemma3_models import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def generator():
    """The real default model behind a Generator (paged KV cache, the default since Phase 2), compiled once.

    Its weights are dequantized (quantization="none"): the float32 weights HF transformers runs as the oracle.
    The quantized path (the default, "auto") is checked against this one in tests/model/test_quantized_weights.py,
    and serves every test that starts its own engine or server."""
    from tinyvllm.engine.generator import Generator

    return Generator(max_model_len=512, kv_cache_memory="64MiB", quantization="none")


def torch_threads() -> int:
    """Threads for the HF oracle's torch: both cores in a serial run, one per worker when pytest-xdist runs
    the suite in two processes (two processes of two spinning threads each on two cores starve each other)."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(scope="session")
def hf_model(default_gguf, tmp_path_factory):
    """HF transformers' LlamaForCausalLM on the same GGUF (dequantized to float32): the oracle.

    transformers reads the GGUF itself (its own dequantization, not ours). Under pytest-xdist the first worker
    to get here saves what it read (config and tensors) in the run's shared temporary directory, and the other
    workers load that instead of dequantizing the GGUF again."""
    pytest.importorskip("transformers")
    import torch
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    def read_gguf():
        return AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                                    dtype=torch.float32).eval()

    torch.set_num_threads(torch_threads())
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return read_gguf()
    shared = tmp_path_factory.getbasetemp().parent / "hf-oracle.pt"  # one file for all workers of this run
    with FileLock(str(shared) + ".lock"):
        if shared.exists():  # transformers will not save a model it read from a GGUF: its config and tensors
            saved = torch.load(shared, weights_only=False)
            model = AutoModelForCausalLM.from_config(saved["config"], dtype=torch.float32)
            model.load_state_dict(saved["state"])
            return model.eval()
        model = read_gguf()
        torch.save({"config": model.config, "state": model.state_dict()}, shared)
        return model


def pytest_configure(config):
    for phase in range(1, 11):
        config.addinivalue_line("markers", f"phase{phase}: tests of Phase {phase} (tests/phases.py); "
                                           f"`make test-phase P={phase}` runs Phases 1-{phase}")


def pytest_collection_modifyitems(config, items):
    """Each test gets the marker of its file's phase (tests/phases.py); a tutorial's test, its chapter's phase."""
    from phases import PHASE_OF_TEST_FILE, phase_of_chapter_test

    for item in items:
        stem = Path(str(item.fspath)).stem
        phase = PHASE_OF_TEST_FILE.get(stem)
        callspec = getattr(item, "callspec", None)
        if stem == "test_docs" and callspec is not None and "doc" in callspec.params:
            phase = phase_of_chapter_test(callspec.params["doc"].name) or phase
        if phase is not None:
            item.add_marker(getattr(pytest.mark, f"phase{phase}"))
