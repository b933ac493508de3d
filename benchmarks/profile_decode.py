"""Where a decode step's time goes: every kernel of the captured step timed on its own, in the step's order.

    .venv/bin/python benchmarks/profile_decode.py                          # the shipped Q4_1 file, M = 1, 32, 64
    .venv/bin/python benchmarks/profile_decode.py --quantization none --batch 1

The engine captures each decode batch size as one graph (tinyvllm/kernels/cpu_graph.py: a table of calls that
kernels/cpu/graph_runner.c walks). Here the same table is walked one call at a time from Python, each call timed
(perf_counter_ns around a one-call graph_runner; the cost of an empty call, measured here, is subtracted), so every
kernel runs exactly as in a step (same buffers, same order, the weights coming from memory as they do) and its time
is its own. Kernels are grouped by program (the quantized matmuls by shape), summed over the step, best of
`--repeats` steps. Beside them: the whole graph in one call (what a step's kernels cost together) and
`LLMEngine.step()` (scheduling, inputs, sampling, outputs: what the step costs in Python). The machine's other
load is printed: on shared cores, compare rows of one run. Results: benchmarks/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import statistics
import time
from collections import defaultdict

import numpy as np
from common import BenchParser, code_version, load_average, log, machine_description, table, write_results

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels import cpu_graph
from tinyvllm.ggml_types import type_name
from tinyvllm.sampling_params import SamplingParams


def call_offsets(graph: cpu_graph.CPUGraph) -> list[int]:
    """Where each call starts in the table: [function address, n, n arguments] back to back."""
    offsets, at = [], 0
    for _ in range(graph.num_calls):
        offsets.append(at)
        at += 2 + int(graph.table[at + 1])
    return offsets


def kernel_label(name: str) -> str:
    """A program's name, as a results-file key: the quantized matmuls by shape and format (qmatmul_M1_N960_K576_Q4_1),
    the other kernels by their program name."""
    m = re.match(r"(qmatmul(?:_k)?)_(\d+)_(\d+)_(\d+)_(\d+)", name)
    return f"{m[1]}_M{m[2]}_N{m[3]}_K{m[4]}_{type_name(int(m[5]))}" if m else name.replace(".", "_")


def group_of(label: str, vocab_size: int) -> str:
    """lm_head (the matmul with the vocabulary's rows), the layers' quantized matmuls, attention, or the rest."""
    if label.startswith("qmatmul"):
        return "lm_head" if f"_N{vocab_size}_" in label else "qmatmul_layers"
    if label.startswith(("paged_attention", "reshape_and_cache")):
        return "attention"
    return "other"


class StepProfiler:
    """Replaces CPUGraph.__call__: when `armed`, walks the table call by call and adds each call's time."""

    def __init__(self):
        self.armed = False
        self.times: list[dict[str, float]] = []  # one dict per profiled step: label -> ns
        self.graph_ns: list[float] = []  # per step, its graphs each in one call
        self.empty_ns = 0.0
        original = cpu_graph.CPUGraph.__call__
        profiler = self

        def call(graph, input_uops, var_vals):
            original(graph, input_uops, var_vals)  # patches the table; runs the step once (the outputs)
            if not profiler.armed:
                return
            names = {p.addr: getattr(p, "name", hex(p.addr)) for p in graph._programs}
            run, base = graph._runner.fxn, graph.table.ctypes.data
            t = time.perf_counter_ns()
            run(ctypes.c_uint64(base), ctypes.c_uint64(graph.num_calls))
            profiler.graph_ns[-1] += time.perf_counter_ns() - t
            step = profiler.times[-1]  # a step may replay several graphs (the model's, the sampler's)
            for at in call_offsets(graph):
                t = time.perf_counter_ns()
                run(ctypes.c_uint64(base + 8 * at), ctypes.c_uint64(1))
                step[kernel_label(names.get(int(graph.table[at]), "?"))] += time.perf_counter_ns() - t - \
                    profiler.empty_ns

        cpu_graph.CPUGraph.__call__ = call

    def measure_empty_call(self) -> None:
        runner = cpu_graph._graph_runner()
        table = np.zeros(4, dtype=np.int64)
        samples = []
        for _ in range(2000):
            t = time.perf_counter_ns()
            runner.fxn(ctypes.c_uint64(table.ctypes.data), ctypes.c_uint64(0))
            samples.append(time.perf_counter_ns() - t)
        self.empty_ns = float(np.percentile(samples, 10))


def profile_batch(engine: LLMEngine, profiler: StepProfiler, batch: int, prompt_len: int, steps: int) -> dict:
    """`batch` requests decoding together; `steps` decode steps profiled after a few to warm up and capture."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    body = engine.tokenizer.encode("The history of the printing press begins in the fifteenth century. " * 8)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", (engine.tokenizer.encode(f"Request {i}:") + body)[:prompt_len], params)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):  # the decode bucket compiles, captures, replays
        engine.step()
    profiler.times, profiler.graph_ns = [], []
    step_ms = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()  # unprofiled: the step as the engine runs it
        step_ms.append(1e3 * (time.perf_counter() - t))
    profiler.armed = True
    for _ in range(steps):
        profiler.times.append(defaultdict(float))
        profiler.graph_ns.append(0.0)
        engine.step()
    profiler.armed = False
    while engine.has_unfinished_requests():
        engine.step()
    graphed = [i for i, ns in enumerate(profiler.graph_ns) if ns > 0]
    if not graphed:
        raise RuntimeError(f"no decode step of {batch} sequences replayed a captured graph (TINYVLLM_CPU_GRAPH=0?)")
    per_step = [profiler.times[i] for i in graphed]
    labels = set().union(*per_step)
    best = {k: min(t.get(k, 0.0) for t in per_step) / 1e6 for k in labels}  # ms, best of the steps
    groups: dict[str, float] = defaultdict(float)
    for k, v in best.items():
        groups[group_of(k, engine.model.config.vocab_size)] += v
    return {"batch": batch, "engine_step_ms_p50": statistics.median(step_ms), "groups_ms": dict(groups),
            "graph_one_call_ms_p50": statistics.median(profiler.graph_ns[i] for i in graphed) / 1e6,
            "steps_replaying_a_graph": f"{len(graphed)} of {steps}",
            "kernels_ms": dict(sorted(best.items(), key=lambda kv: -kv[1])),
            "kernels_sum_ms": sum(best.values())}


def rss_kib() -> dict[str, int]:
    """This process's resident memory from /proc/self/status (kB): anonymous and shared (its own allocations;
    tinygrad's CPU buffers are shared mappings) and file-backed (pages of mapped files, such as a memory-mapped GGUF,
    that it has touched: clean pages the kernel can drop and read again)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[name] = int(value.split()[0])
    return fields


def weight_memory(quantization: str) -> dict:
    """Resident weight memory against the GGUF's tensor bytes: the model loaded alone (no KV cache, no step), the
    process's resident memory before and after, and the bytes of the weights the model holds per format."""
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.loader import load_model
    from tinyvllm.model.quant import tensor_nbytes
    from tinyvllm.model.weights import default_model_path

    gguf = GGUFFile(default_model_path())
    tensor_bytes = sum(tensor_nbytes(t.ggml_type, t.shape) for t in gguf.tensors.values())
    before = rss_kib()
    model, _, _ = load_model(None, quantization=quantization)
    gc.collect()  # whatever loading dropped is gone before the second reading
    after = rss_kib()
    held = model.weight_formats()
    grown = {k: 1024 * (after[k] - before[k]) for k in after}
    private = grown["RssAnon"] + grown["RssShmem"]
    return {"gguf_tensor_bytes": tensor_bytes, "weight_bytes_by_format": held,
            "weight_bytes": sum(held.values()), "weights_over_gguf": sum(held.values()) / tensor_bytes,
            "rss_growth_bytes": grown, "rss_private_growth_bytes": private,
            "rss_private_growth_over_gguf": private / tensor_bytes,
            "rss_shmem_growth_over_gguf": grown["RssShmem"] / tensor_bytes}


def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default="auto", help="the engine's --quantization (default auto: the Q4_1 file)")
    p.add_argument("--batch", default="1,32,64", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--top", type=int, default=14, help="kernels listed per batch size")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    from tinyvllm.platforms import platform_for

    if not platform_for(None).cpu_graph:  # the timings come from inside the CPU graph's replay
        raise SystemExit("profile_decode times each kernel of the CPU graph runner, which this device does not use "
                         "(tinyvllm/platforms.py); on a GPU, benchmarks/bench_gpu.py records a step profile, and "
                         "tinygrad's DEBUG=2 JIT=0 prints every kernel's time")
    memory = weight_memory(args.quantization)
    engine = LLMEngine(None, quantization=args.quantization, max_num_seqs=max(batches), max_model_len=512,
                       max_num_batched_tokens=max(256, max(batches) * args.prompt_len))
    profiler = StepProfiler()
    profiler.measure_empty_call()
    load_before = load_average()
    rows = {}
    for b in batches:
        rows[str(b)] = profile_batch(engine, profiler, b, args.prompt_len, args.steps)
        log(f"batch {b}: step {rows[str(b)]['engine_step_ms_p50']:.2f} ms")
    print(f"profile_decode: {engine.model_name}, quantization {args.quantization}, {machine_description(False)}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; code {code_version()}; load average {load_before} -> {load_average()}")
    print(f"weights: {memory['weight_bytes'] / 1e6:.1f} MB held ("
          + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in memory["weight_bytes_by_format"].items())
          + f"), {memory['weights_over_gguf']:.3f}x the GGUF's {memory['gguf_tensor_bytes'] / 1e6:.1f} MB of tensors; "
          f"loading grew resident memory by {memory['rss_growth_bytes']['RssShmem'] / 1e6:.1f} MB of device buffers "
          f"(shared mappings: {memory['rss_shmem_growth_over_gguf']:.3f}x the tensors), "
          f"{memory['rss_growth_bytes']['RssAnon'] / 1e6:.1f} MB anonymous (the tokenizer, Python objects, modules "
          f"imported while loading) and {memory['rss_growth_bytes']['RssFile'] / 1e6:.1f} MB of mapped file pages")
    print(f"empty graph_runner call {profiler.empty_ns / 1e3:.1f} us (subtracted from each kernel)")
    for b, r in rows.items():
        print(f"\n== decode step, {b} sequences: LLMEngine.step() {r['engine_step_ms_p50']:.2f} ms, its graph in one "
              f"call {r['graph_one_call_ms_p50']:.2f} ms, kernels one by one {r['kernels_sum_ms']:.2f} ms ==")
        total = r["kernels_sum_ms"]
        print("by group: " + ", ".join(f"{g} {v:.2f} ms ({100 * v / total:.0f}%)" for g, v in r["groups_ms"].items()))
        items = list(r["kernels_ms"].items())
        shown = [[k, f"{v:.3f}", f"{100 * v / total:.1f}"] for k, v in items[:args.top]]
        rest = sum(v for _, v in items[args.top:])
        shown.append([f"({len(items) - args.top} other programs)", f"{rest:.3f}", f"{100 * rest / total:.1f}"])
        print(table(shown, ["program (summed over the step)", "ms", "%"]))
    write_results("profile_decode", {"model": engine.model_name, "quantization": args.quantization,
                                     "weight_memory": memory,
                                     "empty_call_us": profiler.empty_ns / 1e3, "batch": rows,
                                     "load_average": [load_before, load_average()]}, args)


if __name__ == "__main__":
    main()
