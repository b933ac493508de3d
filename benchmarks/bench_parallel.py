"""Tensor and pipeline parallel on CPU devices: what splitting one model over N devices costs per step (Phase 8).

On one CPU, N tinygrad "devices" (CPU, CPU:1, ...) are the same cores: splitting a layer gives no speed-up, it only
adds the communication. So this measures the overhead, which a machine with N real devices pays too:

  step time    decode steps of `--concurrency` sequences, model split TP=N (or PP=N) against one device
  all-reduce   the row-parallel layers' all-reduce alone, 2 per layer, as one captured graph of (rows, hidden)
               partial sums summed over N devices: its time per step is the communication share of a TP step

    python benchmarks/bench_parallel.py --tp 3 --pp 3 --concurrency 1,32      -> benchmarks/results/bench_parallel.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import BenchParser, load_average, log, machine_description, table, write_results


def decode_step_ms(engine, concurrency: int, prompt_len: int, tokens: int) -> dict:
    """Mean wall time of the decode steps of `concurrency` requests (the prefill steps excluded), after a warm-up
    run that compiles the buckets. The engine's token budget takes every prompt in one step, so that every request
    decodes together from the second step on."""
    from tinyvllm.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def one_run(tag: str) -> list[float]:
        for i in range(concurrency):
            engine.add_request(f"{tag}{i}", [int(t) for t in rng.integers(100, 40000, size=prompt_len)], params)
        times = []
        while engine.has_unfinished_requests():
            # a decode step: every request has its first token already
            states = list(engine.scheduler.requests.values())
            decoding = len(states) == concurrency and all(st.output_token_ids for st in states)
            start = time.perf_counter()
            engine.step()
            if decoding:
                times.append(time.perf_counter() - start)
        return times

    one_run("warm")
    times = one_run("run")
    fig = {"decode_step_ms": round(1000 * float(np.mean(times)), 2), "steps": len(times),
           "tok_s": round(concurrency / float(np.mean(times)), 1)}
    # how the decode step replays: its graph's table (kernels/cpu_graph.py: one entry per kernel per device, and one
    # per copy between devices), built by this process or read back from the graph cache; False: tinygrad's replay
    runner = engine.model_runner
    n = runner.bucket_for(concurrency)
    jit = runner._jits[n, min(n, runner.bucket_for(runner.max_sampled_rows))]
    graph = jit.graph or (jit.loaded.graph if jit.loaded else None)
    fig["cpu_graph"] = {"entries": graph.num_calls, "copies": graph.num_copies} if graph else False
    return fig


def allreduce_ms(size: int, rows: int, hidden: int, per_step: int, repeats: int = 20) -> float:
    """Time of `per_step` all-reduces of (rows, hidden) float32 over `size` CPU devices, as the model does them
    (a (size*rows, hidden) tensor split by device, summed over the devices), in one captured graph replayed the
    way the engine replays its step (GraphedJit: one C call through a CPUGraph, copies as memmove entries)."""
    from tinygrad import Tensor

    from tinyvllm.distributed.tensor_parallel import shard_devices
    from tinyvllm.kernels.cpu_graph import CPUGraph, GraphedJit

    devices = shard_devices("CPU", size)
    parts = [Tensor.rand(size * rows, hidden).shard(devices, 0).realize() for _ in range(per_step)]

    def reduce_all():  # the parts are the graph's own buffers, as a step's partial sums are: no inputs to patch
        return Tensor.realize(*[x.reshape(size, rows, hidden).sum(0) for x in parts])
    reduce_all = GraphedJit(reduce_all)

    for _ in range(3):
        reduce_all()
    assert isinstance(reduce_all.graph, CPUGraph), "the all-reduces did not replay through the CPU graph"
    start = time.perf_counter()
    for _ in range(repeats):
        reduce_all()
    return round(1000 * (time.perf_counter() - start) / repeats, 3)


def main() -> None:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=3, help="tensor-parallel size to compare with one device (default 3)")
    p.add_argument("--pp", type=int, default=3, help="pipeline-parallel size to compare (0: skip; default 3)")
    p.add_argument("--concurrency", default="1,32", help="sequences decoding at once (default 1,32)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per request (default 24)")
    p.add_argument("--quantization", "-q", default="auto")
    p.add_argument("--model", default=None)
    args = p.parse_args()
    log(machine_description())

    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.model.loader import load_model

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    layouts = [("1 device", {}), (f"TP={args.tp}", {"tensor_parallel_size": args.tp})]
    if args.pp:
        layouts.append((f"PP={args.pp}", {"pipeline_parallel_size": args.pp}))
    figures: dict = {"steps": {}, "allreduce": {}}
    rows = []
    for name, split in layouts:
        model, tokenizer, _ = load_model(args.model, quantization=args.quantization, **split)
        config = model.config
        for c in concurrencies:
            engine = LLMEngine(model, tokenizer=tokenizer, max_num_seqs=max(concurrencies),
                               max_num_batched_tokens=max(concurrencies) * args.prompt_len, kv_cache_memory="128MiB",
                               max_model_len=args.prompt_len + args.tokens + 8)
            log(f"{name}, {c} concurrent (load average {load_average()})")
            figures["steps"].setdefault(name, {})[str(c)] = fig = decode_step_ms(engine, c, args.prompt_len,
                                                                                  args.tokens)
            rows.append((name, c, fig["decode_step_ms"], fig["tok_s"]))
        del model
    for c in concurrencies:  # the communication share: what TP adds per step
        ms = allreduce_ms(args.tp, c, config.hidden_size, 2 * config.num_hidden_layers)
        figures["allreduce"][str(c)] = {"ms_per_step": ms, "count_per_step": 2 * config.num_hidden_layers}
        one = figures["steps"]["1 device"][str(c)]["decode_step_ms"]
        tp = figures["steps"][f"TP={args.tp}"][str(c)]["decode_step_ms"]
        figures["steps"][f"TP={args.tp}"][str(c)]["ratio_to_one_device"] = round(tp / one, 2)
        figures["allreduce"][str(c)]["share_of_tp_step"] = round(ms / tp, 4)
        if args.pp:
            pp = figures["steps"][f"PP={args.pp}"][str(c)]["decode_step_ms"]
            figures["steps"][f"PP={args.pp}"][str(c)]["ratio_to_one_device"] = round(pp / one, 2)
    print(table(rows, ("layout", "concurrent", "decode step ms", "tok/s")))
    print(table([(c, v["ms_per_step"], v["share_of_tp_step"]) for c, v in figures["allreduce"].items()],
                ("concurrent", f"all-reduces ms/step (TP={args.tp})", "share of the TP step")))
    write_results("bench_parallel", figures, args)


if __name__ == "__main__":
    main()
