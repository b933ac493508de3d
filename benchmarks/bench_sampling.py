"""Sampled decoding against greedy, in one run: what users send costs what greedy costs?

    .venv/bin/python benchmarks/bench_sampling.py                              # N = 1 and 32, every chain
    .venv/bin/python benchmarks/bench_sampling.py --concurrency 1,32,64 --peers ../peers-cache

For each N, N requests (bench_throughput's prompts and `run_batch`: `--prompt-len` prompt tokens, `--output-len`
generated, ignore_eos) run with each sampling chain of `--sampling` (benchmarks/sampling_chains.py) in turn, and
the turns repeat `--repeats` times: greedy and the sampled chains are measured back to back, so a change of load
on the shared cores falls on all of them. Reported per chain: total tok/s (median of the repeats) and its ratio to
greedy's (the median of the ratios of each repeat, greedy run just before); and the decode speed without the
prefill, one over the requests' median time per output token (TPOT), as llama-server times its own generation.

`main.py`: the command a new user runs (`--chat`: the prompt as a user turn, so the model answers at length), with
its own defaults (temperature 0.8, top-p 0.95, top-k 40) against `--temperature 0`, as processes of their own,
taking turns; its "decode X tok/s" line is the figure.

With `--peers DIR`, llama.cpp's llama-server (one slot) generates the same number of tokens after the same prompt
with each chain (`sampling_chains.llama_server_fields`), `--repeats` times in turns; its own timing of the
generation (`timings.predicted_per_second`) is the figure, and its ratio to its greedy.

Results: benchmarks/results/bench_sampling.json.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench_throughput import StepRecorder, buckets_used, make_prompts, run_batch, warm_up
from common import BenchParser, add_peers_arg, find_peers, load_average, log, machine_description, table, write_results
from sampling_chains import CHAINS, add_sampling_arg, llama_server_fields

from tinyvllm.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
MAIN_PROMPT = "Write a short story about a lighthouse keeper."


def measure_engine(args: argparse.Namespace, levels: list[int]) -> dict:
    """{N: {chain: {"tok_s": median, "runs": [...], "ratio_to_greedy": median}}} for the tinyvllm engine."""
    engine = LLMEngine(args.model, max_num_seqs=max(levels), max_num_batched_tokens=max(512, max(levels)),
                       kv_cache_memory="1GiB", max_model_len=2048, quantization=args.quantization)
    warm_up(engine, buckets_used(engine, [args.prompt_len] * max(levels), args.output_len), log)
    recorder = StepRecorder(engine)
    used = 0

    def prompts(n: int) -> list[list[int]]:
        nonlocal used
        used += n
        return make_prompts(engine, n, args.prompt_len, first=used - n)

    for n in levels:  # every chain's sampler graph at every N, compiled before the clock starts
        for chain in args.sampling:
            run_batch(engine, recorder, prompts(n), 4, f"warm-{n}-{chain}", chain)
    results = {n: {chain: {"runs": []} for chain in args.sampling} for n in levels}
    for n in levels:
        for repeat in range(args.repeats):
            for chain in args.sampling:
                r = run_batch(engine, recorder, prompts(n), args.output_len, f"{n}-{repeat}-{chain}", chain)
                # decode_tok_s: one over the median time per output token (TPOT) of the requests, the decode speed
                # without the prefill, which is what llama-server's own timing measures
                results[n][chain]["runs"].append({"tok_s": r["tok_s"], "decode_tok_s": 1e3 / r["tpot_ms"]["p50"],
                                                  "load_average": r["load_average"]})
                log(f"N {n}, {chain}, repeat {repeat + 1}/{args.repeats}: {r['tok_s']:.1f} tok/s, "
                    f"load average {r['load_average'][1]}")
    for n in levels:
        summarize(results[n], args.sampling)
    return results


def summarize(by_chain: dict, chains: list[str]) -> None:
    """Each chain's median tok/s, and the median over repeats of its tok/s over greedy's in the same repeat."""
    greedy = by_chain.get("greedy")
    for chain in chains:
        runs = by_chain[chain]["runs"]
        for figure, ratio in (("tok_s", "ratio_to_greedy"), ("decode_tok_s", "decode_ratio_to_greedy")):
            if figure not in runs[0]:
                continue
            by_chain[chain][figure] = statistics.median(r[figure] for r in runs)
            if greedy is not None:
                by_chain[chain][ratio] = statistics.median(r[figure] / g[figure] for r, g in zip(runs, greedy["runs"]))


def measure_main(args: argparse.Namespace) -> dict:
    """main.py with its defaults against --temperature 0, `--repeats` runs each in turns: decode tok/s."""
    runs: dict[str, list[float]] = {"defaults": [], "temperature_0": []}
    for repeat in range(args.repeats):
        for name, extra in (("temperature_0", ["--temperature", "0"]), ("defaults", [])):
            cmd = [sys.executable, str(ROOT / "main.py"), "--prompt", MAIN_PROMPT, "--chat", "--max-tokens",
                   str(args.output_len), "--seed", str(repeat), *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            found = re.search(r"decode ([\d.]+) tok/s", r.stderr)
            if r.returncode != 0 or found is None:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
            runs[name].append(float(found.group(1)))
            log(f"main.py {name}, repeat {repeat + 1}/{args.repeats}: {runs[name][-1]:.1f} tok/s, "
                f"load average {load_average()}")
    out = {name: {"tok_s": statistics.median(v), "runs": v} for name, v in runs.items()}
    ratios = [d / g for d, g in zip(runs["defaults"], runs["temperature_0"]) if g > 0]
    out["defaults"]["ratio_to_temperature_0"] = statistics.median(ratios) if ratios else None
    return out


def measure_llama_server(llama, args: argparse.Namespace) -> dict:
    """llama-server (one slot, the shipped Q4_1 file) generating --output-len tokens after the same prompt with
    each chain: {chain: {"tok_s": median of its own timings, "ratio_to_greedy": ...}}."""
    log(f"llama-server: {', '.join(args.sampling)}, {args.repeats} turns, load average {load_average()}")
    runs = llama.server_decode("Q4_1", MAIN_PROMPT, args.output_len,
                               {chain: llama_server_fields(chain) for chain in args.sampling}, args.repeats)
    by_chain = {chain: {"runs": [{"tok_s": t} for t in runs[chain]]} for chain in args.sampling}
    summarize(by_chain, args.sampling)
    return {"threads": llama.threads, "format": "Q4_1", "chains": by_chain}


def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,32", help="comma-separated numbers of requests at once (default 1,32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="turns over the chains (default 2)")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quantization", "-q", default="auto", help="the engine's --quantization (default auto)")
    p.add_argument("--no-main", action="store_true", help="skip the main.py runs")
    add_sampling_arg(p, default="greedy,temperature,top_p,top_k,llama")
    add_peers_arg(p)
    args = p.parse_args(argv)
    if "greedy" not in args.sampling:
        p.error("--sampling must include greedy: every figure is a ratio to it")
    levels = [int(c) for c in args.concurrency.split(",")]
    llama = find_peers(args)

    figures: dict = {"prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
                     "quantization": args.quantization, "chains": {c: CHAINS[c] for c in args.sampling}}
    figures["concurrency"] = {str(n): r for n, r in measure_engine(args, levels).items()}
    if not args.no_main:
        figures["main_py"] = measure_main(args)
    if llama is not None:
        figures["peers"] = {"llama_server": measure_llama_server(llama, args)}

    print(f"\nbench_sampling: {machine_description(False)}; quantization {args.quantization}; prompt "
          f"{args.prompt_len}, output {args.output_len} tokens (ignore_eos); median of {args.repeats} turns")
    headers = ("chain", *(h for n in levels for h in (f"N={n} tok/s", "vs greedy")), f"N={levels[0]} decode tok/s",
               "vs greedy",
               *(("llama-server tok/s", "vs greedy") if llama is not None else ()))
    rows = []
    for chain in args.sampling:
        row = [chain]
        for n in levels:
            r = figures["concurrency"][str(n)][chain]
            row += [f"{r['tok_s']:.1f}", f"{r['ratio_to_greedy']:.2f}"]
        r = figures["concurrency"][str(levels[0])][chain]
        row += [f"{r['decode_tok_s']:.1f}", f"{r['decode_ratio_to_greedy']:.2f}"]
        if llama is not None:
            r = figures["peers"]["llama_server"]["chains"][chain]
            row += [f"{r['tok_s']:.1f}", f"{r['ratio_to_greedy']:.2f}"]
        rows.append(row)
    print(table(rows, headers))
    if "main_py" in figures:
        m = figures["main_py"]
        print(f"main.py: defaults {m['defaults']['tok_s']:.1f} tok/s, --temperature 0 {m['temperature_0']['tok_s']:.1f}"
              f" tok/s (ratio {m['defaults']['ratio_to_temperature_0']})")
    write_results("bench_sampling", figures, args)


if __name__ == "__main__":
    main()
