"""Phase 8's graders: the pipeline's layers per stage, tensor parallel's row order of a fused weight, and the
prefix-affinity router (course/phase8/). Numpy and Python: no device is opened (the CPU's names only)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.distributed import pipeline_parallel
from tinyvllm.distributed.pipeline_parallel import PipelineParallel
from tinyvllm.distributed.tensor_parallel import TensorParallel
from tinyvllm.model.config import ModelConfig
from tinyvllm.serve.router import PrefixAffinityRouter

# ---- split_layers ----


@pytest.mark.task("split_layers")
def test_layers_are_split_evenly_first_stages_first():
    got = pipeline_parallel.split_layers(10, 3)
    assert got == [range(0, 4), range(4, 7), range(7, 10)], f"10 layers over 3 stages: 4, 3, 3; got {got}"
    got = pipeline_parallel.split_layers(4, 4)
    assert got == [range(i, i + 1) for i in range(4)], f"4 layers over 4 stages: one each; got {got}"
    got = pipeline_parallel.split_layers(5, 1)
    assert got == [range(0, 5)], f"one stage holds every layer; got {got}"


@pytest.mark.task("split_layers")
def test_every_layer_has_one_device():
    pp = PipelineParallel(30, 4, "CPU")
    sizes = [len(stage) for stage in pp.stages]
    assert sizes == [8, 8, 7, 7], f"30 layers over 4 stages (SmolLM2's 30): 8, 8, 7, 7; got {sizes}"
    assert len(pp.layer_devices) == 30, (f"PipelineParallel gives each of the 30 layers a device: "
                                         f"{len(pp.layer_devices)}")


# ---- fused_rows ----

def tensor_parallel(size: int, kv_heads: int = 2) -> TensorParallel:
    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=2, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=32, tie_word_embeddings=False)
    return TensorParallel(config, size, "CPU")


@pytest.mark.task("fused_rows")
def test_qkv_rows_device_by_device():
    got = tensor_parallel(2).fused_rows([8, 4, 4], ["q", "k", "v"])
    expected = [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert got is not None and np.asarray(got).tolist() == expected, (
        f"2 devices, 4 query heads and 2 KV heads of 2 dims: q rows 0-7, k 8-11, v 12-15; device 0 takes q 0-3, "
        f"k 8-9, v 12-13, device 1 the rest:\nexpected {expected}\n"
        f"got      {None if got is None else np.asarray(got).tolist()}")


@pytest.mark.task("fused_rows")
def test_gate_up_rows_and_one_device():
    got = tensor_parallel(2).fused_rows([12, 12], ["gate", "up"])
    expected = [*range(0, 6), *range(12, 18), *range(6, 12), *range(18, 24)]
    assert got is not None and np.asarray(got).tolist() == expected, (
        f"gate_up (12 + 12 rows) over 2 devices: device 0 takes gate 0-5 and up 12-17:\nexpected {expected}\n"
        f"got      {None if got is None else np.asarray(got).tolist()}")
    assert tensor_parallel(1).fused_rows([8, 4, 4], ["q", "k", "v"]) is None, "one device: None (rows as they are)"


@pytest.mark.task("fused_rows")
def test_kv_heads_replicated_over_more_devices():
    got = tensor_parallel(4).fused_rows([8, 4, 4], ["q", "k", "v"])
    expected = [0, 1, 8, 9, 12, 13, 2, 3, 8, 9, 12, 13, 4, 5, 10, 11, 14, 15, 6, 7, 10, 11, 14, 15]
    assert got is not None and np.asarray(got).tolist() == expected, (
        f"4 devices, 2 KV heads: devices 0 and 1 both hold KV head 0 (part_rows('k') repeats it), 2 and 3 head 1:"
        f"\nexpected {expected}\ngot      {None if got is None else np.asarray(got).tolist()}")


# ---- route ----

PROMPT = "x" * 64 + "y" * 64  # two blocks of 64 characters


@pytest.mark.task("route")
def test_the_replica_holding_the_prefix_wins():
    router = PrefixAffinityRouter(3)
    router.started(2, PROMPT)
    router.started(1, "x" * 64 + "z" * 64)  # the first block only in common
    router.finished(2), router.finished(1)
    got = router.choose(PROMPT + "more")
    assert got == 2, f"replica 2 holds both blocks of the prompt's prefix, replica 1 one: choose 2, got {got}"
    got = router.choose("x" * 64 + "w" * 64)
    assert got in (1, 2), f"both hold the first block: one of them, got {got}"
    assert got == 1, "equal depth and equal load: the lower index"


@pytest.mark.task("route")
def test_no_match_goes_to_the_least_loaded_up():
    router = PrefixAffinityRouter(3)
    router.started(0, "a" * 64)
    router.started(0, "b" * 64)
    router.started(1, "c" * 64)
    got = router.choose("d" * 64)
    assert got == 2, f"no replica holds the prompt: the one with fewest in flight (2: none), got {got}"
    router.mark_down(2)
    got = router.choose("a" * 64)
    assert got == 0, f"replica 0 holds the prefix (2 in flight but the deepest match wins), got {got}"
    router.mark_down(0), router.mark_down(1)
    with pytest.raises(RuntimeError):
        router.choose("a" * 64)


@pytest.mark.task("route")
def test_round_robin_skips_the_replicas_down():
    router = PrefixAffinityRouter(3, policy="round_robin")
    router.mark_down(1)
    got = [router.choose("p") for _ in range(4)]
    assert got == [0, 2, 0, 2], f"round robin over 3 replicas with 1 down: 0, 2, 0, 2; got {got}"
    assert np.all(np.array(router.in_flight) == 0), "choose does not count a request in flight (started does)"
