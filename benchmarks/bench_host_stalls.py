"""Host stalls: per decode step, how long the host spends around the forward pass (seed roadmap 6.8 / 6.10).

    .venv/bin/python benchmarks/bench_host_stalls.py                         # 1, 32 and 64 concurrent
    .venv/bin/python benchmarks/bench_host_stalls.py --concurrency 1,8 --steps 20

For each concurrency N, N greedy requests (prompts of `--prompt-len` tokens, eos ignored) are added at once and the
engine steps until every one has its first token (the prefills, untimed); then a StepTimer
(tinyvllm/engine/step_timer.py) is set on the engine and `--steps` decode-only steps are timed, phase by phase:

    schedule         Scheduler.schedule(): who runs, how many tokens, blocks
    prepare_inputs   ModelRunner.execute_model up to the graph: input ids, positions, slot mapping, block tables
    forward          the captured graph (the model) and the device sampler, until the token ids are on the host
    bookkeeping      each row's sampling parameters, then Scheduler.update_from_output (append, stop checks)
    detokenize       token ids to text, stop strings, RequestOutputs

"host share" is everything but `forward` over the step. Two upper bounds follow from the phases (key
"upper_bounds"): async output processing can hide at most `detokenize` (the text, stop strings and outputs of
step N made while step N+1's forward pass runs), multi-step scheduling at most `schedule` + `prepare_inputs`
(one schedule for several decode steps; the inputs then only move by one position). Results go to
benchmarks/results/bench_host_stalls.json.

Async output processing was built as a prototype (LLMEngine(disable_async_output_proc=False): step N's outputs
made on a worker thread while step N+1's captured graph ran), checked against the synchronous step (same outputs,
same order) and measured by this script's `--async-output`: in one run, for each concurrency, rounds of decode
steps each way, alternating, on the same engine; the gain against the noise, the spread (max - min) of the
synchronous rounds' means over their mean. Its results are kept in
benchmarks/results/bench_host_stalls_async_output.json (the file names the commit that measured it). The rule
was to keep it only if its gain was above the noise at every concurrency; it was not (the noise was many times
the whole `detokenize` phase, its upper bound), so the engine code path and the option were removed again
(git log -- tinyvllm/engine/async_output.py finds both). Multi-step scheduling was not built: its bound,
above, is under 1% of a step at 1, 32 and 64 concurrent on this CPU.
"""

from __future__ import annotations

import argparse

from bench_throughput import buckets_used, make_prompts, warm_up  # (benchmarks/bench_throughput.py)
from common import (
    BenchParser, add_engine_args, code_version, load_average, log, machine_description, table, write_results)

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.step_timer import PHASES, StepTimer
from tinyvllm.sampling_params import SamplingParams


def measure(engine: LLMEngine, n: int, prompt_len: int, steps: int, first: int) -> dict:
    """Per-step milliseconds of each phase over `steps` decode steps of n requests."""
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(engine, n, prompt_len, first)):
        engine.add_request(f"stall-{n}-{i}", prompt, params)
    while any(state.num_output_tokens == 0 for state in engine.scheduler.requests.values()):
        engine.step()  # the prefills, untimed
    timer = StepTimer()
    engine.step_timer = timer
    for _ in range(steps):
        engine.step()
    engine.step_timer = None
    while engine.has_unfinished_requests():
        engine.step()
    phases = timer.per_step_ms()
    step_ms = sum(phases.values())
    host_ms = step_ms - phases.get("forward", 0.0)
    return {"concurrency": n, "steps": timer.num_steps, "phases_ms": {p: round(v, 3) for p, v in phases.items()},
            "step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3), "host_share": round(host_ms / step_ms, 4)}


def upper_bounds(r: dict) -> dict:
    """The share of a step each host-side fix could hide at most (see the module doc)."""
    phases, step = r["phases_ms"], r["step_ms"]
    return {"async_output_proc_ms": phases.get("detokenize", 0.0),
            "async_output_proc_share": round(phases.get("detokenize", 0.0) / step, 4),
            "multi_step_ms": round(phases.get("schedule", 0.0) + phases.get("prepare_inputs", 0.0), 3),
            "multi_step_share": round((phases.get("schedule", 0.0) + phases.get("prepare_inputs", 0.0)) / step, 4)}


def main() -> None:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,32,64", help="comma-separated numbers of requests at once")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per concurrency")
    add_engine_args(p, max_num_batched_tokens=512, kv_cache_memory="256MiB", max_model_len=1024)
    args = p.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if min(concurrency) < 1 or args.steps < 1 or args.prompt_len < 1:
        raise SystemExit("--concurrency, --steps and --prompt-len must be >= 1")

    engine = LLMEngine(args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                       max_num_seqs=max(concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
                       portable_attention=args.portable_attention, dtype=args.dtype)
    needed = set()
    for n in concurrency:
        needed |= set(buckets_used(engine, [args.prompt_len] * n, args.steps + 4))
    warm_up(engine, sorted(needed), log=log)

    rows, results = [], []
    for k, n in enumerate(concurrency):
        r = measure(engine, n, args.prompt_len, args.steps, first=1000 * (k + 1))
        results.append(r)
        rows.append((str(n), *(f"{r['phases_ms'].get(ph, 0.0):.2f}" for ph in PHASES), f"{r['step_ms']:.2f}",
                     f"{100 * r['host_share']:.1f}%", load_average()))
        log(f"{n} concurrent: {r['step_ms']:.2f} ms per step, host {100 * r['host_share']:.1f}%")
    print(f"# {machine_description()}\n# {code_version()}\n# ms per decode step, mean of {args.steps} steps")
    print(table(rows, ("concurrent", *PHASES, "step", "host share", "load")))
    bounds = {str(r["concurrency"]): upper_bounds(r) for r in results}
    print("\n# at most hidden, ms per step (share of the step)")
    print(table([(n, f"{b['async_output_proc_ms']:.2f} ({100 * b['async_output_proc_share']:.1f}%)",
                  f"{b['multi_step_ms']:.2f} ({100 * b['multi_step_share']:.1f}%)") for n, b in bounds.items()],
                ("concurrent", "async output processing", "multi-step scheduling")))
    write_results("bench_host_stalls", {"decode_steps": {str(r["concurrency"]): r for r in results},
                                        "upper_bounds": bounds}, args, also=args.json)


if __name__ == "__main__":
    main()
