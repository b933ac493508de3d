"""The graders' harness: each test runs with its own task's function from the learner's folder installed in the
engine (tinyvllm/course.py) and the project's everywhere else; TINYVLLM_COURSE_SOLUTION=1 runs the project's own
code, the reference. TINYVLLM_HIDE_AFTER_PHASE=k hides the later phases' modules, as `make test-phase` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's tinyvllm, wherever pytest runs from
if os.environ.get("TINYVLLM_HIDE_AFTER_PHASE"):
    sys.path.insert(0, str(ROOT / "tests"))
    from phases import hide_after_phase

    hide_after_phase(int(os.environ["TINYVLLM_HIDE_AFTER_PHASE"]))

from tinyvllm.course import TASKS_BY_NAME, install, uninstall  # noqa: E402

SOLUTION = os.environ.get("TINYVLLM_COURSE_SOLUTION") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "task(name): the course task a grader test grades (tinyvllm/course.py)")


@pytest.fixture(autouse=True)
def learner_code(request):
    """The learner's function of this test's task, in the engine for the test's length; the project's with
    TINYVLLM_COURSE_SOLUTION=1. Yields a context manager that puts the project's back for a while (the oracle)."""
    marker = request.node.get_closest_marker("task")
    installed = None
    if marker is not None and not SOLUTION:
        installed = install([TASKS_BY_NAME[marker.args[0]]])

    @contextlib.contextmanager
    def project_code():
        nonlocal installed
        if installed is None:
            yield
            return
        uninstall(installed)
        try:
            yield
        finally:
            installed = install([TASKS_BY_NAME[marker.args[0]]])

    yield project_code
    if installed is not None:
        uninstall(installed)


@pytest.fixture(scope="session")
def tiny_model():
    """A LLaMA of two layers and random weights, small enough to run in a blink: (model, config)."""
    from tinyvllm.model.config import ModelConfig
    from tinyvllm.model.llama import LlamaForCausalLM
    from tinyvllm.model.weights import expected_shapes

    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False)
    rng = np.random.default_rng(0)
    state_dict = {name: ((1.0 + 0.1 * rng.standard_normal(shape)) if name.endswith("norm.weight")
                         else rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
                  for name, shape in expected_shapes(config).items()}
    return LlamaForCausalLM(config, state_dict), config


def tiny_model_logits(model, config, token_ids: list[int]) -> np.ndarray:
    """One prefill of `token_ids` on the contiguous cache: the logits at every position, (T, vocab)."""
    from tinygrad import Tensor

    from tinyvllm.attention.contiguous import ContiguousAttentionMetadata, allocate_contiguous_kv_cache

    kv_caches = allocate_contiguous_kv_cache(config, 32)
    T = len(token_ids)
    hidden = model(Tensor([token_ids]), Tensor([list(range(T))]), kv_caches, ContiguousAttentionMetadata(0))
    return model.compute_logits(hidden).numpy()[0]
