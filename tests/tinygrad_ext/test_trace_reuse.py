"""The decoder layers of a forward pass share one trace (tinyvllm/tinygrad_ext/speed.py `traces_reused`): a layer whose
arguments have an earlier layer's structure calls that layer's traced graph with its own weights and KV cache.
The logits must be exactly those of tracing every layer, and layers that differ (a sliding window on some) must not
share."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from conftest import TINY_CONFIG, write_tiny_model
from tinyvllm.tinygrad_ext import speed
from tinyvllm.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from tinyvllm.model.llama import LlamaDecoderLayer

PROMPT = [int(t) for t in np.random.default_rng(7).integers(100, 40000, size=24)]
FOUR_LAYERS = dataclasses.replace(TINY_CONFIG, num_hidden_layers=4)
WINDOWED = dataclasses.replace(FOUR_LAYERS, sliding_window=8,
                               layer_types=(SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION))


def traced_generation(model_dir, monkeypatch, reuse: bool) -> tuple[list, list, int]:
    """Greedy tokens and their logprobs for a prompt (a prefill graph, then decode graphs) on a new engine, and how
    many layer bodies were traced."""
    from tinyvllm.llm import LLM
    from tinyvllm.sampling_params import SamplingParams

    traced = []
    forward = LlamaDecoderLayer.forward
    with monkeypatch.context() as m:
        m.setattr(LlamaDecoderLayer, "forward", lambda self, *a: traced.append(self) or forward(self, *a))
        m.setattr("tinyvllm.worker.model_runner.persisted_graph", lambda *args: None)  # every graph traced here
        if not reuse:
            m.setattr("tinyvllm.model.llama.traces_reused", contextlib.nullcontext)
        llm = LLM(model_dir, max_model_len=128, max_num_seqs=2, kv_cache_memory="4MiB")
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2))
    return out[0].outputs[0].token_ids, out[0].outputs[0].logprobs, len(traced)


@pytest.mark.parametrize("config", [FOUR_LAYERS, WINDOWED], ids=["uniform", "sliding-every-other"])
def test_layers_share_a_trace_and_give_the_same_logits(tmp_path, monkeypatch, config):
    model_dir = write_tiny_model(tmp_path / "model", config)
    shared_tokens, shared_logprobs, shared_traces = traced_generation(model_dir, monkeypatch, reuse=True)
    own_tokens, own_logprobs, own_traces = traced_generation(model_dir, monkeypatch, reuse=False)
    assert shared_tokens == own_tokens and shared_logprobs == own_logprobs  # exactly: the same graph
    kinds = len(set(config.layer_types or [None]))  # layers that differ are traced apart
    passes, rest = divmod(own_traces, config.num_hidden_layers)  # every layer traced in every traced forward pass
    assert passes >= 1 and rest == 0
    assert shared_traces == passes * kinds
