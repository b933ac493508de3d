"""tinyvllm and llama.cpp at real model sizes, on the same files in the same run.

    python benchmarks/bench_scale.py --shapes 1b --peers DIR --save        # Llama-3.2-1B shape, Q4_K_M and Q8_0
    python benchmarks/bench_scale.py --shapes 1b,3b --formats q4_k_m --peers DIR

The shipped model (135M parameters) fits the CPU's caches better than any model people serve, so this benchmark
makes checkpoints of two real shapes with random weights (seeded; normal / sqrt(fan_in), norms near 1, so the
activations stay finite) and times both engines on them:

    shape  as                  hidden  FFN     layers  heads / KV heads  head_dim  vocab    other
    1b     Llama-3.2-1B        2048    8192    16      32 / 8            64        128256   tied embeddings, theta 5e5
    3b     Qwen2.5-3B (qwen2)  2048    11008   36      16 / 2            128       151936   tied, q/k/v bias, theta 1e6
    tiny   (for the tests)     256     512     2       4 / 2             64        49152

The vocabulary is SmolLM2's tokenizer (49152 tokens, the shipped model's), padded with unused "[PADn]" tokens up to
the real model's vocab size, as convert_hf_to_gguf.py pads a vocabulary: every tensor has the real model's shape.
Llama 3.2's "llama3" RoPE scaling is left out (GGUF keeps it as a rope_freqs tensor, which tinyvllm does not read);
it changes no cost. The checkpoint is written once as F16 by the project's own GGUF writer
(tinyvllm/model/gguf_writer.py), then `llama-quantize` makes each format, so both engines read the very same file.
Without --peers the project's own quantizer (tinyvllm/quantize.py) makes the formats it knows (q8_0, q4_k).
Made files are kept in --work-dir (default ~/.cache/tinyvllm/scale/) and reused.

Per (shape, format), each figure is:

    decode        one request, greedy, ignore_eos: tokens/s between the tokens of a --decode-tokens run after
                  a short prompt (median of 2 runs, after a warm-up); llama.cpp: llama-bench tgN (median of 3, as pp512)
    prefill 512   a 512-token prompt to its first token (median of 2 after two warm-ups); llama-bench pp512
    16 / 64       N requests at once, 32-token prompts, 32 tokens out each: N x 32 / wall time, prefill included
                  (bench_throughput's count, buckets compiled before the clock); llama-batched-bench -npp 32 -ntg 32
    load          process start (Popen) to the model ready to serve: tinyvllm's Generator built (warm caches);
                  llama-server answering /health
    first run     tinyvllm only, with empty program and kernel caches (TINYVLLM_CACHE_DIR, CACHEDB): the first
                  request (8-token prompt, 16 tokens out) takes this long, against the same request in a process
                  whose caches are warm; "compile" is the difference
    peak memory   the largest resident set (ru_maxrss, os.wait4) of the process that ran decode, prefill and the
                  concurrent loads; llama.cpp: the larger of llama-bench's and llama-batched-bench's
    ceiling       what the hardware allows: one token reads every weight once (the linear layers and the lm_head,
                  as the file stores them), so decode streams tok/s x those bytes, against the machine's read
                  bandwidth with every core; a prompt token costs 2 operations per weight of the layers, so prefill
                  runs tok/s x those, against what the integer dot steps of tinyvllm's kernels for the file allow,
                  each measured on registers alone: dpbusd for Q8_0 and the repacked Q4_K, maddubs then dpwssd for
                  the other K-quants (Q6_K), each layer weight at its kernel's rate. Both from bandwidth.py, measured in
                  this run before, between and after the two engines, the median kept (the read bandwidth of these
                  shared machines has moved from 34 to 60 GB/s between two measurements minutes apart). Both
                  engines do the same work, so neither can be faster than the other by more than the ceiling leaves.

Each tinyvllm measurement runs in a process of its own (this script with --worker), so that its memory and its
start are its own. Targets (docs/roadmap issue 36): at 1B, decode and prefill >= 1.2x llama.cpp in Q4_K_M and
Q8_0; peak memory within 1.2x llama.cpp's; the 3B shape runs within 24 GiB.
Results go to benchmarks/results/bench_scale.json with --save; a run keeps the figures of the shapes and formats
it did not measure from the file it rewrites (each entry has the date, commit and load averages of its own run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import common  # (benchmarks/common.py)
from common import (
    BenchParser, add_peers_arg, code_version, find_peers, layer_weight_count, load_average, log, machine_description,
    side_by_side_headers, table, write_results)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tinyvllm.model.config import ModelConfig  # noqa: E402  (config and writer import no tinygrad)

SHAPES = {
    "tiny": ModelConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True),
    "1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True),
    "3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                      architecture="Qwen2ForCausalLM", attention_bias=True),
    # Gemma 3 270M's published shape: another architecture (GeGLU, sandwich norms, q/k norms, five sliding-window
    # layers to one global, a 262k vocabulary) whose first run compiles kernels the LLaMA shapes never use
    "270m": ModelConfig.from_hf_config({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]}),
}
FORMATS = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "q4_k": "Q4_K_S"}  # ours -> llama-quantize's name
OWN_QUANTIZER = {"q8_0": "q8_0", "q4_k": "q4_k"}  # the formats tinyvllm/quantize.py can make without llama.cpp
CONCURRENT_PROMPT, CONCURRENT_OUTPUT = 32, 32
FIRST_PROMPT, FIRST_OUTPUT = 8, 16


# ---- the checkpoints ----

def tokenizer_keys(vocab_size: int) -> dict:
    """SmolLM2's tokenizer.* metadata, its vocabulary padded with unused tokens to vocab_size."""
    from tinyvllm.model.gguf_writer import ARRAY, INT32, STRING, MetadataValue, read_metadata
    from tinyvllm.model.weights import default_model_path

    md = {k: v for k, v in read_metadata(default_model_path()).items() if k.startswith("tokenizer.")}
    tokens, types = list(md["tokenizer.ggml.tokens"].value), list(md["tokenizer.ggml.token_type"].value)
    assert vocab_size >= len(tokens), f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokens)}"
    unused = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
    md["tokenizer.ggml.tokens"] = MetadataValue(tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)],
                                                ARRAY, STRING)
    md["tokenizer.ggml.token_type"] = MetadataValue(types + [unused] * (vocab_size - len(tokens)), ARRAY, INT32)
    return md


def write_random_gguf(config: ModelConfig, path: Path, seed: int = 0) -> Path:
    """An F16 GGUF of `config` with random weights (norms and biases F32, as llama.cpp stores them)."""
    from tinyvllm.ggml_types import F16, F32
    from tinyvllm.model.gguf_writer import UINT32, MetadataValue, TensorData, write_gguf
    from tinyvllm.model.weights import expected_shapes
    from tinyvllm.model.weights_gguf import gguf_name
    from tinyvllm.quantize import llama_metadata

    arch = config.gguf_architecture
    metadata = {**llama_metadata(config, f"random {path.stem}"), **tokenizer_keys(config.vocab_size),
                "general.file_type": MetadataValue(1, UINT32)}  # 1: LLAMA_FTYPE_MOSTLY_F16

    def tensor(index: int, hf: str, shape: tuple[int, ...]) -> TensorData:
        one_dim = len(shape) == 1

        def data() -> np.ndarray:  # one tensor in memory at a time; each seeded by its place in the file
            rng = np.random.default_rng([seed, index])
            x = rng.standard_normal(shape, dtype=np.float32)
            if hf.endswith("norm.weight"):
                return 1.0 + 0.1 * x
            if one_dim:  # a bias
                return 0.02 * x
            x *= 1.0 / np.sqrt(shape[-1])  # each output a sum of fan_in terms of variance 1 / fan_in
            return x.astype(np.float16)
        return TensorData(gguf_name(hf, arch), shape, F32 if one_dim else F16, data)

    tensors = [tensor(i, hf, shape) for i, (hf, shape) in enumerate(expected_shapes(config).items())]
    tmp = path.with_name(path.name + ".partial")  # the file appears whole or not at all
    write_gguf(tmp, metadata, tensors)
    os.replace(tmp, path)
    return path


def model_file(shape: str, fmt: str, work_dir: Path, llama=None) -> Path:
    """The checkpoint of `shape` in `fmt` ("f16": the written file), made once and kept in work_dir."""
    work_dir.mkdir(parents=True, exist_ok=True)
    f16 = work_dir / f"random-{shape}.F16.gguf"
    if not f16.is_file():
        log(f"writing {f16.name} (random weights, F16) ...")
        write_random_gguf(SHAPES[shape], f16)
    if fmt == "f16":
        return f16
    out = work_dir / f"random-{shape}.{FORMATS[fmt]}.gguf"
    if out.is_file():
        return out
    log(f"making {out.name} ...")
    if llama is not None:
        return llama.quantize(f16, out, FORMATS[fmt])
    if fmt not in OWN_QUANTIZER:
        raise SystemExit(f"{fmt} needs llama-quantize: pass --peers DIR (or use {', '.join(OWN_QUANTIZER)})")
    from tinyvllm.quantize import quantize_model

    return quantize_model(f16, out, OWN_QUANTIZER[fmt], out=open(os.devnull, "w"))


# ---- tinyvllm, in a process of its own (this script with --worker SPEC) ----

def worker(spec: dict) -> dict:
    """Load spec["model"], time the first request, and with spec["full"] decode, prefill and the concurrent
    loads; the figures as a dict. Runs in a fresh process: its start and its memory are the measurement's."""
    from tinyvllm.engine.generator import Generator
    from tinyvllm.sampling_params import SamplingParams

    levels = spec["concurrency"]
    gen = Generator(spec["model"], max_model_len=spec["max_model_len"], max_num_seqs=max([1, *levels]),
                    kv_cache_memory=spec["kv_cache_memory"])
    out = {"load_s": time.time() - spec["launched_at"], "weight_formats": gen.model.weight_formats(),
           "weight_bytes_per_token": gen.model.weight_bytes_per_token(),
           "layer_weights_by_dot_step": layer_weights_by_dot_step(gen.model)}

    def prompt(n: int, variant: int) -> list[int]:  # a token of its own first: no prefix-cache hit between runs
        return [1000 + variant] + [(100 + 7 * i) % 40000 for i in range(n - 1)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    t = time.perf_counter()
    gen.generate(prompt(FIRST_PROMPT, 0), params(FIRST_OUTPUT))
    out["first_request_s"] = time.perf_counter() - t
    if not spec["full"]:
        return out

    decode = []
    for run in range(3):  # the first is a warm-up
        stamps = [time.perf_counter() for _ in gen.stream(prompt(FIRST_PROMPT, 10 + run), params(spec["decode"]))]
        gaps = np.diff(stamps)
        decode.append(len(gaps) / float(gaps.sum()))
    out["decode"] = {"tokens": spec["decode"], "runs_tok_s": decode[1:], "tok_s": statistics.median(decode[1:])}

    n, times = spec["prefill"], []
    for run in range(4):  # two warm-ups: the first compiles, the second is captured
        t = time.perf_counter()
        gen.generate(prompt(n, 20 + run), params(1))
        times.append(time.perf_counter() - t)
    out["prefill"] = {"tokens": n, "runs_s": times[2:], "tok_s": n / statistics.median(times[2:])}

    if levels:
        from bench_throughput import StepRecorder, buckets_used, run_batch, warm_up  # benchmarks/bench_throughput.py

        engine = gen.engine
        warm = sorted({b for k in levels for b in buckets_used(engine, [CONCURRENT_PROMPT] * k, CONCURRENT_OUTPUT)})
        warm_up(engine, warm, log)
        recorder, first = StepRecorder(engine), 30
        out["concurrency"] = {}
        for k in levels:
            for attempt in ("warm", "timed"):  # the first batch compiles what a step of k sequences runs
                prompts = [prompt(CONCURRENT_PROMPT, first + i) for i in range(k)]
                first += k
                row = run_batch(engine, recorder, prompts, CONCURRENT_OUTPUT, f"scale-{k}-{attempt}")
            out["concurrency"][str(k)] = {key: row[key] for key in ("tok_s", "wall_s", "steps", "preemptions")}
    return out


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[str, int, float]:
    """Run cmd to its end: (stdout, its peak resident memory in bytes from os.wait4's rusage, seconds)."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({process.returncode}):\n{stderr.read()[-3000:]}")
        return stdout.read(), usage.ru_maxrss * 1024, seconds  # ru_maxrss is in KiB on Linux


def run_worker(spec: dict, caches: Path) -> dict:
    """One tinyvllm worker process, its program and kernel caches in `caches`; its figures and its peak memory."""
    env = {**os.environ, "TINYVLLM_CACHE_DIR": str(caches / "tinyvllm"), "CACHEDB": str(caches / "cache.db"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    spec = {**spec, "launched_at": time.time()}
    text, peak, seconds = run_measured([sys.executable, __file__, "--worker", json.dumps(spec)], env)
    return {**json.loads(text.strip().splitlines()[-1]), "peak_rss_bytes": peak, "process_s": seconds}


def measure_tinyvllm(path: Path, args) -> dict:
    """The first request with empty caches, then everything in a second process that finds them filled."""
    spec = {"model": str(path), "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
            "concurrency": args.levels, "decode": args.decode_tokens, "prefill": args.prefill_tokens}
    with tempfile.TemporaryDirectory(prefix="bench-scale-caches-") as caches:
        if args.no_cold_start:  # one process, whose caches start empty
            return {**run_worker({**spec, "full": True}, Path(caches)), "cold": None, "compile_s": None}
        log("  tinyvllm: first request with empty caches ...")
        cold = run_worker({**spec, "full": False}, Path(caches))
        log(f"  tinyvllm: load {cold['load_s']:.1f} s, first request {cold['first_request_s']:.1f} s; "
            f"now decode, prefill {args.prefill_tokens}, {args.levels} at once ...")
        warm = run_worker({**spec, "full": True}, Path(caches))
    warm["cold"] = {"load_s": cold["load_s"], "first_request_s": cold["first_request_s"],
                    "peak_rss_bytes": cold["peak_rss_bytes"]}
    warm["compile_s"] = cold["first_request_s"] - warm["first_request_s"]
    return warm


# ---- llama.cpp on the same file ----

def measure_llama_cpp(llama, path: Path, args) -> dict:
    from peers.llama_cpp import parse_batched_bench, parse_bench_json  # benchmarks/peers/

    def tool(name: str, *rest) -> list[str]:
        return [str(llama.bin_dir / name), "-m", str(path), "-t", str(llama.threads), *map(str, rest)]

    log("  llama.cpp: llama-bench ...")
    text, bench_peak, _ = run_measured(tool("llama-bench", "-p", args.prefill_tokens, "-n", args.decode_tokens,
                                            "-r", 3, "-o", "json"))
    bench = parse_bench_json(text)
    out = {"decode": {"tok_s": bench[f"tg{args.decode_tokens}_tok_s"]},
           "prefill": {"tok_s": bench[f"pp{args.prefill_tokens}_tok_s"]}, "llama_bench": bench,
           "peak_rss_bytes": {"llama-bench": bench_peak}, "threads": llama.threads}
    if args.levels:
        log("  llama.cpp: llama-batched-bench ...")
        ctx = max(args.levels) * -(-(CONCURRENT_PROMPT + CONCURRENT_OUTPUT) // 256) * 256  # 256 per sequence
        text, batched_peak, _ = run_measured(tool(
            "llama-batched-bench", "-c", ctx, "-b", 2048, "-ub", 512, "-npp", CONCURRENT_PROMPT,
            "-ntg", CONCURRENT_OUTPUT, "-npl", ",".join(map(str, args.levels)), "--output-format", "jsonl"))
        out["concurrency"] = {str(k): row for k, row in parse_batched_bench(text).items()}
        out["peak_rss_bytes"]["llama-batched-bench"] = batched_peak
    log("  llama.cpp: llama-server start to healthy ...")
    served = type(llama)(llama.bin_dir, {"file": path}, llama.threads)
    cold = served.cold_start("file", repeats=2)
    out["load_s"] = cold["healthy_s"]
    out["first_token_s"] = cold["first_token_s"]
    out["peak"] = max(out["peak_rss_bytes"].values())
    return out


def hardware() -> dict:
    """The machine's read bandwidth and integer dot rates now, with every core (benchmarks/bandwidth.py)."""
    from bandwidth import measure_int8_dot_rate, measure_read_bandwidth

    read = measure_read_bandwidth(threads=[os.cpu_count() or 1])
    return {"threads": next(iter(read["bytes_per_s"])), "bytes_per_s": next(iter(read["bytes_per_s"].values())),
            "int8_products_per_s": measure_int8_dot_rate(iterations=20_000_000)["products_per_s"]}


def layer_weights_by_dot_step(model) -> dict[str, int]:
    """The layers' weights (what every prompt token passes through) by the integer step of the kernel that reads
    them: "vnni" (dpbusd: Q8_0 and the other 32-weight formats, and Q4_K repacked 8 rows at a time) or "k_quants"
    (maddubs then dpwssd: the other super-block formats). Float weights count as "k_quants": none in these files."""
    from tinygrad import Tensor

    out: dict[str, int] = {}
    for layer in model.layers:
        for weight in layer.weights():
            for part in weight if isinstance(weight, tuple) else (weight,):
                if isinstance(part, Tensor) and part.ndim < 2:
                    continue  # norms and biases: not matmuls
                step = "vnni" if getattr(part, "kernel", None) in ("qmatmul", "qmatmul_k_x8") else "k_quants"
                out[step] = out.get(step, 0) + math.prod(part.shape)
    return out


def prefill_ops_per_token(config: ModelConfig) -> int:
    """2 per multiply-add of the linear layers one prompt token passes (the lm_head runs for the last one only)."""
    return 2 * layer_weight_count(config)


def ceiling(fig: dict, config: ModelConfig, runs: list[dict]) -> dict:
    """Each engine's decode as weights streamed per second, against the read bandwidth (the median of the runs
    measured before, between and after the engines: a neighbour's load moves it from one minute to the next), and
    its prefill as integer operations per second, against what the inner dot steps of tinyvllm's kernels for this
    file allow (bandwidth.py's rates, the median likewise): each layer weight's products at its kernel's step rate
    (`layer_weights_by_dot_step`; without VNNI every kernel runs the K-quants' step), summed into seconds per
    token. `int8_ops_per_s` is that mix's rate: 2 operations per product."""
    per_token, bandwidth = fig["tinyvllm"]["weight_bytes_per_token"], statistics.median(r["bytes_per_s"] for r in runs)
    rates = {step: statistics.median(r["int8_products_per_s"].get(step, r["int8_products_per_s"]["k_quants"])
                                     for r in runs) for step in ("vnni", "k_quants")}
    weights = fig["tinyvllm"]["layer_weights_by_dot_step"]
    seconds = sum(n / rates[step] for step, n in weights.items())  # per prompt token
    ops = prefill_ops_per_token(config)
    out = {"weight_bytes_per_token": per_token, "read_bandwidth_runs_bytes_per_s": [r["bytes_per_s"] for r in runs],
           "read_bandwidth_bytes_per_s": bandwidth, "threads": runs[0]["threads"],
           "decode_tok_s_bound": bandwidth / per_token,
           "int8_runs_products_per_s": [r["int8_products_per_s"] for r in runs],
           "int8_steps": {step: {"weights": n, "ops_per_s": 2 * rates[step]} for step, n in weights.items()},
           "int8_ops_per_s": ops / seconds if seconds else 0.0, "prefill_tok_s_bound": 1 / seconds if seconds else 0.0,
           "prefill_ops_per_token": ops}
    dot = out["int8_ops_per_s"]
    for engine in ("tinyvllm", "llama_cpp"):
        if engine in fig:
            streamed = fig[engine]["decode"]["tok_s"] * per_token
            ops = fig[engine]["prefill"]["tok_s"] * out["prefill_ops_per_token"]
            out[engine] = {"decode_bytes_per_s": streamed, "of_read_bandwidth": streamed / bandwidth,
                           "prefill_ops_per_s": ops, "of_int8_ops": ops / out["int8_ops_per_s"] if dot else None}
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    """tinyvllm / llama.cpp: speeds above 1 are ours faster; seconds and memory above 1 are ours larger."""
    out = {"decode": ours["decode"]["tok_s"] / theirs["decode"]["tok_s"],
           "prefill": ours["prefill"]["tok_s"] / theirs["prefill"]["tok_s"],
           "load": ours["load_s"] / theirs["load_s"], "peak_memory": ours["peak_rss_bytes"] / theirs["peak"]}
    for k, row in theirs.get("concurrency", {}).items():
        out[f"concurrency_{k}"] = ours["concurrency"][k]["tok_s"] / row["tok_s"]
    return out


DOT_STEPS = {"vnni": "dpbusd", "k_quants": "maddubs+dpwssd"}


def report(shape: str, fmt: str, fig: dict) -> None:
    ours, theirs, r, c = fig["tinyvllm"], fig.get("llama_cpp"), fig.get("ratio", {}), fig.get("ceiling")
    gib = 2**30

    def row(name, a, b=None, key=None, spec="{:.1f}"):
        cells = [name, spec.format(a)]
        if theirs is not None:
            cells += ["-", "-"] if b is None else [spec.format(b), "-" if key is None else f"{r[key]:.2f}"]
        return cells

    rows = [row(f"decode tok/s ({ours['decode']['tokens']} tokens)", ours["decode"]["tok_s"],
                theirs and theirs["decode"]["tok_s"], "decode"),
            row(f"prefill {ours['prefill']['tokens']} tok/s", ours["prefill"]["tok_s"],
                theirs and theirs["prefill"]["tok_s"], "prefill")]
    for k, level in ours.get("concurrency", {}).items():
        peer = theirs and theirs["concurrency"][k]["tok_s"]
        rows.append(row(f"{k} at once, total tok/s", level["tok_s"], peer, f"concurrency_{k}"))
    rows += [row("load: process start -> ready, s", ours["load_s"], theirs and theirs["load_s"], "load", "{:.2f}"),
             *([] if ours["cold"] is None else [
                 row("first request, empty caches, s", ours["cold"]["first_request_s"], spec="{:.2f}"),
                 row("  of it compiling, s", ours["compile_s"], spec="{:.2f}")]),
             row("peak resident memory, GiB", ours["peak_rss_bytes"] / gib, theirs and theirs["peak"] / gib,
                 "peak_memory", "{:.2f}")]
    if c is not None:
        def streamed(engine):
            return f"{c[engine]['decode_bytes_per_s'] / 1e9:.1f} ({100 * c[engine]['of_read_bandwidth']:.0f}%)"

        def ops(engine):
            share = c[engine]["of_int8_ops"]
            return f"{c[engine]['prefill_ops_per_s'] / 1e9:.0f}" + ("" if share is None else f" ({100 * share:.0f}%)")

        cells = ["decode: weights streamed, GB/s (% of read bandwidth)", streamed("tinyvllm")]
        rows.insert(1, cells + ([streamed("llama_cpp"), "-"] if theirs is not None else []))
        cells = ["prefill: GOP/s (% of the dot steps' bound)", ops("tinyvllm")]
        rows.insert(3, cells + ([ops("llama_cpp"), "-"] if theirs is not None else []))
    headers = side_by_side_headers("workload", "tinyvllm", [FORMATS[fmt]] if theirs is not None else [])
    print(f"\n== {shape} ({fig['params'] / 1e9:.2f}B parameters), {FORMATS.get(fmt, fmt)}, "
          f"file {fig['file_bytes'] / gib:.2f} GiB ==")
    print(table(rows, headers[:2] if theirs is None else headers))
    if c is not None:
        runs = len(c["read_bandwidth_runs_bytes_per_s"])
        steps = ", ".join(f"{DOT_STEPS[step]} {v['ops_per_s'] / 1e9:.0f} GOP/s for {v['weights'] / 1e6:.0f}M weights"
                          for step, v in c["int8_steps"].items())
        print(f"read bandwidth, {c['threads']} threads, this run (median of {runs}): "
              f"{c['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
              f"one token reads {c['weight_bytes_per_token'] / 1e9:.3f} GB of weights, so decode can reach at most "
              f"{c['decode_tok_s_bound']:.1f} tok/s; a prompt token costs {c['prefill_ops_per_token'] / 1e9:.2f} GOP, "
              f"at the dot steps' rates ({steps}) prefill can reach at most {c['prefill_tok_s_bound']:.0f} tok/s")


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)} (default 1b)")
    p.add_argument("--formats", default="q4_k_m,q8_0",
                   help=f"comma-separated, of {', '.join(FORMATS)}, f16 (default q4_k_m,q8_0)")
    p.add_argument("--concurrency", default="16,64", help="requests at once, comma-separated ('' for none)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode run (default 64)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill runs (default 512)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="512MiB", help="tinyvllm's KV cache (default 512MiB)")
    p.add_argument("--no-cold-start", action="store_true",
                   help="skip the process with empty caches (no first-run figure; the measuring one compiles)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "tinyvllm" / "scale"),
                   help="where the made checkpoints are kept (default ~/.cache/tinyvllm/scale)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a tinyvllm measurement process
    add_peers_arg(p)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    shapes, formats = args.shapes.split(","), args.formats.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [f for f in formats if f not in {*FORMATS, "f16"}]
    if unknown:
        p.error(f"unknown shape or format: {', '.join(unknown)}")
    args.levels = [int(k) for k in args.concurrency.split(",") if k.strip()]
    llama = find_peers(args)
    print(f"machine   {machine_description()}")
    # a run of some shapes and formats keeps the figures of the others from the results file it rewrites
    previous = (common.RESULTS_DIR if args.save else common.SCRATCH_DIR) / "bench_scale.json"
    results: dict = {"shapes": json.loads(previous.read_text()).get("shapes", {}) if previous.is_file() else {}}
    for shape in shapes:
        config = SHAPES[shape]
        entry = results["shapes"].setdefault(shape, {"formats": {}})
        entry["config"] = dataclasses.asdict(config)
        for fmt in formats:
            path = model_file(shape, fmt, Path(args.work_dir).expanduser(), llama)
            log(f"{shape} {fmt}: {path.name} ({path.stat().st_size / 2**30:.2f} GiB)")
            fig = {"file": path.name, "file_bytes": path.stat().st_size, "params": config.num_params,
                   "run": {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "code": code_version(),
                           "load_average": [load_average()], "decode_tokens": args.decode_tokens,
                           "prefill_tokens": args.prefill_tokens, "concurrency": args.levels}}
            runs = [hardware()]
            fig["tinyvllm"] = measure_tinyvllm(path, args)
            runs.append(hardware())
            if llama is not None:
                fig["llama_cpp"] = measure_llama_cpp(llama, path, args)
                fig["ratio"] = ratios(fig["tinyvllm"], fig["llama_cpp"])
                runs.append(hardware())
            fig["ceiling"] = ceiling(fig, config, runs)
            fig["run"]["load_average"].append(load_average())
            entry["formats"][fmt] = fig
            report(shape, fmt, fig)
    write_results("bench_scale", results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
