"""The top-level helpers the engine is built from: its configuration tree (config.py), the persistent step inputs
(input_buffer.py), the captured graph a runner replays (jit.py) and the garbage collector at start (gc_utils.py)."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
from tinygrad import Tensor

from tinyvllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyvllm.input_buffer import InputBuffer
from tinyvllm.jit import tiny_jit


def test_each_part_of_the_config_checks_its_values_when_made():
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig(max_model_len=1)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    config = EngineConfig(ModelConfig(max_model_len=None), CacheConfig(), SchedulerConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config = CacheConfig()  # noqa: the tree is frozen: read everywhere, written nowhere


def test_the_sized_kv_cache_is_a_new_tree():
    config = EngineConfig(ModelConfig(), CacheConfig(block_size=8), SchedulerConfig())
    sized = config.with_kv_cache(num_blocks=100, max_model_len=640)
    assert (sized.max_model_len, sized.cache_config.num_gpu_blocks, sized.cache_config.block_size) == (640, 100, 8)
    assert (config.max_model_len, config.cache_config.num_gpu_blocks) == (None, None)  # the first tree unchanged
    assert sized.num_speculative_tokens == 0


def test_an_input_buffer_is_refilled_in_place():
    buf = InputBuffer((2, 3), np.int32, "CPU")
    first = buf.write([[1, 2, 3], [4, 5, 6]])
    assert first.tolist() == [[1, 2, 3], [4, 5, 6]]
    buf.np[1, :] = 7
    again = buf.copy_to_device()
    assert again is first  # the same device tensor every step
    assert again.tolist() == [[1, 2, 3], [7, 7, 7]]


def test_tiny_jit_replays_with_new_inputs():
    jit = tiny_jit(lambda x: (x * 2 + 1).realize())
    assert jit.ran_in_c is False
    for step in range(4):  # eager, captured, then replayed twice: each call with its own values
        x = Tensor(np.arange(4, dtype=np.float32) + step).realize()
        assert jit(x).tolist() == [2 * (i + step) + 1 for i in range(4)]


@pytest.mark.phase6  # the cold start's measurements (docs/phases/06-appendix-measurements.md)
def test_engine_start_pauses_collection_and_restores_it():
    from tinyvllm import gc_utils

    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with gc_utils.engine_start(freeze=False):
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), gc_utils.engine_start(freeze=False):
            raise RuntimeError("the build failed")
        assert gc.isenabled()  # restored even when the build raised
        gc.disable()
        with gc_utils.engine_start(freeze=False):
            pass
        assert not gc.isenabled()  # off before: off after
        frozen = gc.get_freeze_count()
        gc.enable()
        with gc_utils.engine_start(freeze=True):
            pass
        assert gc.get_freeze_count() >= frozen and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()
