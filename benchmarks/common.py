"""What every benchmark prints about the run: the machine, its load, the code measured, and plain tables.

Imported by the bench_*.py scripts (run as `python benchmarks/<script>.py`, which puts this folder on
sys.path). It imports nothing heavy, so bench_generate.py can use it before tinygrad is imported.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. '0.88 1.18 1.26' ('n/a' where the OS has none)."""
    return "%.2f %.2f %.2f" % os.getloadavg() if hasattr(os, "getloadavg") else "n/a"


def machine_description(with_load: bool = True) -> str:
    """e.g. 'AMD EPYC, 2 logical CPUs, load average 0.88 1.18 1.26'."""
    text = f"{cpu_name()}, {os.cpu_count()} logical CPUs"
    return text + f", load average {load_average()}" if with_load else text


def code_version() -> str:
    """The commit measured, and whether the engine's code (tinyvllm/, kernels/) has uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "tinyvllm", "kernels"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{ROOT} (not a git checkout)"
    return head + (" (with uncommitted changes in tinyvllm/ or kernels/)" if dirty else "")


def table(rows: list[tuple], headers: tuple) -> str:
    """Rows under headers, the first column left-aligned and the others right-aligned, a rule under the headers."""
    cells = [tuple(str(c) for c in headers)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def log(*parts) -> None:
    """Progress lines, to stderr: stdout keeps only the results."""
    print(*parts, file=sys.stderr, flush=True)


def add_engine_args(p: argparse.ArgumentParser, *, max_num_batched_tokens: int, kv_cache_memory: str,
                    max_model_len: int) -> None:
    """The LLMEngine flags of the engine benchmarks (bench_throughput, bench_latency), with each one's defaults."""
    p.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"the engine's token budget per step (default {max_num_batched_tokens})")
    p.add_argument("--kv-cache-memory", default=kv_cache_memory, help=f"KV cache budget (default {kv_cache_memory})")
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--portable-attention", action="store_true",
                   help="attention by the portable block-table gather instead of the paged-attention kernels")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON (to stdout without a PATH)")
