"""What every benchmark prints and writes about the run: the machine, its load, the code measured, plain tables,
`--peers` (llama.cpp in the same run, benchmarks/peers/) and the results file benchmarks/results/<name>.json.

Imported by the bench_*.py scripts (run as `python benchmarks/<script>.py`, which puts this folder on
sys.path). It imports nothing heavy, so bench_generate.py can use it before tinygrad is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
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


def first_output_s(cmd: list[str]) -> float:
    """Seconds from starting `cmd` to the first byte it writes to stdout (its first token, for main.py), the way
    llama-server's start is timed (benchmarks/peers/llama_cpp.py): Popen to the reply. The process runs to its end."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: whatever it logs first, it cannot block on it
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        process.stdout.read(1)
        seconds = time.perf_counter() - start
        process.communicate()
        if process.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({process.returncode}):\n{err.read().decode()[-3000:]}")
    return seconds


def layer_weight_count(config) -> int:
    """The weights of a model's layers (attention and MLP): its parameters less the embedding table (and an untied
    lm_head) and the norms; every token runs each of them once."""
    d = config.hidden_size
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return config.num_params - embeddings - (2 * config.num_hidden_layers + 1) * d


def kernel_cache_state() -> str:
    """What the kernel caches hold before a run, for its results file: the size of tinygrad's compiled-kernel
    database and the number of tinyvllm's lowered programs and captured graphs."""
    path = Path(os.environ.get("CACHEDB") or Path.home() / ".cache" / "tinygrad" / "cache.db")
    if sys.platform == "darwin" and "CACHEDB" not in os.environ:
        path = Path.home() / "Library" / "Caches" / "tinygrad" / "cache.db"
    if not path.exists():
        state = f"empty (no {path.name} yet): kernels are compiled in this run"
    else:
        state = f"{path.stat().st_size / 2**20:.0f} MiB on disk before this run (kernels seen before load from it)"
    from tinyvllm.disk_cache import cache_root  # no tinygrad: it may not be imported yet

    cache_dir = cache_root()
    n = {kind: sum(f.name.endswith(suffix) for d in os.scandir(cache_dir) if d.name.startswith(kind) and d.is_dir()
                   for f in os.scandir(d.path))  # by name: a glob's Path per file, thousands, before the clock stops
         for kind, suffix in (("programs-", ".pkl"), ("graphs-", ".graph"))} if cache_dir.is_dir() else {}
    return state + f"; tinyvllm program cache {n.get('programs-', 0)} programs, {n.get('graphs-', 0)} captured graphs"


def add_engine_args(p: argparse.ArgumentParser, *, max_num_batched_tokens: int, kv_cache_memory: str,
                    max_model_len: int) -> None:
    """The LLMEngine flags of the engine benchmarks (bench_throughput, bench_latency), with each one's defaults."""
    p.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"the engine's token budget per step (default {max_num_batched_tokens})")
    p.add_argument("--kv-cache-memory", default=kv_cache_memory, help=f"KV cache budget (default {kv_cache_memory})")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--portable-attention", action="store_true",
                   help="attention by the portable block-table gather instead of the paged-attention kernels")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the results as JSON (to stdout without a PATH)")


# ---- peers measured in the same run, and the results files ----

# A run writes its results to SCRATCH_DIR; with --save, to RESULTS_DIR, the tracked files the docs quote.
# TINYVLLM_RESULTS_DIR: another folder for both (check_speed.py runs the benchmarks into a scratch one).
RESULTS_DIR = Path(os.environ.get("TINYVLLM_RESULTS_DIR") or ROOT / "benchmarks" / "results")
SCRATCH_DIR = Path(os.environ.get("TINYVLLM_RESULTS_DIR") or ROOT / ".bench-results")


class BenchParser(argparse.ArgumentParser):
    """A benchmark's command line: its own flags, plus `--save`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--save", action="store_true",
                          help="write the results into benchmarks/results/ (the files the docs quote); without it, "
                               "into .bench-results/")

    # TINYVLLM_CHECK_FLAGS=1: parse, say so and exit (tests/test_doc_commands.py checks the docs' commands)
    strict = False  # inside parse_args, which reports unknown flags after its parse_known_args returns

    def parse_args(self, args=None, namespace=None):
        self.strict = True
        try:
            parsed = super().parse_args(args, namespace)
        finally:
            self.strict = False
        return self._checked(parsed)

    def parse_known_args(self, args=None, namespace=None):
        parsed = super().parse_known_args(args, namespace)
        return parsed if self.strict else self._checked(parsed)

    @staticmethod
    def _checked(parsed):
        if os.environ.get("TINYVLLM_CHECK_FLAGS"):
            print("flags accepted")
            sys.exit(0)
        return parsed
LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None  # when the bench script imported this


def add_peers_arg(p: argparse.ArgumentParser) -> None:
    """`--peers DIR`: measure llama.cpp (built there by benchmarks/peers/build_llama_cpp.py) in the same run."""
    p.add_argument("--peers", metavar="DIR", default=None,
                   help="also run llama.cpp's twin of this workload in the same run (build it into DIR first: "
                   "python benchmarks/peers/build_llama_cpp.py DIR); without it no peer figure is printed")


def find_peers(args: argparse.Namespace):
    """The LlamaCpp found in --peers DIR (SystemExit naming the build command if it is not built), or None."""
    if args.peers is None:
        return None
    from peers.llama_cpp import LlamaCpp  # benchmarks/peers/

    return LlamaCpp.find(args.peers)


def side_by_side_headers(first: str, ours: str, formats) -> tuple[str, ...]:
    """Column headers of a tinyvllm-beside-llama.cpp table: ours, then each llama.cpp format and its ratio."""
    return (first, ours, *(cell for fmt in formats for cell in (f"llama.cpp {fmt}", "ratio")))


def no_peer_twin(args: argparse.Namespace, why: str) -> None:
    """The one line a script whose workload llama.cpp has no twin for prints under --peers."""
    if args.peers is not None:
        print(f"--peers: no llama.cpp figure here: {why}")


def machine_info() -> dict:
    """The machine, for a results file: CPU, cores, memory, the vector extensions that matter to the kernels."""
    flags, mem_gib = set(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal"))
        mem_gib = round(mem_kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "memory_gib": mem_gib,
            "vector_extensions": sorted(flags & {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "neon"}),
            "platform": platform.platform(), "python": platform.python_version()}


def recorded_options(options: argparse.Namespace | dict) -> dict:
    """The options as a results file keeps them: a --peers directory and a --json copy by their names only (where
    llama.cpp was built, or where a copy went, on one machine says nothing about the figures)."""
    recorded = dict(vars(options) if isinstance(options, argparse.Namespace) else options)
    for key in ("peers", "json_path"):
        if recorded.get(key) and recorded[key] != "-":
            recorded[key] = Path(recorded[key]).name
    return recorded


def synchronize() -> None:
    """Wait for tinygrad's default device to finish what it was given: a timer around a GPU kernel launch must, or it
    measures the launch (on the CPU the kernels have run when the call returns, and this returns at once)."""
    from tinygrad import Device

    Device[Device.DEFAULT].synchronize()


def device_suffix() -> str:
    """'' on the CPU device, '_cuda' (or '_metal', ...) where the run used tinygrad's default GPU: a GPU run's results
    go beside the CPU's (bench_generate_cuda.json), never over them. Asked at write time, when tinygrad is loaded."""
    from tinygrad import Device

    kind = Device.DEFAULT.split(":")[0].lower()
    return "" if kind == "cpu" else f"_{kind}"


def write_results(name: str, figures: dict, options: argparse.Namespace | dict, also: str | None = None) -> Path:
    """<name>.json in benchmarks/results/ with --save (options.save), else in .bench-results/: when, where, which
    code, with which options, then the figures.

    The figures' keys are what docs quote (e.g. {"decode": {"tok_s": ..}, "peers": {"llama_cpp_f32": ..}}):
    keep them stable. `also`: a second path to write the same document to ("-": stdout). On a GPU the name gets
    the device's suffix (`device_suffix`)."""
    name += device_suffix()
    head = code_version().split()[0]
    doc = {"bench": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "commit": head,
           "engine_code_dirty": "uncommitted" in code_version(), "machine": machine_info(),
           "load_average": {"start": list(LOAD_AT_START or []), "end": list(os.getloadavg())
                            if hasattr(os, "getloadavg") else []},
           "options": recorded_options(options)}
    doc.update(figures)
    text = json.dumps(doc, indent=2, default=str) + "\n"
    saved = options.get("save") if isinstance(options, dict) else getattr(options, "save", False)
    folder = RESULTS_DIR if saved else SCRATCH_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(text)
    if also == "-":
        print(text, end="")
    elif also:
        Path(also).write_text(text)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    log(f"results written to {shown}" + (f" and {also}" if also and also != "-" else ""))
    return path
