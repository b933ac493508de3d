"""How fast does tinyvllm generate, and how far is that from what the memory allows?

    python benchmarks/bench_generate.py                       # default model, float32
    python benchmarks/bench_generate.py --beam 2              # tinygrad's BEAM kernel search (slow the first time)
    python benchmarks/bench_generate.py --model path/to/model.gguf --json results.json
    python benchmarks/bench_generate.py --cold-start-only --peers DIR   # run it twice: the second start is warm

Five measurements, in the order a user meets them (the fifth with --peers):

  1. cold start: from the moment the process started to the first generated token, split into
     imports | load (device open, checkpoint, tokenizer, weights, the rest of the engine) | first prefill
     and sample. tinygrad keeps compiled kernels on disk, tinyvllm its lowered programs and captured graphs
     (kernels/program_cache.py, kernels/graph_cache.py), so "cold" here means a new process after an
     earlier one with the same code ran: the caches' state and how many of the first step's graphs were read
     from disk are printed; --fresh-kernel-cache points every cache at an empty directory. --cold-start-only
     also times `python main.py --max-tokens 1` in processes of its own (Popen to the first token on stdout).
  2. prefill tokens/s for a few prompt lengths, after a warm-up run of each length.
  3. single-stream decode tokens/s (greedy, ignore_eos), after warm-up: mean, p50 and p90 per-token
     latency through the engine (`Generator.stream`, one request on `LLMEngine`).
  4. the ceiling. A decode step of one sequence reads every weight once:

         bytes per token = (all linear weights + lm_head) x bytes of the compute dtype
         best decode tok/s = read bandwidth / bytes per token

     The read bandwidth is measured in this run, on its device (benchmarks/bandwidth.py); with --peers, also the
     rate llama.cpp streams the float32 weights at (its tg tok/s x those bytes). KV cache and embedding left out.
  5. with --peers DIR: llama.cpp's llama-bench (tgN, ppN for the same lengths) on F32, Q8_0 and the shipped
     Q4_1 weights (with --model FILE.gguf, on that very file instead: "file"), and llama-server's process start to
     first token, run after tinyvllm's measurements, printed beside them with the ratio.

Results go to benchmarks/results/bench_generate[_<method>][_<the --model file's type>].json (and to --json PATH).
"""

from __future__ import annotations

import time

SCRIPT_START = time.perf_counter()

# imported after the clock starts, so that the cold-start breakdown sees them
import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tinyvllm.gc_utils import freeze_heap, pause_collection  # noqa: E402
GC_WAS_ENABLED = pause_collection()  # as `python main.py` does until its engine is built (tinyvllm/gc_utils.py)
import numpy as np  # noqa: E402  (numpy only here: tinygrad must not be imported before BEAM is set)
from bandwidth import measure_bandwidth_on  # noqa: E402  (benchmarks/bandwidth.py)
from common import (  # noqa: E402  (benchmarks/common.py)
    BenchParser, add_peers_arg, code_version, find_peers, first_output_s, kernel_cache_state,
    layer_weight_count, log, machine_description, side_by_side_headers, table, write_results)
from sampling_chains import CHAINS, add_sampling_arg, sampling_params  # noqa: E402

BENCH_TEXT = ("The history of computing is a story of ideas building on ideas. Early machines filled rooms and "
              "were programmed by rewiring them; later, stored programs let the same hardware run any algorithm. "
              "Memory grew faster than anyone expected, and so did the software that filled it. ")


def process_age() -> float | None:
    """Seconds since this process was created (interpreter start included), from /proc on Linux."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None  # not Linux: the clock starts at the top of this script instead


_age = process_age()
INTERPRETER_START_S = _age - (time.perf_counter() - SCRIPT_START) if _age is not None else None
PROCESS_START = SCRIPT_START - (INTERPRETER_START_S or 0.0)


def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(description="tinyvllm generation benchmark: cold start, prefill, decode, "
                                "the memory-bandwidth ceiling, and llama.cpp in the same run (--peers)")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
    p.add_argument("--quantization", "-q", default="auto",
                   choices=["auto", "none", "q8_0", "q4_0", "q4_1", "iq4_nl", "q4_k"],
                   help="how the weights are stored (the engine's flag, default auto: the GGUF's own blocks). "
                        "Results go to results/bench_generate.json for none (float32 weights), "
                        "results/bench_generate_<method>.json otherwise")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per decode run (default 128)")
    p.add_argument("--decode-runs", type=int, default=3, help="measured decode runs (default 3)")
    p.add_argument("--prompt-lens", default="32,128,512", help="prefill lengths, comma-separated (default 32,128,512)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="measured prefills per length (default 3)")
    p.add_argument("--prompt", default="The capital of France is", help="prompt for the cold start and decode")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--beam", type=int, default=0, help="set tinygrad's BEAM=N (kernel search; minutes the first "
                   "time, cached on disk after)")
    p.add_argument("--fresh-kernel-cache", action="store_true", help="empty tinygrad and tinyvllm caches: a new "
                   "machine's first start, lowering and compiling every kernel")
    p.add_argument("--no-cpu-graph", action="store_true", help="replay captured graphs with tinygrad's own "
                   "per-kernel Python loop instead of tinyvllm's CPU graph (TINYVLLM_CPU_GRAPH=0)")
    p.add_argument("--cold-start-only", action="store_true", help="only the cold start (with --peers, llama-server's "
                   "too); to results/bench_generate_cold_start[_fresh][_<method>].json")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    add_sampling_arg(p, default="greedy,llama")
    add_peers_arg(p)
    return p


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def weight_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes one decode step reads from the weights: every linear layer plus lm_head (the norms, negligible, and all
    but one row of an untied input embedding left out)."""
    return (layer_weight_count(config) + config.vocab_size * config.hidden_size) * dtype_bytes


def prompt_of_length(tokenizer, n: int, variant: int = 0) -> list[int]:
    """n token ids of the text; each `variant` starts with a token of its own, so that prefix caching (on by
    default) finds nothing of it cached and every timed run computes its whole prompt."""
    ids = tokenizer.encode(BENCH_TEXT, add_special_tokens=False)
    return ([1000 + variant] + ids * (n // len(ids) + 1))[:n]


LOAD_PART_NAMES = {"device_open_s": "device: choose and open (program_cache.install)",
                   "checkpoint_s": "checkpoint: GGUF header, tensors memory-mapped",
                   "tokenizer_s": "tokenizer", "weights_s": "weights onto the device",
                   "engine_rest_s": "KV cache, scheduler, runner"}


@contextlib.contextmanager
def load_parts():
    """Time the parts of the engine's load by wrapping what tinyvllm/model/loader.py calls: {part: seconds}."""
    from tinygrad import Device

    from tinyvllm.model import loader

    parts = dict.fromkeys(["device_open_s", "checkpoint_s", "tokenizer_s", "weights_s"], 0.0)

    def timed(fn, part, after=None):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                out = fn(*a, **k)
                if after is not None:
                    after(a, k)
                return out
            finally:
                parts[part] += time.perf_counter() - t
        return run

    def open_device(a, k):  # the device opens at the first weight otherwise: count it here
        Device[k.get("device") or Device.DEFAULT]

    saved = (loader.install_program_cache, loader.load_checkpoint, loader.load_tokenizer, loader.LlamaForCausalLM)
    loader.install_program_cache = timed(loader.install_program_cache, "device_open_s", open_device)
    loader.load_checkpoint = timed(loader.load_checkpoint, "checkpoint_s")
    loader.load_tokenizer = timed(loader.load_tokenizer, "tokenizer_s")
    loader.LlamaForCausalLM = timed(loader.LlamaForCausalLM, "weights_s")
    try:
        yield parts
    finally:
        loader.install_program_cache, loader.load_checkpoint, loader.load_tokenizer, loader.LlamaForCausalLM = saved


def graph_counts(runner) -> dict:
    """How many of the first step's graphs were read from disk (kernels/graph_cache.py) and how many built."""
    persisted = [j.persist for j in list(runner._jits.values()) + list(runner._sampler_jits.values())]
    read = sum(p.hits for p in persisted if p is not None)
    return {"read": read, "built": len(persisted) - read}


def finish_cold_start_only(args, results: dict, llama) -> int:
    """--cold-start-only: the same start as `python main.py` (warm caches), and llama-server's on the file of the
    same format, then write."""
    from peers.llama_cpp import SAME_FORMAT, result_key  # benchmarks/peers/

    ours = results["cold_start"]
    if not args.fresh_kernel_cache:  # the user's command in a process of its own, nothing of this script in it
        cmd = [sys.executable, str(ROOT / "main.py"), "--prompt", args.prompt, "--max-tokens", "1", "--temperature",
               "0", "--quantization", args.quantization, "--dtype", args.dtype]
        cmd += ["--model", args.model] if args.model else []
        ours["main_py_runs_s"] = runs = [first_output_s(cmd) for _ in range(3)]
        ours["main_py_s"] = statistics.median(runs)
        print(f"python main.py --max-tokens 1, Popen -> first token on stdout: {ours['main_py_s']:.2f} s (median of 3)")
    if llama is not None and (fmt := SAME_FORMAT.get(args.quantization)) is not None:
        cold = llama.cold_start(fmt)
        ratio = {k: ours[v] / cold["first_token_s"] for k, v in (("cold_start", "process_start_to_first_token_s"),
                                                                  ("main_py", "main_py_s")) if v in ours}
        results["peers"] = {result_key(fmt): {"cold_start_s": cold["first_token_s"], "tinyvllm_ratio": ratio,
                                              "cold_start_runs_s": [r["first_token_s"] for r in cold["runs"]]}}
        print(f"llama-server {fmt}: Popen -> first token {cold['first_token_s']:.2f} s (tinyvllm: this script "
              + ", main.py ".join(f"{r:.2f}x" for r in ratio.values()) + " that)")
    name = "bench_generate_cold_start" + "_fresh" * args.fresh_kernel_cache + f"_{args.quantization}" * (
        args.quantization != "none")
    write_results(name, file_figures(results), args, also=args.json_path)
    return 0


# ---- 4 and 5: the ceiling and llama.cpp, measured after tinyvllm's runs (one thing at a time on the cores) ----

def measure_peers(llama, prompt_lens: list[int], n_gen: int) -> dict:
    """llama.cpp on each weight format: llama-bench (ppN for each prompt length, tg n_gen) and the cold start of
    llama-server. Keys as in the results file: {"llama_cpp_f32": {"tg128_tok_s": .., "cold_start_s": ..}, ..}."""
    from peers.llama_cpp import result_key  # benchmarks/peers/

    out = {}
    for fmt in llama.models:  # F32, Q8_0, Q4_1 (with --model, "file": the same file tinyvllm ran)
        log(f"llama.cpp {fmt}: llama-bench -p {','.join(map(str, prompt_lens))} -n {n_gen}, then llama-server ...")
        figures = llama.bench(fmt, prompt_lens, n_gen)
        cold = llama.cold_start(fmt)
        figures["cold_start_s"] = cold["first_token_s"]
        figures["cold_start_runs_s"] = [r["first_token_s"] for r in cold["runs"]]
        figures["threads"] = llama.threads
        out[result_key(fmt)] = figures
    return out


def report_ceiling(read: dict, weight_bytes: int, f32_weight_bytes: int, kv_bytes: int, decode_tok_s: float,
                   peers: dict, dtype: str) -> dict:
    """Print decode against the read bandwidth and (with peers) against llama.cpp F32's weight stream
    (f32_weight_bytes: what its step reads; weight_bytes: what tinyvllm's reads in `dtype`)."""
    threads = max(read["bytes_per_s"])
    bandwidth = read["bytes_per_s"][threads]
    bound = bandwidth / weight_bytes
    out = {"read_gb_s": {str(n): b / 1e9 for n, b in read["bytes_per_s"].items()}, "read_threads": threads,
           "read_method": read["method"],
           "read_buffer_mib": read["buffer_bytes"] / 2**20, "weight_bytes_per_token": weight_bytes,
           "kv_bytes_per_token_mid_run": kv_bytes, "read_bound_tok_s": bound,
           "decode_weights_gb_s": decode_tok_s * weight_bytes / 1e9,
           "decode_fraction_of_read_bound": decode_tok_s / bound}
    one = read["bytes_per_s"].get(1)
    rows = [(f"weights read per token (linear + lm_head, {dtype})", f"{weight_bytes / 1e6:.1f} MB"),
            ("KV cache read per token, mid-run (not counted)", f"{kv_bytes / 1e6:.1f} MB"),
            (f"read bandwidth, {read['method']}, {threads} thread(s) over {read['buffer_bytes'] / 2**20:.0f} MiB",
             f"{bandwidth / 1e9:.1f} GB/s" + (f" (1 thread {one / 1e9:.1f})" if one and threads > 1 else "")),
            ("ceiling: read bandwidth / bytes per token", f"{bound:.1f} tok/s")]
    f32 = peers.get("llama_cpp_f32", {})
    tg = next((v for k, v in f32.items() if k.startswith("tg") and k.endswith("_tok_s")), None)
    if tg is not None:
        out["llama_cpp_f32_weights_gb_s"] = tg * f32_weight_bytes / 1e9
        out["decode_fraction_of_llama_cpp_f32"] = decode_tok_s / tg
        rows.append(("llama.cpp F32 streams the float32 weights at (its tg tok/s x bytes per token)",
                     f"{tg * f32_weight_bytes / 1e9:.1f} GB/s = {tg:.1f} tok/s"))
    rows.append(("tinyvllm decode (engine)",
                 f"{decode_tok_s:.1f} tok/s = {decode_tok_s * weight_bytes / 1e9:.1f} GB/s"))
    rows.append(("  as a fraction of the read ceiling", f"{decode_tok_s / bound:.0%}"))
    if tg is not None:
        rows.append(("  as a fraction of llama.cpp F32", f"{decode_tok_s / tg:.0%}"))
    print("\n== ceiling: single-stream decode reads every weight once per token ==")
    print(table(rows, ("", "value")))
    return out


def report_peers(results: dict, peers: dict, dtype: str, formats: list[str]) -> None:
    """tinyvllm and llama.cpp side by side, same workloads; each peer gets its tinyvllm / llama.cpp ratios."""
    from peers.llama_cpp import SOURCE, result_key  # benchmarks/peers/

    n_gen = results["decode"]["tokens_per_run"]
    ours = {f"tg{n_gen}": results["decode"]["tok_per_s"]}
    ours.update({f"pp{p['prompt_tokens']}": p["tok_per_s"] for p in results["prefill"]})
    rows = []
    for name, value in ours.items():
        kind = "decode" if name.startswith("tg") else "prefill"
        row = [f"{kind} {name} tok/s", f"{value:.1f}"]
        for fmt in formats:
            peer = peers[result_key(fmt)]
            theirs = peer.get(f"{name}_tok_s")
            peer.setdefault("tinyvllm_ratio", {})[name] = None if theirs is None else value / theirs
            row += ["-", "-"] if theirs is None else [f"{theirs:.1f}", f"{value / theirs:.2f}"]
        rows.append(row)
    cold = results["cold_start"]["process_start_to_first_token_s"]
    row = ["cold start: process start -> first token, s", f"{cold:.2f}"]
    for fmt in formats:
        peer = peers[result_key(fmt)]
        peer.setdefault("tinyvllm_ratio", {})["cold_start"] = cold / peer["cold_start_s"]
        row += [f"{peer['cold_start_s']:.2f}", f"{cold / peer['cold_start_s']:.2f}"]
    rows.append(row)
    headers = side_by_side_headers("workload", f"tinyvllm {dtype}", formats)
    print(f"\n== tinyvllm and llama.cpp ({SOURCE}), same model and workloads, this run; "
          f"ratio = tinyvllm / llama.cpp ==")
    print(table(rows, headers))
    print(f"llama.cpp: llama-bench (median of 5 repetitions, decode from an empty context), llama-server -np 1 from "
          f"Popen to the reply of one /completion (median of 3); {peers[result_key(formats[0])]['threads']} threads.")
    print("For the cold start the ratio is of seconds: above 1, tinyvllm takes longer.")


def file_figures(results: dict) -> dict:
    """The results-file view: the same figures under short, stable keys ("tok_per_s" -> "tok_s", prefill by
    prompt length); the run's metadata is written by common.write_results."""
    def rename(value):
        if isinstance(value, dict):
            return {k.replace("tok_per_s", "tok_s"): rename(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rename(v) for v in value]
        return value

    figures = {k: rename(v) for k, v in results.items() if k not in ("date", "machine", "code", "args")}
    if isinstance(figures.get("prefill"), list):
        figures["prefill"] = {str(p["prompt_tokens"]): p for p in figures["prefill"]}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 2 or args.decode_runs < 1 or args.prefill_repeats < 1:
        parser.error("--max-tokens must be >= 2 (decode speed is measured between tokens), "
                     "--decode-runs and --prefill-repeats >= 1")
    try:
        prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--prompt-lens must be comma-separated integers, got {args.prompt_lens!r}")
    # tinygrad reads BEAM and CACHEDB when it is imported: set them first
    if args.beam:
        os.environ["BEAM"] = str(args.beam)
        print(f"BEAM={args.beam}: tinygrad times several variants of every kernel. The first run with a new kernel "
              "takes minutes (the choices are cached on disk; later runs are fast).", file=sys.stderr)
    if args.fresh_kernel_cache:
        os.environ["CACHEDB"] = str(Path(tempfile.mkdtemp(prefix="tinygrad-cache-")) / "cache.db")
        os.environ["TINYVLLM_CACHE_DIR"] = tempfile.mkdtemp(prefix="tinyvllm-cache-")
    if args.no_cpu_graph:
        os.environ["TINYVLLM_CPU_GRAPH"] = "0"
    cache_state = kernel_cache_state()
    llama = find_peers(args)  # fails here, not after minutes of measuring, if llama.cpp is not built
    if llama is not None and args.model and args.model.endswith(".gguf"):  # llama.cpp on the very file instead
        llama = type(llama)(llama.bin_dir, {"file": Path(args.model).resolve()}, llama.threads)

    # ---- 1. cold start: process start -> first token ----
    t_setup_end = t = time.perf_counter()
    import tinygrad  # noqa: F401

    from tinyvllm.engine.generator import Generator
    from tinyvllm.sampling_params import SamplingParams
    t_imports = time.perf_counter() - t

    t = time.perf_counter()
    with load_parts() as parts:
        gen = Generator(args.model, dtype=args.dtype, max_model_len=args.max_model_len, quantization=args.quantization)
    freeze_heap(enable=GC_WAS_ENABLED)  # the engine is built: what the start made is frozen, collection runs again
    t_load = time.perf_counter() - t
    parts["engine_rest_s"] = t_load - sum(parts.values())  # KV cache, scheduler, model runner

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    t = time.perf_counter()
    prompt_ids = gen.encode_prompt(args.prompt)
    first = gen.generate(prompt_ids, greedy).token_ids[0]  # prefill + sampling, through the engine
    t_prefill = time.perf_counter() - t
    ttft = time.perf_counter() - PROCESS_START
    t_setup = t_setup_end - SCRIPT_START
    graphs = graph_counts(gen.engine.model_runner)
    cold = {"interpreter_start_s": INTERPRETER_START_S, "script_setup_s": t_setup, "imports_s": t_imports,
            "load_s": t_load, "load_parts": parts, "first_prefill_s": t_prefill,
            "process_start_to_first_token_s": ttft, "prompt_tokens": len(prompt_ids),
            "first_token": gen.tokenizer.decode([first]), "first_step_graphs": graphs}
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine_description(),
                     "code": code_version(), "args": vars(args), "engine": "LLMEngine",
                     "kernel_cache": cache_state, "cold_start": cold}

    config = gen.model.config
    dtype_bytes = gen.model.dtype.itemsize
    print(f"model     {gen.model_path.name}  ({config.num_params / 1e6:.1f}M parameters, {config.num_hidden_layers} "
          f"layers, dim {config.hidden_size}, vocab {config.vocab_size})")
    dtype_name = {2: "float16", 4: "float32"}[gen.model.dtype.itemsize]  # --dtype auto: the device's
    print(f"dtype     {dtype_name}   device {gen.model.device}   max_model_len {gen.max_model_len}   "
          f"engine LLMEngine   BEAM={os.environ.get('BEAM', '0')}   "
          f"CPU graph {'off' if os.environ.get('TINYVLLM_CPU_GRAPH') == '0' else 'on'}")
    print(f"machine   {results['machine']}")
    print(f"code      {results['code']}   {results['date']}")
    print(f"kernels   tinygrad cache {cache_state}")

    print(f"\n== cold start: process start -> first token (prompt {args.prompt!r}, {len(prompt_ids)} tokens) ==")
    rows = []
    clock = 0.0
    steps = [("Python start (interpreter, before this script)", SCRIPT_START - PROCESS_START),
             ("script setup (numpy, arguments)", t_setup),
             ("imports (tinygrad, tinyvllm)", t_imports), ("load (weights, tokenizer, KV cache)", t_load),
             (f"first prefill + sample ({graphs['read']} graphs read from disk, {graphs['built']} built)", t_prefill)]
    if INTERPRETER_START_S is None:
        steps = steps[1:]  # no /proc: the clock started at the top of this script
    for name, dt in steps:
        clock += dt
        rows.append((name, f"{dt:.2f}", f"{clock:.2f}"))
        if name.startswith("load"):
            rows += [(f"  {LOAD_PART_NAMES[k]}", f"{v:.2f}", "") for k, v in cold["load_parts"].items()]
    rows.append(("first token (process start -> token)", "", f"{ttft:.2f}"))
    print(table(rows, ("step", "seconds", "since start")))

    if args.cold_start_only:
        return finish_cold_start_only(args, results, llama)

    # ---- 2. prefill ----
    prefill_rows, prefill = [], []
    fresh = itertools.count(1)  # each run a prompt of its own (prompt_of_length)
    for n in prompt_lens:
        if n + 1 > gen.max_model_len:
            print(f"(skipping prefill {n}: longer than max_model_len {gen.max_model_len})")
            continue
        ids = prompt_of_length(gen.tokenizer, n, next(fresh))
        t = time.perf_counter()
        gen.generate(ids, greedy)  # first run: compiles the step's kernels on first use
        warmup = time.perf_counter() - t
        ids = prompt_of_length(gen.tokenizer, n, next(fresh))
        gen.generate(ids, greedy)  # second run: TinyJit captures the kernels; later runs replay them
        times = []
        for _ in range(args.prefill_repeats):
            ids = prompt_of_length(gen.tokenizer, n, next(fresh))
            t = time.perf_counter()
            gen.generate(ids, greedy)  # the prompt in one step (up to the engine's token budget), then one sample
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        prefill.append({"prompt_tokens": n, "warmup_s": warmup, "times_s": times, "tok_per_s": n / med,
                        "best_tok_per_s": n / min(times)})
        prefill_rows.append((n, f"{warmup:.2f}", f"{med * 1e3:.0f}", f"{n / med:.0f}", f"{n / min(times):.0f}"))
    results["prefill"] = prefill
    print(f"\n== prefill: prompt to first token through the engine (up to "
          f"{gen.engine.scheduler.max_num_batched_tokens} tokens a step), median of {args.prefill_repeats} "
          f"after two warm-up runs ==")
    print(table(prefill_rows, ("prompt tokens", "first run s", "median ms", "tok/s", "best tok/s")))

    # ---- 3. decode: greedy, and each other chain of --sampling, taking turns run by run ----
    chains = ["greedy"] + [c for c in args.sampling if c != "greedy"]
    for chain in chains:  # warm-up: each chain's sampler graph
        gen.generate(args.prompt, sampling_params(chain, seed=0, ignore_eos=True, max_tokens=8))
    by_chain: dict[str, list[float]] = {chain: [] for chain in chains}
    latencies = []
    for run in range(args.decode_runs):
        for chain in chains:
            params = sampling_params(chain, seed=run, ignore_eos=True, max_tokens=args.max_tokens)
            stamps = [time.perf_counter() for _ in gen.stream(args.prompt, params)]
            gaps = np.diff(stamps).tolist()  # the first token comes from prefill; each gap is one decode step
            latencies += gaps if chain == "greedy" else []
            by_chain[chain].append(len(gaps) / sum(gaps))
    runs = by_chain["greedy"]
    engine_tok_s = statistics.median(runs)

    results["decode"] = {"tokens_per_run": args.max_tokens, "runs_tok_per_s": runs, "tok_per_s": engine_tok_s,
                         "latency_mean_ms": 1e3 * float(np.mean(latencies)),
                         "latency_p50_ms": 1e3 * percentile(latencies, 50),
                         "latency_p90_ms": 1e3 * percentile(latencies, 90)}
    d = results["decode"]
    print(f"\n== decode: one sequence, greedy, ignore_eos, {args.max_tokens} tokens, median of "
          f"{args.decode_runs} runs after a warm-up ==")
    print(table([
        ("engine (Generator.stream)", f"{engine_tok_s:.1f}", f"{d['latency_mean_ms']:.1f}",
         f"{d['latency_p50_ms']:.1f}", f"{d['latency_p90_ms']:.1f}"),
    ], ("", "tok/s", "mean ms", "p50 ms", "p90 ms")))
    print("runs (tok/s): " + ", ".join(f"{r:.1f}" for r in runs))
    if len(chains) > 1:  # the ratio of each run to the greedy run just before it, median over runs
        results["decode_sampled"] = {chain: {
            "runs_tok_per_s": by_chain[chain], "tok_per_s": statistics.median(by_chain[chain]),
            "ratio_to_greedy": statistics.median(r / g for r, g in zip(by_chain[chain], runs))}
            for chain in chains[1:]}
        print(table([(chain, ", ".join(f"{k}={v}" for k, v in CHAINS[chain].items()),
                      f"{r['tok_per_s']:.1f}", f"{r['ratio_to_greedy']:.2f}")
                     for chain, r in results["decode_sampled"].items()],
                    ("sampling", "parameters", "tok/s", "vs greedy")))

    # ---- 4. the ceiling and 5. llama.cpp, after tinyvllm's runs ----
    weight_bytes = weight_bytes_per_token(config, dtype_bytes)
    if args.quantization != "none":  # the bytes the weights really occupy (blocks), less what a step does not read
        weight_bytes = gen.model.weight_bytes_per_token()
        results["weight_bytes_by_format"] = gen.model.weight_formats()
    kv_bytes = config.kv_bytes_per_token * dtype_bytes // 4 * (len(prompt_ids) + args.max_tokens // 2)
    read = measure_bandwidth_on(gen.model.device)  # the device the run used: a GPU's memory, or the CPU's
    peers = measure_peers(llama, prompt_lens, args.max_tokens) if llama is not None else {}
    # what tinyvllm's weights are, in the tables: "float32", or e.g. "Q4_1/Q8_0 (auto)"
    label = dtype_name if args.quantization == "none" else (
        "/".join(f for f in gen.model.weight_formats() if not f.startswith("float")) + f" ({args.quantization})")
    results["ceiling"] = report_ceiling(read, weight_bytes, weight_bytes_per_token(config, 4), kv_bytes,
                                        engine_tok_s, peers, label)
    if peers:
        report_peers(results, peers, label, list(llama.models))
        results["peers"] = peers
    name = ("bench_generate" if args.quantization == "none" else f"bench_generate_{args.quantization}") + (
        "" if args.model is None else "_" + Path(args.model).stem.split(".")[-1].lower().replace("-", "_"))
    write_results(name, file_figures(results), args, also=args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
