"""llama.cpp, measured in the same run as tinyvllm: the workloads of bench_generate and bench_throughput.

    llama = LlamaCpp.find(peers_dir)              # built by benchmarks/peers/build_llama_cpp.py
    llama.bench("F32", prompt_lens=[32, 128, 512], n_gen=128)
        -> {"tg128_tok_s": ..., "pp32_tok_s": ..., ...}          llama-bench, the twin of bench_generate
    llama.batched_bench("F32", prompt_len=32, output_len=128, concurrency=[1, 32, 64])
        -> {1: {"tok_s": ...}, 32: {...}, ...}                   llama-batched-bench, the twin of bench_throughput
    llama.cold_start("F32")
        -> {"first_token_s": ...}                                llama-server: process start -> first token
    llama.server_decode("Q4_1", prompt, 128, {"llama": {...}})
        -> {"llama": [tok/s per run]}                            llama-server sampling a chain, the twin of
                                                                 bench_sampling
    llama.perplexity("Q4_1", text_file, n_ctx=512)
        -> {"ppl": ..., "chunks": ..., ...}                      llama-perplexity, the twin of bench_quality

Figures from another day or another machine of "the same type" were off by 1.5-2x here, so peers are only
ever compared with tinyvllm inside one run. Formats: "F32" (the float32 weights tinyvllm computes with), "Q8_0",
and "Q4_1" (the file tinyvllm ships and dequantizes at load). Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("F32", "Q8_0", "Q4_1")
SOURCE = "llama.cpp vendored in llama-cpp-python 0.3.36"  # what build_llama_cpp.py builds (the sdist has no git id)
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")
BUILD_COMMAND = "python benchmarks/peers/build_llama_cpp.py {dir}"


# --quantization -> the llama.cpp file of the same kind (auto: the shipped Q4_1 blocks, none: float32 weights)
SAME_FORMAT = {"auto": "Q4_1", "q4_1": "Q4_1", "q8_0": "Q8_0", "none": "F32"}


def result_key(fmt: str) -> str:
    """The results-file key of a format: 'F32' -> 'llama_cpp_f32'."""
    return "llama_cpp_" + fmt.lower()


# ---- parsing the tools' output (pure functions: tests/test_bench_peers.py) ----

def parse_bench_json(text: str) -> dict:
    """llama-bench `-o json` (a list of tests) -> {"pp32_tok_s": .., "pp32_mean_tok_s": .., "tg128_tok_s": .., ...}.

    A test is a prompt-processing test (n_gen 0: "ppN") or a generation test (n_prompt 0: "tgN"). "_tok_s" is the
    median tokens/s of its repetitions (samples_ts), as tinyvllm's runs are summarized: llama.cpp's threads spin
    while they wait for each other, so a burst of other load on a small machine makes a slow outlier that moves
    the mean (avg_ts, kept as "_mean_tok_s" with its "_stddev") far more than the median."""
    out: dict = {}
    for test in json.loads(text):
        if test.get("n_depth", 0):
            continue  # tests at a prefilled depth are not a twin of anything here
        if test["n_gen"] == 0:
            name = f"pp{test['n_prompt']}"
        elif test["n_prompt"] == 0:
            name = f"tg{test['n_gen']}"
        else:
            name = f"pg{test['n_prompt']}_{test['n_gen']}"
        samples = test.get("samples_ts") or [test["avg_ts"]]
        out[f"{name}_tok_s"] = float(statistics.median(samples))
        out[f"{name}_mean_tok_s"] = float(test["avg_ts"])
        out[f"{name}_stddev"] = float(test["stddev_ts"])
        out.setdefault("model_bytes", int(test["model_size"]))
    return out


def parse_batched_bench(text: str) -> dict[int, dict]:
    """llama-batched-bench output, `--output-format jsonl` or its markdown table, -> {B: row} per batch size B.

    Each row: prompt_len, output_len, total_s (prefill + generation), prefill_tok_s, generation_tok_s (its
    own S_TG: generated tokens / generation time), and tok_s = B x output_len / total_s, the generated
    tokens over the whole time: bench_throughput's "total tok/s" counts the same way."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pl"' in line:
            r = json.loads(line)
            pp, tg, b, t, s_pp, s_tg = r["pp"], r["tg"], r["pl"], r["t"], r["speed_pp"], r["speed_tg"]
        elif line.startswith("|") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) != 10 or not cells[0].isdigit():
                continue  # the header
            pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
            s_pp, s_tg, t = float(cells[5]), float(cells[7]), float(cells[8])
        else:
            continue
        rows[int(b)] = {"prompt_len": int(pp), "output_len": int(tg), "total_s": float(t),
                        "prefill_tok_s": float(s_pp), "generation_tok_s": float(s_tg),
                        "tok_s": b * tg / float(t)}
    return rows


def parse_perplexity(text: str) -> dict:
    """llama-perplexity's output (stdout and stderr together) -> {"ppl", "ppl_stderr", "chunks", "n_ctx",
    "chunk_ppl"}: the final estimate, its +/- (the standard error of the mean NLL, scaled to ppl), the chunk
    count and context it announced, and the running perplexity it printed after each chunk ("[3]13.8962,")."""
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
    plan = re.search(r"perplexity over (\d+) chunks, n_ctx=(\d+)", text)
    if final is None or plan is None:
        raise ValueError(f"no perplexity in llama-perplexity's output:\n{text[-2000:]}")
    return {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2)), "chunks": int(plan.group(1)),
            "n_ctx": int(plan.group(2)), "chunk_ppl": [float(v) for v in re.findall(r"\[\d+\]([\d.]+),", text)]}


def read_logits_file_tokens(path: str | Path) -> list[int]:
    """The token ids at the head of a `llama-perplexity --kl-divergence-base FILE`: the tokens its chunks were
    cut from. Layout: b"_logits_", n_ctx, n_vocab, n_chunk (int32 each), then n_chunk * n_ctx int32 token ids."""
    with open(path, "rb") as f:
        magic, (n_ctx, _, n_chunk) = f.read(8), struct.unpack("<3i", f.read(12))
        if magic != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file (starts {magic!r})")
        return list(struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk)))


def median_run(runs: list[dict]) -> dict:
    """Of several runs of one batched-bench row, the one with the median tok/s (the lower middle of an even
    count), with every run's tok/s beside it: one burst of other load on a small machine can cut one run's
    speed several times over (llama.cpp's threads spin while they wait for each other)."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tok_s": [r["tok_s"] for r in runs]}


# ---- the tools ----

def free_port() -> int:
    with socket.socket() as s:  # released just before the server takes it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path
    models: dict  # format -> .gguf path
    threads: int = os.cpu_count() or 1

    @classmethod
    def find(cls, peers_dir: str | Path) -> LlamaCpp:
        """The binaries and model files that build_llama_cpp.py left in peers_dir; SystemExit naming the build
        command if any is missing."""
        from tinyvllm.model.weights import default_model_path

        root = Path(peers_dir).expanduser().resolve()
        bin_dir = root / "llama.cpp" / "build" / "bin"
        shipped = default_model_path()
        stem = shipped.name.removesuffix(".gguf").removesuffix(".Q4_1")
        models = {"F32": root / "models" / f"{stem}.F32.gguf", "Q8_0": root / "models" / f"{stem}.Q8_0.gguf",
                  "Q4_1": shipped}
        missing = [str(bin_dir / t) for t in TOOLS if not (bin_dir / t).is_file()]
        missing += [str(p) for p in models.values() if not p.is_file()]
        if missing:
            raise SystemExit(f"--peers {peers_dir}: llama.cpp is not built there (missing {', '.join(missing)}).\n"
                             f"Build it first (~12 min on 2 cores, cached after): "
                             f"{BUILD_COMMAND.format(dir=peers_dir)}")
        return cls(bin_dir, models)

    def _run(self, tool: str, fmt: str, *args) -> str:
        cmd = [str(self.bin_dir / tool), "-m", str(self.models[fmt]), "-t", str(self.threads), *map(str, args)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        return r.stdout

    def bench(self, fmt: str, prompt_lens: list[int], n_gen: int, repetitions: int = 5) -> dict:
        """llama-bench: prefill of each prompt length (ppN) and generation of n_gen tokens (tgN), greedy,
        `repetitions` times each; the mean tokens/s of each test."""
        text = self._run("llama-bench", fmt, "-p", ",".join(map(str, prompt_lens)), "-n", n_gen,
                         "-r", repetitions, "-o", "json")
        return parse_bench_json(text)

    def batched_bench(self, fmt: str, prompt_len: int, output_len: int, concurrency: list[int]) -> dict[int, dict]:
        """llama-batched-bench: B sequences of prompt_len random tokens prefilled together, then output_len
        decode steps of B tokens each, for every B in concurrency."""
        per_seq = -(-(prompt_len + output_len) // 256) * 256  # llama.cpp pads a sequence's context to 256
        ctx = max(concurrency) * per_seq
        text = self._run("llama-batched-bench", fmt, "-c", ctx, "-b", 2048, "-ub", 512, "-npp", prompt_len,
                         "-ntg", output_len, "-npl", ",".join(map(str, concurrency)), "--output-format", "jsonl")
        rows = parse_batched_bench(text)
        assert set(rows) == set(concurrency), f"llama-batched-bench skipped some batch sizes: {sorted(rows)}"
        return rows

    def cold_start(self, fmt: str, prompt: str = "The capital of France is", repeats: int = 3) -> dict:
        """llama-server from Popen to the reply of one /completion of one token (median of `repeats` starts).

        The model file is in the OS page cache after the first start, as tinyvllm's is in bench_generate."""
        runs = [self._one_cold_start(fmt, prompt) for _ in range(repeats)]
        return {"first_token_s": statistics.median(r["first_token_s"] for r in runs),
                "healthy_s": statistics.median(r["healthy_s"] for r in runs), "runs": runs}

    def server_decode(self, fmt: str, prompt: str, n_predict: int, chains: dict[str, dict],
                      repeats: int = 3) -> dict[str, list[float]]:
        """llama-server (one slot) generating n_predict tokens (ignore_eos) after `prompt` with each chain's
        /completion sampling fields (benchmarks/sampling_chains.llama_server_fields), the chains taking turns
        `repeats` times, run r seeded r: {chain: [its own generation speed, timings.predicted_per_second, per run]}.
        The twin of tinyvllm's sampled decode (bench_sampling)."""
        runs: dict[str, list[float]] = {name: [] for name in chains}
        with self.server(fmt) as url:
            body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False}
            http_json(f"{url}/completion", {**body, "n_predict": 8, "temperature": 0})  # warm-up
            for r in range(repeats):
                for name, fields in chains.items():
                    reply = http_json(f"{url}/completion", {**body, **fields, "seed": r}, timeout=600)
                    runs[name].append(float(reply["timings"]["predicted_per_second"]))
        return runs

    def _one_cold_start(self, fmt: str, prompt: str) -> dict:
        start = time.perf_counter()
        with self.server(fmt) as url:
            healthy = time.perf_counter() - start
            reply = http_json(f"{url}/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                    "cache_prompt": False})
            first_token = time.perf_counter() - start
        return {"healthy_s": healthy, "first_token_s": first_token, "text": reply.get("content", "")}

    def perplexity(self, model: str | Path, text_file: str | Path, n_ctx: int = 512, chunks: int | None = None,
                   tokens: bool = False) -> dict:
        """llama-perplexity on a format of `models` or a .gguf path: the text cut into chunks of n_ctx tokens, each
        evaluated from scratch, the second half of each scored (parse_perplexity's fields, plus "seconds").
        tokens=True also returns the token ids the chunks were cut from ("tokens"), read back from a logits
        file written for the purpose (~50 MB per chunk, deleted after)."""
        tool = self.bin_dir / "llama-perplexity"
        if not tool.is_file():
            raise SystemExit(f"{tool} is missing: rebuild with {BUILD_COMMAND.format(dir=self.bin_dir.parents[2])}")
        path = self.models.get(model, model)
        cmd = [str(tool), "-m", str(path), "-t", str(self.threads), "-f", str(text_file), "-c", str(n_ctx)]
        cmd += [] if chunks is None else ["--chunks", str(chunks)]
        with tempfile.TemporaryDirectory() as tmp:
            logits_file = Path(tmp) / "base.kld"
            cmd += ["--kl-divergence-base", str(logits_file)] if tokens else []
            start = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
            out = {**parse_perplexity(r.stdout + r.stderr), "seconds": seconds, "file": Path(path).name}
            if tokens:
                out["tokens"] = read_logits_file_tokens(logits_file)
        return out

    def quantize(self, source: str | Path, out: Path, qtype: str, pure: bool = False) -> Path:
        """`out`, made once by llama-quantize from a format of `models` or a .gguf path (cached: an existing
        file is kept). qtype as llama-quantize spells it ("Q4_K_M", "Q4_0"); pure: every tensor in that type,
        no k-quant mixture and no Q6_K output tensor."""
        if out.is_file():
            return out
        tmp = out.with_suffix(".partial")
        cmd = [str(self.bin_dir / "llama-quantize"), "--allow-requantize", *(["--pure"] if pure else []),
               str(self.models.get(source, source)), str(tmp), qtype, str(self.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        tmp.rename(out)
        return out

    @contextmanager
    def server(self, fmt: str, context: int = 2048, parallel: int = 1, extra: tuple[str, ...] = ()) -> Iterator[str]:
        """A llama-server on a free port of 127.0.0.1, healthy when the block starts (its URL), stopped after.
        extra: more llama-server arguments (e.g. ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"))."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [str(self.bin_dir / "llama-server"), "-m", str(self.models[fmt]), "-t", str(self.threads),
               "--host", "127.0.0.1", "--port", str(port), "-c", str(context), "-np", str(parallel), *extra]
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {process.returncode}: {' '.join(cmd)}")
                if time.perf_counter() - start > 120:
                    raise RuntimeError("llama-server did not become healthy within 120 s")
                try:
                    http_json(f"{url}/health", timeout=1)
                    break
                except (urllib.error.URLError, ConnectionError, OSError):
                    time.sleep(0.005)  # not listening yet, or 503 while the model loads
            yield url
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
