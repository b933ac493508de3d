"""Offline throughput: N requests at once through LLMEngine, against the same requests run one by one.

    .venv/bin/python benchmarks/bench_throughput.py                          # 1, 4, 16, 32, 64 at once, 128 tokens each
    .venv/bin/python benchmarks/bench_throughput.py --concurrency 1,4,16,32 --output-len 64 --json out.json

Every request has the same prompt length (`--prompt-len` token ids cut from real text, a different
head per request), is greedy and ignores eos, so each produces exactly `--output-len` tokens. With
`--sampling` (default greedy,llama: llama.cpp's default chain, benchmarks/sampling_chains.py) each batch is
run again right after with each other chain, request i seeded i, reported as tok/s and a ratio to greedy. For each
concurrency N, N requests are added at once and the engine steps until all are done. Reported:

    total tok/s      N * output_len / wall time: what batching buys
    TTFT             arrival -> first token (RequestOutput.metrics): queueing + the prefill steps
    TPOT             (finished - first token) / (output_len - 1): one user's time per token
    decode step      median wall time of the steps that computed only decodes
    x 1-by-1         the time the same N requests take run one at a time, over the batched time. The
                     one-by-one time is extrapolated: `--one-by-one` requests (default 1) are run alone
                     before the first batch and after every batch, and N times the mean of the runs just
                     before and just after a batch stands for its N requests (running 64 requests of 128
                     tokens one by one would take about half an hour on two loaded cores). Interleaving
                     keeps each ratio to runs minutes apart, so a change of load falls on both sides.

Before the clock starts, every token bucket the runs will reach (found by stepping a scheduler of the
same shape with made-up tokens) is compiled and captured by TinyJit: two passes, the first compiles,
the second captures. The load average is printed with every row: on shared cores, compare the rows of
one run, not runs.

`--quantization` is the engine's flag (default none: float32 weights); several, comma-separated, run one engine after
the other in the same run, e.g. `-q auto,q8_0,none` for the shipped Q4_1 blocks, Q8_0 blocks and float32:

    .venv/bin/python benchmarks/bench_throughput.py --concurrency 1,32,64 -q auto,q8_0,none --peers ../peers-cache

With `--peers DIR`, llama.cpp's llama-batched-bench runs the same load in the same run after tinyvllm's: for each N,
N sequences of `--prompt-len` (random) tokens prefilled together, then `--output-len` decode steps of N tokens,
on F32, Q8_0 and the shipped Q4_1 weights; its total tok/s is counted as tinyvllm's (N * output_len / the whole
time, prefill included), and each format is set beside tinyvllm's of the same kind (auto: Q4_1, q8_0: Q8_0, none:
F32). Results go to benchmarks/results/bench_throughput.json for `-q none` alone, else bench_throughput_quantized.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import (  # (benchmarks/common.py)
    BenchParser,
    add_engine_args,
    add_peers_arg,
    code_version,
    find_peers,
    load_average,
    log,
    machine_description,
    table,
    write_results,
)
from sampling_chains import add_sampling_arg, sampling_params  # (benchmarks/sampling_chains.py)

from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.core.sequence import Sequence
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.quantization import check_quantization
from tinyvllm.sampling_params import SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made books cheap "
        "enough for ordinary readers. Within fifty years printers worked in more than two hundred cities, and the "
        "ideas of scholars, merchants and reformers travelled faster than any rider could carry them. ")


def make_prompts(engine: LLMEngine, n: int, prompt_len: int, first: int = 0) -> list[list[int]]:
    """n prompts of exactly prompt_len token ids: 'Request i:' (i from `first`) then the text, cut to length.
    Prompts of different i differ in their first block, so prefix caching finds nothing to reuse among them."""
    body = engine.tokenizer.encode(TEXT * (prompt_len // 20 + 1))
    return [(engine.tokenizer.encode(f"Request {i}:") + body)[:prompt_len] for i in range(first, first + n)]


def buckets_used(engine: LLMEngine, prompt_lens: list[int], output_len: int) -> list[int]:
    """The token buckets a batch of these requests will step through, found by running a scheduler of the same
    shape with made-up tokens: scheduling is deterministic when every request ignores eos and has max_tokens."""
    s = engine.scheduler
    scheduler = Scheduler(s.block_manager.num_blocks, s.block_manager.block_size, s.max_model_len, s.max_num_seqs,
                          s.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, n in enumerate(prompt_lens):
        scheduler.add_seq(Sequence(i, [0] * n, params))
    used = set()
    while scheduler.has_unfinished_seqs():
        out = scheduler.schedule()
        used.add(engine.model_runner.bucket_for(out.total_num_scheduled_tokens))
        scheduler.update_from_output(out, ModelRunnerOutput({seq.seq_id: [0] for seq in out.scheduled_seqs}))
    return sorted(used)


def warm_up(engine: LLMEngine, buckets: list[int] | None = None, log=print) -> None:
    """Compile and capture token buckets (default: all): one request of exactly b prompt tokens makes a step of b
    tokens. Each bucket needs two calls (the first compiles and runs, the second is captured); later calls replay."""
    buckets = engine.model_runner.token_buckets if buckets is None else buckets
    assert buckets[-1] < engine.max_model_len, "a warm-up prompt must fit in max_model_len"
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for attempt in range(2):
        for k, b in enumerate(buckets):
            # a first token of its own per prompt: prefix caching would otherwise serve the second pass (and a
            # longer bucket's first blocks) from the cache, and the bucket would never be captured
            prompt = [2000 + attempt * len(buckets) + k] + [100 + i % 1000 for i in range(b - 1)]
            engine.add_request(f"warmup-{attempt}-{b}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        log(f"warm-up pass {attempt + 1}/2 over buckets {buckets}: {time.perf_counter() - start:.0f} s")


class StepRecorder:
    """Wraps the scheduler's schedule() to see each step's batch (benchmark instrumentation, no engine change)."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[tuple[int, int, bool]] = []  # (sequences, tokens, decodes only)
        self.preemptions = 0
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule():
            out = schedule()
            decodes_only = all(out.num_scheduled_tokens[s.seq_id] == 1 and not s.is_prefill
                               for s in out.scheduled_seqs)
            self.steps.append((len(out.scheduled_seqs), out.total_num_scheduled_tokens, decodes_only))
            self.preemptions += len(out.preempted_seqs)
            return out

        scheduler.schedule = recording_schedule

    def reset(self) -> None:
        self.steps, self.preemptions = [], 0


def run_batch(engine: LLMEngine, recorder: StepRecorder, prompts: list[list[int]], output_len: int,
              tag: str, chain: str = "greedy") -> dict:
    """Add every prompt at once, step until all finish; timings of the whole batch and of each request. `chain`:
    how every request samples (benchmarks/sampling_chains.py), request i with seed i."""
    recorder.reset()
    load_before = load_average()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, sampling_params(chain, seed=i, max_tokens=output_len,
                                                                  ignore_eos=True))
    finished, step_times = {}, []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - t)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in finished.values()), "a request ended early"
    ttft = [o.metrics.time_to_first_token for o in finished.values()]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / max(1, output_len - 1)
            for o in finished.values()]
    decode_steps = [dt for dt, (_, _, decodes_only) in zip(step_times, recorder.steps) if decodes_only]
    return {"requests": len(prompts), "wall_s": wall, "output_tokens": len(prompts) * output_len,
            "tok_s": len(prompts) * output_len / wall, "steps": len(step_times),
            "mean_seqs_per_step": statistics.mean(s for s, _, _ in recorder.steps),
            "preemptions": recorder.preemptions,
            "ttft_ms": {"p50": 1e3 * statistics.median(ttft), "max": 1e3 * max(ttft)},
            "tpot_ms": {"p50": 1e3 * statistics.median(tpot), "max": 1e3 * max(tpot)},
            "decode_step_ms": 1e3 * statistics.median(decode_steps) if decode_steps else None,
            "load_average": [load_before, load_average()]}




def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated numbers of requests at once")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--one-by-one", type=int, default=1,
                   help="requests run alone before the first and after each batched run")
    p.add_argument("--quantization", "-q", default="none",
                   help="the engine's --quantization, or several comma-separated (e.g. auto,q8_0,none: one engine "
                        "after the other in this run). Results: results/bench_throughput.json for none alone, "
                        "results/bench_throughput_quantized.json otherwise")
    add_engine_args(p, max_num_batched_tokens=1024, kv_cache_memory="1GiB", max_model_len=2048)
    add_peers_arg(p)
    add_sampling_arg(p, default="greedy,llama")
    p.add_argument("--peer-repeats", type=int, default=3,
                   help="runs of llama-batched-bench per weight format with --peers; the median counts (default 3)")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = [m.strip() for m in args.quantization.split(",") if m.strip()]
    for m in methods:
        check_quantization(m)
    llama = find_peers(args)  # fails here, not after minutes of measuring, if llama.cpp is not built

    by_method, model_name = {}, None
    for method in methods:
        model_name, by_method[method] = run_engine(args, levels, method)
    for method, (rows, alone, info) in by_method.items():
        print(f"bench_throughput: {model_name}, quantization {method} ({info['weights']}), "
              f"{machine_description(False)}, {time.strftime('%Y-%m-%d %H:%M')}")
        print(f"code: {code_version()}; attention: {'portable gather' if args.portable_attention else 'kernels'}")
        print(f"prompt {args.prompt_len} tokens, output {args.output_len} tokens, greedy (and "
              f"{', '.join(args.sampling)} below), ignore_eos; "
              f"max_num_batched_tokens {info['max_num_batched_tokens']}, max_num_seqs {info['max_num_seqs']}, "
              f"{info['num_blocks']} blocks of {info['block_size']}")
        header = (f"{'N':>3} {'total tok/s':>11} {'x 1-by-1':>8} {'wall s':>7} {'1-by-1 s':>8} {'steps':>5} "
                  f"{'TTFT p50/max ms':>16} {'TPOT p50/max ms':>16} {'decode step':>11} {'preempt':>7}  load avg after")
        print(header)
        print("-" * len(header))
        for n, r in rows.items():
            step_ms = "-" if r["decode_step_ms"] is None else f"{r['decode_step_ms']:.0f} ms"
            speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
            alone_s = "-" if r["one_by_one_s"] is None else f"{r['one_by_one_s']:.1f}"
            print(f"{n:>3} {r['tok_s']:>11.1f} {speedup:>8} {r['wall_s']:>7.1f} {alone_s:>8} "
                  f"{r['steps']:>5} {r['ttft_ms']['p50']:>8.0f}/{r['ttft_ms']['max']:<7.0f} "
                  f"{r['tpot_ms']['p50']:>8.1f}/{r['tpot_ms']['max']:<7.1f} {step_ms:>11} {r['preemptions']:>7}  "
                  f"{r['load_average'][1]}")
        for n, r in rows.items():
            if r["sampling"]:
                print(f"{n:>3} sampled: " + ", ".join(f"{chain} {s['tok_s']:.1f} tok/s ({s['ratio_to_greedy']:.2f}x "
                                                     f"greedy)" for chain, s in r["sampling"].items()))
        print(f"1-by-1 s: N x the mean time of one request run alone ({args.one_by_one} run just before and "
              f"{args.one_by_one} just after this row's batch):")
        print("  extrapolated, not run N times. x 1-by-1 = that / wall s. "
              "TPOT = (last token - first) / (tokens - 1).\n")
    first_rows, first_alone, first_info = by_method[methods[0]]
    figures = {"model": model_name, "portable_attention": args.portable_attention,
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "max_num_batched_tokens": first_info["max_num_batched_tokens"],
               "one_by_one_requests_per_run": args.one_by_one, "one_by_one_s_per_request": first_alone,
               "concurrency": {str(n): r for n, r in first_rows.items()}}
    if len(methods) > 1 or methods != ["none"]:
        figures["quantization"] = {m: {"weights": info["weights"], "one_by_one_s_per_request": alone,
                                       "concurrency": {str(n): r for n, r in rows.items()}}
                                   for m, (rows, alone, info) in by_method.items()}
    if llama is not None and args.model is None:  # llama.cpp's model files are the default model's
        figures["peers"] = measure_peers(llama, {m: rows for m, (rows, _, _) in by_method.items()},
                                         args.prompt_len, args.output_len, args.peer_repeats)
    elif llama is not None:
        print("--peers: llama.cpp runs the default model only; no peer figure for --model")
    write_results("bench_throughput" if methods == ["none"] else "bench_throughput_quantized", figures, args,
                  also=args.json)


def profile_decode_steps(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Where one decode step's time goes at this batch size: the prompts run as a batch with a StepTimer on the
    engine (engine/step_timer.py; it waits for the device before each reading), counted from the first step after
    every request has its first token. Returns mean ms per step by phase, their total and the number of steps."""
    from tinyvllm.engine.step_timer import StepTimer

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    timer, started, decoding = StepTimer(), set(), False
    engine.step_timer = timer
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids:
                    started.add(out.request_id)
            if not decoding and len(started) == len(prompts):  # every prompt is in: decode steps from here on
                timer.reset()
                decoding = True
    finally:
        engine.step_timer = None
    phases = timer.per_step_ms()
    return {"batch": len(prompts), "decode_steps": timer.num_steps, "ms_per_step": phases,
            "total_ms": sum(phases.values())}


def run_engine(args: argparse.Namespace, levels: list[int], method: str,
               profile: bool = False) -> tuple[str, tuple[dict, list, dict]]:
    """One engine with --quantization `method`: every concurrency level, with the one-by-one runs between them.
    Returns (model name, (rows by N, one-by-one seconds per request, the engine's settings)); `profile`: the
    settings also hold `step_profile`, a decode step's phases at the largest N (`profile_decode_steps`)."""
    engine = LLMEngine(args.model, max_model_len=args.max_model_len, max_num_seqs=max(levels),
                       max_num_batched_tokens=max(args.max_num_batched_tokens, max(levels)),
                       kv_cache_memory=args.kv_cache_memory, quantization=method, dtype=args.dtype)
    # the runner's own switch (ModelRunner(portable_attention=...)); read when a bucket's graph is first built
    engine.model_runner.portable_attention = args.portable_attention
    bm = engine.scheduler.block_manager
    needed = max(levels) * -(-(args.prompt_len + args.output_len) // bm.block_size)
    if needed > bm.num_blocks:
        log(f"note: {max(levels)} requests need {needed} blocks, the pool has {bm.num_blocks}: expect preemptions")
    warm = buckets_used(engine, [args.prompt_len] * max(levels), args.output_len)
    for n in levels[:-1]:
        warm = sorted(set(warm) | set(buckets_used(engine, [args.prompt_len] * n, args.output_len)))
    warm_up(engine, warm, log)
    recorder = StepRecorder(engine)

    used = 0

    def fresh_prompts(n: int) -> list[list[int]]:
        """Prompts no earlier run has seen: with prefix caching on, a repeated prompt would skip its prefill."""
        nonlocal used
        used += n
        return make_prompts(engine, n, args.prompt_len, first=used - n)

    def one_by_one(k: int) -> list[float]:
        """Seconds per request of `--one-by-one` requests, each run alone, one after the other."""
        return [run_batch(engine, recorder, fresh_prompts(1), args.output_len, f"alone{k}-{j}")["wall_s"]
                for j in range(args.one_by_one)]

    sampled = [c for c in args.sampling if c != "greedy"]
    for n in levels:  # each sampled chain's sampler graph at each N, compiled before any clock starts
        for chain in sampled:
            run_batch(engine, recorder, fresh_prompts(n), 2, f"warm{n}-{chain}", chain)
    # the one-by-one runs go between the batched ones, so that each ratio compares runs minutes apart, not more;
    # --one-by-one 0: none, and no ratio
    alone = [one_by_one(0)]
    rows = {}
    for i, n in enumerate(levels):
        rows[n] = run_batch(engine, recorder, fresh_prompts(n), args.output_len, f"c{n}")
        rows[n]["sampling"] = {}  # the same N with each other chain, right after greedy (same load)
        for chain in sampled:
            r = run_batch(engine, recorder, fresh_prompts(n), args.output_len, f"c{n}-{chain}", chain)
            rows[n]["sampling"][chain] = {"tok_s": r["tok_s"], "ratio_to_greedy": r["tok_s"] / rows[n]["tok_s"],
                                          "wall_s": r["wall_s"], "decode_step_ms": r["decode_step_ms"],
                                          "load_average": r["load_average"]}
            log(f"{method}, concurrency {n}, {chain}: {r['tok_s']:.1f} tok/s "
                f"({rows[n]['sampling'][chain]['ratio_to_greedy']:.2f}x greedy)")
        alone.append(one_by_one(i + 1))
        around = alone[i] + alone[i + 1]
        sec_per_request = statistics.mean(around) if around else None
        rows[n]["alone_s_per_request"] = sec_per_request
        rows[n]["one_by_one_s"] = None if sec_per_request is None else n * sec_per_request
        rows[n]["speedup"] = None if sec_per_request is None else n * sec_per_request / rows[n]["wall_s"]
        alone_text = "" if sec_per_request is None else f", one request alone {sec_per_request:.1f} s"
        log(f"{method}, concurrency {n}: {rows[n]['tok_s']:.1f} tok/s in {rows[n]['wall_s']:.1f} s{alone_text}, "
            f"load average {rows[n]['load_average'][1]}")
    profiled = profile_decode_steps(engine, fresh_prompts(max(levels)), args.output_len) if profile else None
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    formats = engine.model.weight_formats()
    info = {"weights": ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in formats.items()),
            "dtype": {2: "float16", 4: "float32"}[engine.model.dtype.itemsize], "device": engine.model.device,
            "step_profile": profiled,
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
            "max_num_seqs": engine.scheduler.max_num_seqs, "num_blocks": bm.num_blocks, "block_size": bm.block_size}
    return engine.model_name, (rows, alone, info)


def measure_peers(llama, by_method: dict[str, dict[int, dict]], prompt_len: int, output_len: int,
                  repeats: int) -> dict:
    """llama-batched-bench on each weight format at the same N, prompt and output lengths, `repeats` times (the
    formats taking turns, so a burst of other load falls on one run, not on one format), the median run of each
    row; printed beside tinyvllm's total tok/s for each --quantization measured. Ratios: tinyvllm over llama.cpp,
    the first method's against every format ("tinyvllm_ratio", as before), and each method against its own format
    ("same_format_ratio"). Returns {"llama_cpp_f32": {"concurrency": {"32": {"tok_s": ..}}}}."""
    from peers.llama_cpp import FORMATS, SAME_FORMAT, median_run, result_key  # benchmarks/peers/

    methods = list(by_method)
    levels = list(by_method[methods[0]])
    runs: dict[str, dict[int, list[dict]]] = {fmt: {n: [] for n in levels} for fmt in FORMATS}
    for i in range(repeats):
        for fmt in FORMATS:
            log(f"llama.cpp {fmt} ({i + 1}/{repeats}): llama-batched-bench -npp {prompt_len} -ntg {output_len} "
                f"-npl {','.join(map(str, levels))}")
            for n, r in llama.batched_bench(fmt, prompt_len, output_len, levels).items():
                runs[fmt][n].append(r)
    peers = {}
    for fmt in FORMATS:
        theirs = {n: median_run(runs[fmt][n]) for n in levels}
        for n, r in theirs.items():
            r["tinyvllm_ratio"] = by_method[methods[0]][n]["tok_s"] / r["tok_s"]
            for m in methods:
                if SAME_FORMAT.get(m) == fmt:
                    r["same_format_ratio"] = by_method[m][n]["tok_s"] / r["tok_s"]
                    r["same_format_method"] = m
        peers[result_key(fmt)] = {"threads": llama.threads, "repeats": repeats,
                                  "concurrency": {str(n): r for n, r in theirs.items()}}
    table_rows = []
    for n in levels:
        row = [n] + [f"{by_method[m][n]['tok_s']:.1f}" for m in methods]
        for fmt in FORMATS:
            r = peers[result_key(fmt)]["concurrency"][str(n)]
            row += [f"{r['tok_s']:.1f}", f"{r.get('same_format_ratio', r['tinyvllm_ratio']):.2f}"]
        table_rows.append(row)
    headers = ("N", *(f"tinyvllm {m}" for m in methods),
               *(cell for fmt in FORMATS for cell in (f"llama.cpp {fmt}", "ratio")))
    print(f"\n== total tok/s, tinyvllm and llama.cpp (llama-batched-bench, {llama.threads} threads), this run: N "
          f"requests of {prompt_len} prompt tokens, {output_len} generated each ==")
    print(table(table_rows, headers))
    same = ", ".join(f"{fmt}: tinyvllm {next((m for m in methods if SAME_FORMAT.get(m) == fmt), methods[0])}"
                     for fmt in FORMATS)
    print(f"ratio = tinyvllm / llama.cpp, each format against its own ({same}). total tok/s = N x output tokens / "
          f"the whole time, prefill included, for both engines; llama.cpp: the median of {repeats} runs, tinyvllm: "
          f"one run.")
    return peers


if __name__ == "__main__":
    main()
