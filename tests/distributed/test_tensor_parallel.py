"""Phase 8: tensor parallel over several CPU devices gives the tokens and logits of one device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import TINY_CONFIG
from fake_engine import run_all
from tinygrad import Tensor, TinyJit, UOp

from tinyvllm.distributed.tensor_parallel import TensorParallel, check_tensor_parallel_size, shard_devices
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels import cpu_graph
from tinyvllm.kernels.cpu_graph import CPUGraph, GraphedJit
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.loader import load_model
from tinyvllm.sampling_params import SamplingParams

SMOLLM2 = dataclasses.replace(TINY_CONFIG, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                              head_dim=64)


def run(engine: LLMEngine, requests: dict) -> dict:
    """requests: {id: (prompt, params)} all at once -> {id: CompletionOutput}; every block back in the pool."""
    return {rid: out.outputs for rid, out in run_all(engine, requests, max_steps=2000).items()}


def assert_same(a: dict, b: dict, atol: float = 1e-4) -> None:
    """Same tokens, and the same logprobs (the chosen token's and the top ones') to `atol`."""
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid], b[rid]):
            assert x.token_ids == y.token_ids, rid
            for (lp_x, top_x), (lp_y, top_y) in zip(x.logprobs or [], y.logprobs or []):
                assert abs(lp_x - lp_y) <= atol, (rid, lp_x, lp_y)
                assert [t for t, _ in top_x] == [t for t, _ in top_y], rid
                np.testing.assert_allclose([v for _, v in top_x], [v for _, v in top_y], atol=atol)


def test_sizes_that_cannot_split_the_heads_are_refused():
    for ok in (1, 3, 9):
        check_tensor_parallel_size(SMOLLM2, ok)
    for bad in (2, 4, 6):
        with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads.*valid sizes: \[1, 3, 9\]"):
            check_tensor_parallel_size(SMOLLM2, bad)
    with pytest.raises(ValueError, match="integer >= 1"):
        check_tensor_parallel_size(SMOLLM2, 0)


def test_rows_of_each_device():
    """qkv_proj's rows, device by device: [q heads of the device | its KV heads' k | v]; with more devices than
    KV heads each device gets a replica of the KV head its query heads read."""
    tp = TensorParallel(TINY_CONFIG, 4, "CPU")  # 4 heads, 2 KV heads, head_dim 16: one head and one KV head each
    hd, q, kv = 16, 4 * 16, 2 * 16
    rows = tp.fused_rows([q, kv, kv], ["q", "k", "v"]).reshape(4, -1)
    for i in range(4):
        kv_head = i // 2  # query head i reads KV head i // (4 / 2)
        expected = np.concatenate([np.arange(i * hd, (i + 1) * hd), q + np.arange(kv_head * hd, (kv_head + 1) * hd),
                                   q + kv + np.arange(kv_head * hd, (kv_head + 1) * hd)])
        np.testing.assert_array_equal(rows[i], expected)
    assert tp.num_kv_heads == 4 and tp.devices == ("CPU", "CPU:1", "CPU:2", "CPU:3")


def mixed_requests(seed: int = 0) -> dict:
    """Greedy requests of several lengths (continuous batching, chunked prefill), two sharing a long prefix (prefix
    caching), one with n=2 (its second completion reads the prompt from the prefix cache), all with logprobs."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(100, 40000, size=36)]
    requests = {}
    for i, length in enumerate([3, 40, 21]):
        prompt = [int(t) for t in rng.integers(100, 40000, size=length)]
        requests[f"r{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    for i in range(2):
        requests[f"shared{i}"] = (shared + [500 + i], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                      logprobs=2))
    requests["n2"] = ([int(t) for t in rng.integers(100, 40000, size=20)],
                      SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True))
    return requests


@pytest.fixture(scope="module")
def tiny_models(tiny_model_dir):
    """The tiny model (4 heads, 2 KV heads) on one device and split over two, loaded once for the module."""
    return {tp: load_model(tiny_model_dir, tensor_parallel_size=tp) for tp in (1, 2)}


def engine_on(models, tp: int, **kwargs) -> LLMEngine:
    model, tokenizer, _ = models[tp]
    args = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=8,
                block_size=16) | kwargs
    return LLMEngine(model, tokenizer=tokenizer, **args)


def test_tp2_equals_tp1_under_continuous_batching(tiny_models):
    """One workload through both: a pool too small for every request at once (preemption by recompute), chunked
    prefills beside decodes, a cached shared prefix, a request forked into n=2."""
    requests = mixed_requests()
    results = []
    for tp in (1, 2):
        engine = engine_on(tiny_models, tp)
        preempted = []
        original = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, original=original: (preempted.append(seq.seq_id), original(seq))
        results.append(run(engine, requests))
        assert preempted, "the pool was meant to be too small for all requests at once"
        assert engine.scheduler.block_manager.enable_prefix_caching
    assert_same(*results)
    assert len(results[1]["n2"]) == 2


def test_tp2_equals_tp1_with_speculative_decoding(tiny_models):
    """n-gram drafts verified on two devices: the rows of the drafts' logits come back gathered like the others."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    requests = {"a": ([5, 6, 7, 8] * 3 + [5, 6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))}
    one = run(engine_on(tiny_models, 1, speculative_config=spec), requests)
    two = run(engine_on(tiny_models, 2, speculative_config=spec), requests)
    assert_same(one, two)


def test_kv_cache_split_by_head(tiny_models):
    """Each device holds its KV heads' slice of every block: the cache is split along its head axis."""
    engine = engine_on(tiny_models, 2)
    k_cache = engine.kv_cache.kv_caches[0][0]
    assert k_cache.device == ("CPU", "CPU:1") and k_cache.uop.axis == 2
    assert k_cache.shape[2] == TINY_CONFIG.num_key_value_heads


def test_quantized_tp2_matches_tp1(tiny_model_dir):
    """GGUF blocks split along whole rows (column-parallel) and between blocks (row-parallel). The int8
    activations of the quantized kernels round a row-parallel sum differently ordered over devices onto
    neighbouring codes now and then, so logits agree to the quantization's own error, not to 1e-4."""
    models = {tp: load_model(tiny_model_dir, quantization="q8_0", tensor_parallel_size=tp) for tp in (1, 2)}
    assert models[2][0].weight_formats().keys() >= {"Q8_0"}
    requests = {k: v for k, v in mixed_requests(1).items() if k in ("r0", "r2")}
    one, two = run(engine_on(models, 1, max_num_seqs=2), requests), run(engine_on(models, 2, max_num_seqs=2), requests)
    assert_same(one, two, atol=2e-2)


def test_tensor_parallel_size_error_names_the_heads(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split this model's 4 attention heads and 2 KV"):
        LLMEngine(tiny_model_dir, tensor_parallel_size=3)


@pytest.mark.slow
def test_real_model_tp3_equals_tp1(default_gguf):
    """SmolLM2-135M (9 heads, 3 KV heads) on three CPU devices: the same greedy tokens and logprobs as on one
    (float32 weights: the quantized kernels' int8 activations make logits agree only to their rounding)."""
    requests = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=8, logprobs=3))
                for i, p in enumerate(["The capital of France is", "def fibonacci(n):"])}
    outputs = []
    for tp in (1, 3):
        engine = LLMEngine(default_gguf, quantization="none", tensor_parallel_size=tp, kv_cache_memory="16MiB",
                           max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16)
        outputs.append(run(engine, requests))
    assert_same(*outputs)


ROWS = UOp.variable("tp_test_rows", 1, 8)


def split_step(x: Tensor, w: Tensor, scale: Tensor, rows) -> Tensor:
    """A tensor-parallel step in small: x (4, 8) on the first device copied to every device, a column-parallel
    matmul against w (4N, 8) split by rows, scaled by an input split the same way, a row-parallel matmul (an
    all-reduce: copies between devices and a sum), the sum of a symbolic number of rows, gathered onto the first
    device."""
    devices = w.device
    h = (x.to(devices) @ w.T).relu() * scale  # (4, 4N), column-parallel: device i holds 4 columns
    y = h @ w  # (4, 8), row-parallel: each device's partial sum, all-reduced
    return y[:rows].sum(0).to(devices[0]).realize()  # (8,) on the first device


@pytest.mark.parametrize("size", [2, 3])
def test_multi_device_step_replays_through_the_cpu_graph(size):
    """A step over several CPU devices (copies in, an all-reduce, a gather) replays as one C call through the
    CPUGraph's table (memmove entries for the copies), giving what tinygrad's own replay gives, with new input
    buffers (one on the first device, one split over the devices) and new variable values every call."""
    devices = shard_devices("CPU", size)
    rng = np.random.default_rng(size)
    w_np = rng.standard_normal((4 * size, 8)).astype(np.float32)
    w = Tensor(w_np).shard(devices, 0).realize()
    plain, graphed = TinyJit(split_step), GraphedJit(split_step)
    for step in range(5):
        x_np, scale_np = rng.standard_normal((4, 8)).astype(np.float32), rng.random(4 * size).astype(np.float32)
        rows = 1 + step % 4
        outs = [jit(Tensor(x_np).realize(), w, Tensor(scale_np).shard(devices, 0).realize(), ROWS.bind(rows)).numpy()
                for jit in (graphed, plain)]
        np.testing.assert_array_equal(outs[0], outs[1])
        want = ((np.maximum(x_np @ w_np.T, 0) * scale_np) @ w_np)[:rows].sum(0)
        np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4)
    assert isinstance(graphed.graph, CPUGraph), "the multi-device step fell back to tinygrad's per-kernel replay"
    assert graphed.graph.num_copies >= size  # x copied to the other devices, the partial sums, the gather
    assert {shard for _, shard in graphed.graph.input_keys} >= {-1, *range(size)}  # whole input and split input


def test_tp2_engine_replays_through_the_cpu_graph(tiny_models, monkeypatch):
    """The engine's step on two devices replays through the CPUGraph, and gives exactly what tinygrad's own
    replay gives (the CPU graph turned off)."""
    requests = {k: v for k, v in mixed_requests(3).items() if k in ("r0", "n2")}
    engine = engine_on(tiny_models, 2)
    graphed = run(engine, requests)
    replayed = [jit for jit in engine.model_runner._jits.values() if jit.graph is not None]  # built at a 2nd call
    assert len(replayed) >= 2 and all(isinstance(jit.graph, CPUGraph) and jit.graph.num_copies for jit in replayed)
    monkeypatch.setattr(cpu_graph, "ENABLED", False)
    engine = engine_on(tiny_models, 2)
    assert_same(graphed, run(engine, requests), atol=0)
    assert all(jit.graph is None for jit in engine.model_runner._jits.values())


def test_model_config_is_unchanged_by_the_split(tiny_models):
    model = tiny_models[2][0]
    assert isinstance(model.config, ModelConfig) and model.config == tiny_models[1][0].config
    assert model.device == "CPU" and model.devices == ("CPU", "CPU:1")
