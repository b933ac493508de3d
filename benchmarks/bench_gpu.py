"""tinyvllm on a GPU against HF transformers on the same GPU, in one run of under ten minutes.

    DEV=CUDA python benchmarks/bench_gpu.py --peers hf      # a GPU machine: benchmarks/results/bench_gpu_cuda.json
    python benchmarks/bench_gpu.py --model DIR --concurrency 1,2 --output-len 4 ...    # anywhere, tiny sizes

The workload of docs/phases/05b-gpu.md: N requests at once, each `--prompt-len` (32) prompt token ids and
`--output-len` (128) greedy tokens (ignore_eos), for N in `--concurrency` (1, 64, 256); total tok/s = N x
output_len / the batch's wall time, prefill included. Three engine configurations, one after the other
(bench_throughput.py's `run_engine`: every token bucket the runs reach is compiled and captured first):

    auto      --quantization auto: the GGUF's Q4_1/Q8_0 blocks through the quantized matmul kernels; --dtype auto
    none      --quantization none: float32 weights and compute
    float16   --quantization none --dtype float16

For each: the rows by N, single-stream decode (one request alone: 1000 / its TPOT in ms, prefill left out), and a
step profile at the largest N: the mean ms per decode step by phase (engine/step_timer.py, which waits for the
device before each reading), so that the host's share of a GPU step is in the results.

`--peers hf`: HF transformers runs the same prompts (the same token ids) on the same device, in a process of its
own (torch and tinygrad each hold a CUDA context; neither sees the other's memory pool): the model as HF loads
it from the same checkpoint (a GGUF dequantized to float32), eager, `generate` greedy with exactly output_len new
tokens, one warm-up call per N first. Each tinyvllm configuration gets its ratio to HF at every N.

`--time-budget-s` (540): a configuration that would start after that many seconds is skipped and named in the
results, so one run ends in time on a slow first compile; the figures it did measure stay. A configuration (or the
peer) that fails is recorded under "failed" and the rest still run; the results file is written after each one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # (benchmarks/common.py)
    ROOT, BenchParser, code_version, log, machine_description, table, write_results)
from sampling_chains import add_sampling_arg

CONFIGS = {  # name -> (--quantization, --dtype)
    "auto": ("auto", "auto"),
    "none": ("none", "float32"),
    "float16": ("none", "float16"),
}


def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,64,256", help="comma-separated numbers of requests at once")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--configs", default="auto,none,float16", help=f"which of {', '.join(CONFIGS)} (default all)")
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the engine's token budget per step")
    p.add_argument("--max-model-len", type=int, default=2048, help="above the largest token bucket (warm-up prompts)")
    p.add_argument("--kv-cache-memory", default="4GiB",
                   help="KV cache per engine (default 4GiB: 256 x 160 tokens in float32 fit; a fixed budget keeps "
                   "the three engines of the run alike)")
    # greedy alone by default: the ten minutes of a GPU run go to the three configurations; the HF peer decodes greedy
    add_sampling_arg(p, default="greedy")
    p.add_argument("--peers", default=None, choices=["hf"], help="hf: HF transformers on the same device, same run")
    p.add_argument("--time-budget-s", type=float, default=540.0,
                   help="no configuration starts after this many seconds (default 540)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)  # internal: the HF peer's own process
    return p


def engine_args(args: argparse.Namespace, dtype: str) -> argparse.Namespace:
    """The options bench_throughput.run_engine reads: no one-by-one runs (the ratio here is to HF)."""
    return argparse.Namespace(model=args.model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                              max_num_batched_tokens=args.max_num_batched_tokens, prompt_len=args.prompt_len,
                              output_len=args.output_len, one_by_one=0, portable_attention=False, dtype=dtype,
                              sampling=args.sampling)


def run_tinyvllm(args: argparse.Namespace, levels: list[int], name: str) -> dict:
    from bench_throughput import run_engine

    quantization, dtype = CONFIGS[name]
    start = time.perf_counter()
    _, (rows, _, info) = run_engine(engine_args(args, dtype), levels, quantization, profile=True)
    single = rows.get(1)
    return {"quantization": quantization, "dtype": info["dtype"], "device": info["device"], "weights": info["weights"],
            "num_blocks": info["num_blocks"], "step_profile": info["step_profile"],
            "single_stream_decode_tok_s": None if single is None else 1e3 / single["tpot_ms"]["p50"],
            "concurrency": {str(n): {k: r[k] for k in ("tok_s", "wall_s", "steps", "ttft_ms", "tpot_ms",
                                                        "decode_step_ms", "preemptions")} for n, r in rows.items()},
            "seconds": time.perf_counter() - start}


def workload_prompts(args: argparse.Namespace, n: int) -> list[list[int]]:
    """The prompts' token ids, as bench_throughput makes them, from the checkpoint's tokenizer."""
    from bench_throughput import TEXT

    from tinyvllm.model.tokenizer import load_tokenizer
    from tinyvllm.model.weights import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    tokenizer = load_tokenizer(path)
    body = tokenizer.encode(TEXT * (args.prompt_len // 20 + 1))
    return [(tokenizer.encode(f"Request {i}:") + body)[:args.prompt_len] for i in range(n)]


# ---- HF transformers, the same-run peer, in its own process ----

def torch_device(tinygrad_device: str) -> str:
    kind = tinygrad_device.split(":")[0].upper()
    return {"CUDA": "cuda", "NV": "cuda", "METAL": "mps", "AMD": "cuda"}.get(kind, "cpu")


def hf_worker(spec_path: str) -> None:
    """Run by `--hf-worker SPEC`: HF transformers' throughput on the spec's prompts; JSON on stdout."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    device, output_len = spec["device"], spec["output_len"]
    model_path = Path(spec["model"])
    if model_path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model = model.to(device).eval()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        elif device == "mps":
            torch.mps.synchronize()

    def generate(ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    rows = {}
    for n in spec["levels"]:
        ids = torch.tensor(spec["prompts"][:n], dtype=torch.long, device=device)  # (n, prompt_len): no padding
        generate(ids, min(8, output_len))  # warm-up: kernels, cuBLAS handles, caches
        sync()
        start = time.perf_counter()
        out = generate(ids, output_len)
        sync()
        wall = time.perf_counter() - start
        assert out.shape == (n, ids.shape[1] + output_len), f"HF generated {tuple(out.shape)}"
        rows[str(n)] = {"tok_s": n * output_len / wall, "wall_s": wall}
    print(json.dumps({"engine": "HF transformers", "version": __import__("transformers").__version__,
                      "torch": torch.__version__, "device": device, "dtype": "float32", "attention": "eager",
                      "concurrency": rows}))


def run_hf(args: argparse.Namespace, levels: list[int], device: str) -> dict:
    from tinyvllm.model.weights import default_model_path

    spec = {"model": str(Path(args.model) if args.model else default_model_path()), "levels": levels,
            "prompts": workload_prompts(args, max(levels)), "output_len": args.output_len,
            "device": torch_device(device)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, __file__, "--hf-worker", f.name], capture_output=True, text=True,
                              env=env, timeout=max(60.0, args.time_budget_s))
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"the HF transformers peer failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the run ----

def report(results: dict, levels: list[int]) -> None:
    hf = results.get("peers", {}).get("hf")
    headers = ("configuration", *(f"N={n} tok/s" for n in levels), "decode 1 stream", "step at max N ms")
    rows = []
    for name, r in results["tinyvllm"].items():
        cells = []
        for n in levels:
            ours = r["concurrency"][str(n)]["tok_s"]
            cells.append(f"{ours:.0f}" + (f" ({ours / hf['concurrency'][str(n)]['tok_s']:.1f}x HF)" if hf else ""))
        single = r["single_stream_decode_tok_s"]
        rows.append((f"tinyvllm {name} ({r['dtype']})", *cells, "-" if single is None else f"{single:.0f}",
                     f"{r['step_profile']['total_ms']:.1f}"))
    if hf:
        rows.append((f"HF transformers fp32 eager ({hf['device']})",
                     *(f"{hf['concurrency'][str(n)]['tok_s']:.0f}" for n in levels), "-", "-"))
    print(table(rows, headers))
    for name, r in results["tinyvllm"].items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["step_profile"]["ms_per_step"].items())
        print(f"step profile, tinyvllm {name}, {r['step_profile']['batch']} rows: {phases} ms")
    if results["skipped"]:
        print(f"skipped (time budget): {', '.join(results['skipped'])}")
    for name, why in results.get("failed", {}).items():
        print(f"failed: {name}: {why.splitlines()[-1] if why else ''}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_worker:
        hf_worker(args.hf_worker)
        return 0
    start = time.perf_counter()
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    from tinygrad import Device

    device = Device.DEFAULT
    results: dict = {"device": device, "code": code_version(), "machine": machine_description(),
                     "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len, "concurrency": levels},
                     "tinyvllm": {}, "skipped": []}
    for name in names:
        if time.perf_counter() - start > args.time_budget_s:
            results["skipped"].append(name)
            continue
        log(f"tinyvllm {name} on {device} ...")
        try:  # one run on a lent GPU: a configuration that fails is recorded, and the others still run
            results["tinyvllm"][name] = run_tinyvllm(args, levels, name)
        except Exception as e:
            log(f"tinyvllm {name} failed: {type(e).__name__}: {e}")
            results["failed"] = {**results.get("failed", {}), name: f"{type(e).__name__}: {e}"}
        write_results("bench_gpu", results, args)  # what is measured so far, should the run be cut short
    if args.peers == "hf":
        log(f"HF transformers on the same device ({torch_device(device)}) ...")
        try:
            results["peers"] = {"hf": run_hf(args, levels, device)}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"HF transformers failed: {e}")
            results["failed"] = {**results.get("failed", {}), "hf": str(e)[-2000:]}
        else:
            hf = results["peers"]["hf"]["concurrency"]
            for r in results["tinyvllm"].values():
                r["hf_ratio"] = {str(n): r["concurrency"][str(n)]["tok_s"] / hf[str(n)]["tok_s"] for n in levels}
    results["seconds"] = time.perf_counter() - start
    report(results, levels)
    write_results("bench_gpu", results, args, also=args.json)
    return 1 if results.get("failed") else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
