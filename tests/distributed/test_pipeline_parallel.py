"""Phase 8: pipeline parallel (consecutive layers on consecutive CPU devices) gives the tokens and logits of one."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import TINY_CONFIG, write_tiny_model
from test_tensor_parallel import assert_same, engine_on, mixed_requests, run
from tinyvllm.distributed.pipeline_parallel import PipelineParallel, split_layers
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels.cpu_graph import CPUGraph
from tinyvllm.model.loader import load_model
from tinyvllm.sampling_params import SamplingParams

THREE_LAYERS = dataclasses.replace(TINY_CONFIG, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                                   hidden_size=48)  # 3 heads: no tensor-parallel split but 3 devices, and any fits PP


def test_layers_split_into_consecutive_stages():
    assert split_layers(30, 3) == [range(0, 10), range(10, 20), range(20, 30)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    pp = PipelineParallel(3, 3, "CPU")
    assert pp.layer_devices == ["CPU", "CPU:1", "CPU:2"]
    for bad in (0, 4):
        with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an integer in \[1, 3\]"):
            PipelineParallel(3, bad, "CPU")


def test_pp2_equals_pp1_under_continuous_batching(tiny_model_dir):
    """Preemption, chunked prefill, a cached prefix and n=2 on two stages (the tiny model's two layers, one each)."""
    models = {1: load_model(tiny_model_dir), 2: load_model(tiny_model_dir, pipeline_parallel_size=2)}
    engine = engine_on(models, 2)
    assert [k.device for k, *_ in engine.kv_cache.kv_caches] == ["CPU", "CPU:1"]  # each layer's cache on its stage
    requests = mixed_requests(2)
    assert_same(run(engine_on(models, 1), requests), run(engine, requests))
    # the step, hidden state moved between stages included, replays as one C call (kernels/cpu_graph.py)
    replayed = [jit for jit in engine.model_runner._jits.values() if jit.graph is not None]
    assert replayed and all(isinstance(jit.graph, CPUGraph) and jit.graph.num_copies for jit in replayed)


def test_pp3_equals_pp1(tmp_path):
    """Three stages of one layer each, on a model of 3 attention heads (which no tensor-parallel size of 2 splits)."""
    path = write_tiny_model(tmp_path / "three", THREE_LAYERS, seed=3)
    models = {1: load_model(path), 3: load_model(path, pipeline_parallel_size=3)}
    requests = {f"r{i}": ([100 + 13 * i + j for j in range(5 + 9 * i)],
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
                for i in range(1, 2)}
    assert_same(run(engine_on(models, 1), requests), run(engine_on(models, 3), requests))


def test_tensor_and_pipeline_parallel_together_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="together are not supported"):
        LLMEngine(tiny_model_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
