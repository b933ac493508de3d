"""The path a discrete GPU takes, run on this CPU-only machine (tinyvllm/platforms.py).

A GPU's memory is not the host's: no numpy views of device buffers, bytes go in by a copy, and captured steps
replay through tinygrad's own TinyJit (CUDA graphs), not the CPU graph runner. `TINYVLLM_DEVICE_PATH=discrete`
puts the CPU device on that path; here it is switched per test (`platforms.DEVICE_PATH`), and the engine must
give the CPU path's greedy tokens on it: the tiny model and the real one (the server:
tests/api/test_api_device_path.py).

Two crashes of the first GPU run are pinned on tinygrad's PYTHON device (its emulator of a GPU, which has no
`va_addr` to hand a CPU graph) and on the CPU: bytes copied into device memory (`copy_in` called
`Buffer.copyin`, which tinygrad 0.14 lacks), and a captured graph replayed on a device that is not the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tinyvllm import platforms
from tinyvllm.platforms import platform_for, resolve_dtype
from tinyvllm.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture()
def discrete(monkeypatch):
    """The CPU device on the discrete GPU's path for the length of a test."""
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")


# ---- the two crashes of the first GPU run ----

@pytest.mark.parametrize("device", ["CPU", "PYTHON"])
def test_copy_in_writes_device_memory(device):
    """Crash 1: weights, step inputs, draft model and perplexity all copy bytes in through `copy_in`."""
    from tinyvllm.tinygrad_ext.buffers import copy_in

    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.empty(3, 4, dtype=dtypes.float32, device=device)
    copy_in(t, memoryview(data).cast("B"))
    np.testing.assert_array_equal(t.numpy(), data)
    copy_in(t, memoryview(-data).cast("B"))  # again into the same buffer: what every step does
    np.testing.assert_array_equal(t.numpy(), -data)


def test_graphed_jit_replays_on_a_device_without_cpu_graph():
    """Crash 2: the model runner's, copy_blocks', the contiguous runner's and perplexity's captured graphs replay
    through GraphedJit, which must leave a device the table gives no CPU graph to tinygrad's TinyJit."""
    from tinyvllm.kernels.cpu_graph import GraphedJit

    def f(x: Tensor, w: Tensor) -> Tensor:
        return ((x * 2 + 1) @ w).realize()

    w_np = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = Tensor(w_np, device="PYTHON").realize()
    jit = GraphedJit(f)
    for step in range(4):  # capture, then replays with new input buffers
        x_np = np.full((2, 4), step, dtype=np.float32)
        np.testing.assert_allclose(jit(Tensor(x_np, device="PYTHON").realize(), w).numpy(), (x_np * 2 + 1) @ w_np)
    assert jit.graph is False and jit.captured is not None  # tinygrad's replay of its capture


# ---- the table ----

def test_the_table_decides_once_per_device(monkeypatch):
    cpu, cuda, metal = platform_for("CPU"), platform_for("CUDA:1"), platform_for("METAL")
    assert (cpu.path, cpu.host_views, cpu.cpu_graph, cpu.dtype, cpu.gpu_memory_utilization) == (
        "host", True, True, "float32", None)
    for gpu in (cuda, metal):
        assert (gpu.path, gpu.host_views, gpu.cpu_graph, gpu.dtype, gpu.gpu_memory_utilization) == (
            "discrete", False, False, "float16", 0.9)
    assert resolve_dtype("auto", "CUDA") == "float16" and resolve_dtype("auto", "CPU") == "float32"
    assert resolve_dtype("float32", "CUDA") == "float32"
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    forced = platform_for("CPU")
    assert (forced.path, forced.host_views, forced.cpu_graph) == ("discrete", False, False)
    assert (forced.dtype, forced.gpu_memory_utilization) == ("float32", None)  # the CPU's arithmetic and memory


# ---- the engine on the discrete path ----

def greedy_tokens(engine, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


def engine_path_facts(engine) -> dict:
    """What the engine's path looks like from inside: staged inputs, the device's kernels, KV zeros from a kernel,
    TinyJit replays."""
    runner = engine.model_runner
    buffers = [b for bs in runner._token_inputs.values() for b in bs] + list(runner._logits_indices.values())
    jits = list(runner._jits.values())
    programs = {getattr(call.src[0].arg, "name", "") for j in jits for call in j.captured.linear.src}
    return {"staged_inputs": all(b._staged for b in buffers) and bool(buffers),
            "device_kernels": all(any(p.startswith(k) for p in programs)  # the CPU's kernel table: its C kernels
                                  for k in ("paged_attention", "reshape_and_cache", "matmul")),
            "kv_zeros_mapped": engine.kv_cache.kv_caches[0][0].uop.buffer.options is not None,
            "cpu_graphs": any(j.graph not in (None, False) for j in jits),
            "replayed": all(j.captured is not None for j in jits)}


def test_tiny_model_on_the_discrete_path_gives_the_cpu_paths_tokens(tiny_model_dir, monkeypatch):
    from tinyvllm.llm import LLM

    args = dict(max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=4, max_num_batched_tokens=32)
    host = LLM(tiny_model_dir, **args)
    want = greedy_tokens(host, PROMPTS)
    # n=2 with a seed: two seeded completions, the second reading the prompt's blocks from the prefix cache
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2, ignore_eos=True)
    want_sampled = [o.token_ids for o in host.generate(PROMPTS[:1], sampled)[0].outputs]
    assert engine_path_facts(host.llm_engine) == {"staged_inputs": False, "device_kernels": True,
                                                  "kv_zeros_mapped": True, "cpu_graphs": True, "replayed": True}

    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    gpu = LLM(tiny_model_dir, **args)
    assert greedy_tokens(gpu, PROMPTS) == want
    assert [o.token_ids for o in gpu.generate(PROMPTS[:1], sampled)[0].outputs] == want_sampled
    assert engine_path_facts(gpu.llm_engine) == {"staged_inputs": True, "device_kernels": True,
                                                 "kv_zeros_mapped": False, "cpu_graphs": False, "replayed": True}


@pytest.mark.phase7  # the draft model of Phase 7b's speculative decoding
def test_draft_model_on_the_discrete_path(tiny_model_dir, discrete):
    """Speculative decoding's draft model (its own runner, cache, input buffers and sampler graphs) on the discrete
    path: greedy tokens are the target's alone (exact verification), here the CPU path's."""
    from tinyvllm.llm import LLM

    args = dict(max_model_len=128, kv_cache_memory="4MiB", max_num_seqs=4, max_num_batched_tokens=32)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(platforms, "DEVICE_PATH", "auto")
        want = greedy_tokens(LLM(tiny_model_dir, **args), PROMPTS[:1])
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    llm = LLM(tiny_model_dir, speculative_config=spec, **args)
    assert greedy_tokens(llm, PROMPTS[:1]) == want
    draft = llm.llm_engine.model_runner.speculator.proposer  # its own model (weights copied in) and runner
    assert engine_path_facts(llm.llm_engine)["staged_inputs"] and draft.runner._token_inputs
    assert all(b._staged for bs in draft.runner._token_inputs.values() for b in bs)
    assert all(b._staged for b in draft.runner._logits_indices.values())
    assert all(j.graph is False for j in draft.runner._jits.values())


@pytest.mark.phase6  # tinyvllm.perplexity is Phase 6's
def test_contiguous_runner_and_perplexity_on_the_discrete_path(tiny_model_dir, discrete):
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
    from tinyvllm.model.loader import load_model
    from tinyvllm.perplexity import ChunkScorer

    model, _, _ = load_model(tiny_model_dir)
    ids = list(range(100, 132))
    scorer = ChunkScorer(model, 32, tokens_per_step=8)
    scored = scorer(ids)  # positions 16..30 score tokens 17..31
    assert scorer._jit.graph is False and scorer._ids._staged
    runner = ContiguousModelRunner(model, max_model_len=64)
    logits = runner.prefill(ids[:20])
    for pos in range(20, 24):
        logits = runner.decode(ids[pos], pos)
    np.testing.assert_allclose(logits, scored[23 - 16], rtol=1e-3, atol=1e-3)  # position 23's row, two ways


@pytest.mark.slow
def test_real_model_on_the_discrete_path_gives_the_cpu_paths_tokens(generator, monkeypatch):
    """The shipped model, float32 weights (as `generator`): the same greedy tokens as the CPU path."""
    from tinyvllm.llm import LLM

    host = LLM(generator.model, tokenizer=generator.engine.tokenizer, max_model_len=512, kv_cache_memory="64MiB")
    want = greedy_tokens(host, PROMPTS, max_tokens=16)
    monkeypatch.setattr(platforms, "DEVICE_PATH", "discrete")
    gpu = LLM(max_model_len=512, kv_cache_memory="64MiB", quantization="none")
    assert gpu.llm_engine.model.device.startswith("CPU")
    assert greedy_tokens(gpu, PROMPTS, max_tokens=16) == want
    facts = engine_path_facts(gpu.llm_engine)
    assert facts["staged_inputs"] and facts["device_kernels"]
    assert not facts["cpu_graphs"] and not facts["kv_zeros_mapped"]


# ---- what a GPU sizes and picks by itself ----

def test_kv_cache_budget_from_a_gpus_free_memory(monkeypatch, caplog):
    from tinyvllm.attention import kv_cache
    from tinyvllm.attention.kv_cache import kv_cache_budget
    from tinyvllm.device_memory import free_device_memory

    gib = 2**30
    gpu_memory = (70 * gib, 80 * gib)  # (free, total)
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: None if device == "CPU" else gpu_memory)
    assert free_device_memory("CPU") is None  # the CPU device: no GPU memory to ask about
    # 0.9 of 80 GiB may be used, 10 GiB are in use (weights, tinygrad, other processes), 1 GiB of activations
    assert kv_cache_budget(None, None, "CUDA", activations=gib) == 61 * gib
    assert kv_cache_budget(None, 0.5, "CUDA") == 30 * gib
    assert kv_cache_budget("2GiB", 0.5, "CUDA") == 2 * gib  # given: kv_cache_memory wins, as vLLM's bytes flag
    with pytest.raises(ValueError, match="leaves no memory"):
        kv_cache_budget(None, 0.1, "CUDA")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_cache_budget(None, 1.5, "CUDA")
    assert kv_cache_budget(None, None, "CPU") == 512 * 2**20  # the CPU: a fixed budget
    # vLLM's CPU backend ignores the GPU's share: the fixed budget, said in a warning
    with caplog.at_level("WARNING", logger="tinyvllm.attention.kv_cache"):
        assert kv_cache_budget(None, 0.4, "CPU") == 512 * 2**20
    assert "cannot report" in caplog.text and "kv_cache_memory" in caplog.text


def test_dtype_auto_is_the_devices(tiny_model_dir):
    from tinygrad import dtypes as tg_dtypes

    from tinyvllm.model.loader import parse_dtype

    assert parse_dtype("auto", "CUDA") == tg_dtypes.float16 and parse_dtype("auto", "CPU") == tg_dtypes.float32
    assert parse_dtype("half") == tg_dtypes.float16 and parse_dtype("float") == tg_dtypes.float32  # vLLM's names
    with pytest.raises(ValueError, match="auto"):
        parse_dtype("bfloat8", "CPU")
