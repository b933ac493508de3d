"""The speed check to run before closing any issue that touches speed: the same-run ratios that matter, against
the last committed check, and what dropped.

    .venv/bin/python benchmarks/check_speed.py --peers DIR            # prints the table; exit 1 if a ratio dropped
    .venv/bin/python benchmarks/check_speed.py --peers DIR --save     # and commit benchmarks/results/check_speed.json

Each figure is a ratio measured within this run (tinyvllm / llama.cpp on the same file, sampled / greedy,
speculation on / off, 64 requests at once / one alone), so it can be compared with an earlier day's run on a
machine whose speed varies 3x from day to day; the absolute tok/s are printed beside them for reference only.
It runs bench_generate (per format), bench_speculative (ngram) and bench_throughput (64 at once) with short
settings, their results files written to a scratch folder, never over benchmarks/results/. Not a test: a noisy
machine can drop a ratio by 10%, so a drop is a reason to rerun and look, not a verdict.
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

from common import RESULTS_DIR, ROOT, log, table, write_results
from peers.llama_cpp import SAME_FORMAT, result_key

HERE = Path(__file__).resolve().parent


def run_bench(script: str, args: list[str], scratch: Path, timeout: int) -> dict:
    """Run benchmarks/<script> with its results folder set to `scratch`; the results document it wrote."""
    env = {**os.environ, "TINYVLLM_RESULTS_DIR": str(scratch), "PYTHONPATH": str(ROOT)}
    for old in scratch.iterdir():
        old.unlink()
    log(f"running {script} {' '.join(args)}")
    done = subprocess.run([sys.executable, str(HERE / script), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    written = sorted(scratch.glob(f"{script.removesuffix('.py')}*.json"))
    if len(written) != 1:
        raise SystemExit(f"{script} wrote {[p.name for p in written]} in its results folder: expected one file")
    return json.loads(written[0].read_text())


def generate_figures(fmt: str, peers: str | None, scratch: Path) -> dict[str, float]:
    args = ["-q", fmt, "--prompt-lens", "512", "--prefill-repeats", "2", "--decode-runs", "2",
            "--max-tokens", "64", "--sampling", "greedy,llama"]
    doc = run_bench("bench_generate.py", args + (["--peers", peers] if peers else []), scratch, timeout=900)
    figures = {f"{fmt}: decode tok/s": doc["decode"]["tok_s"],
               f"{fmt}: prefill 512 tok/s": doc["prefill"]["512"]["tok_s"]}
    sampled = doc.get("decode_sampled", {}).get("llama")
    if sampled:
        figures[f"{fmt}: sampled / greedy decode"] = sampled["tok_s"] / doc["decode"]["tok_s"]
    same = SAME_FORMAT.get(fmt)
    peer = doc.get("peers", {}).get(result_key(same), {}).get("tinyvllm_ratio", {}) if same else {}
    for name, label in ((next((k for k in peer if k.startswith("tg")), None), "decode"), ("pp512", "prefill 512")):
        if name and peer.get(name) is not None:
            figures[f"{fmt}: {label} / llama.cpp"] = peer[name]
    return figures


def speculation_figures(scratch: Path) -> dict[str, float]:
    doc = run_bench("bench_speculative.py", ["--parts", "ngram", "--repeats", "2"], scratch, timeout=900)
    figures = {}
    for w in doc["ngram"]["workloads"]:
        if not w["identical"]:
            raise SystemExit(f"speculation changed the greedy output of {w['name']}: {w['first_difference']}")
        figures[f"ngram k={doc['num_speculative_tokens']}, {w['name']}: on / off"] = w["speedup"]
    return figures


def batch_figures(scratch: Path) -> dict[str, float]:
    doc = run_bench("bench_throughput.py", ["--concurrency", "64", "--output-len", "64"], scratch, timeout=900)
    level = doc["concurrency"]["64"]
    return {"64 at once: tok/s": level["tok_s"], "64 at once / one by one": level["speedup"]}


def compare(now: dict[str, float], before: dict[str, float], tolerance: float) -> tuple[list[list[str]], list[str]]:
    """The table rows, and the ratios that fell more than `tolerance` below the earlier run (tok/s never count:
    they move with the machine)."""
    rows, dropped = [], []
    for name, value in now.items():
        old = before.get(name)
        change = None if not old else value / old
        is_ratio = "tok/s" not in name
        flag = ""
        if is_ratio and change is not None and change < 1 - tolerance:
            flag = "DROP"
            dropped.append(name)
        rows.append([name, "-" if old is None else f"{old:.3g}", f"{value:.3g}",
                     "-" if change is None else f"{change:.2f}x", flag if is_ratio else "(for reference)"])
    return rows, dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", metavar="DIR", default=None,
                   help="llama.cpp built there (benchmarks/peers/build_llama_cpp.py DIR); without it no "
                        "tinyvllm / llama.cpp ratio is measured")
    p.add_argument("--formats", default="auto,q8_0", help="--quantization values to run bench_generate with")
    p.add_argument("--parts", default="generate,speculation,batch", help="comma-separated: generate, speculation, "
                                                                        "batch")
    p.add_argument("--tolerance", type=float, default=0.10, help="a ratio this far below the last check is a drop")
    p.add_argument("--against", type=Path, default=RESULTS_DIR / "check_speed.json",
                   help="the earlier check to compare with (default: the committed one)")
    p.add_argument("--save", action="store_true", help="write benchmarks/results/check_speed.json")
    args = p.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"generate", "speculation", "batch"})
    if unknown:
        p.error(f"--parts: unknown {unknown}; the parts are generate, speculation, batch")

    started = time.monotonic()
    now: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="check_speed-") as folder:
        scratch = Path(folder)
        if "generate" in parts:
            for fmt in args.formats.split(","):
                now.update(generate_figures(fmt, args.peers, scratch))
        if "speculation" in parts:
            now.update(speculation_figures(scratch))
        if "batch" in parts:
            now.update(batch_figures(scratch))
    before = json.loads(args.against.read_text()).get("figures", {}) if args.against.exists() else {}
    rows, dropped = compare(now, before, args.tolerance)
    print(f"\n== speed check: this run against {args.against.name if before else 'nothing (no earlier check)'} ==")
    print(table(rows, ("figure", "before", "now", "now / before", "")))
    print(f"{len(dropped)} ratio(s) dropped by more than {args.tolerance:.0%}" + (f": {', '.join(dropped)}" if dropped
                                                                                 else "") +
          f"; {time.monotonic() - started:.0f} s")
    if args.save:
        write_results("check_speed", {"figures": now, "dropped": dropped}, args)
    sys.exit(1 if dropped else 0)


if __name__ == "__main__":
    main()
