"""The sampling settings the benchmarks decode with: greedy, and what users actually send.

Almost nobody serves greedy: the OpenAI API's default temperature is 1, chat clients send top_p, and llama.cpp's
default chain is top-k 40, top-p 0.95, min-p 0.05, temperature 0.8. A benchmark that only decodes greedily says
nothing about those, so bench_throughput, bench_generate and bench_sampling take `--sampling` with names from
CHAINS, and llama.cpp's llama-server is given the same chain (`llama_server_fields`).

    greedy        temperature 0
    temperature   temperature 0.8 over the whole vocabulary
    top_p         temperature 1, top-p 0.95 (a chat client's usual request)
    top_k         temperature 0.7, top-k 40
    main          main.py's defaults: temperature 0.8, top-p 0.95, top-k 40
    llama         llama.cpp's default chain: top-k 40, top-p 0.95, min-p 0.05, temperature 0.8

(Names without dots: results files are read by keys like `concurrency.32.top_p.tok_s`.)
"""

from __future__ import annotations

import argparse

CHAINS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 1.0, "top_p": 0.95},
    "top_k": {"temperature": 0.7, "top_k": 40},
    "main": {"temperature": 0.8, "top_p": 0.95, "top_k": 40},
    "llama": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # llama-server's values for a filter that does nothing


def parse_sampling(text: str) -> list[str]:
    """'greedy,llama' -> ['greedy', 'llama']; an unknown name is an argparse error naming the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHAINS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown sampling chain(s) {unknown or text!r}: choose from "
                                         f"{', '.join(CHAINS)} (comma-separated)")
    return names


def add_sampling_arg(p: argparse.ArgumentParser, default: str = "greedy,llama") -> None:
    p.add_argument("--sampling", type=parse_sampling, default=parse_sampling(default),
                   help=f"sampling chains to decode with, side by side in the same run (default {default}; "
                        f"known: {', '.join(CHAINS)}; see benchmarks/sampling_chains.py)")


def sampling_params(chain: str, seed: int | None = None, **kwargs):
    """The chain as SamplingParams; `seed` makes the sampled tokens reproducible, kwargs add max_tokens etc."""
    from tinyvllm.sampling_params import SamplingParams  # here: bench_generate sets BEAM before tinyvllm loads

    return SamplingParams(**CHAINS[chain], seed=None if CHAINS[chain]["temperature"] == 0 else seed, **kwargs)


def llama_server_fields(chain: str) -> dict[str, float]:
    """The chain as llama-server /completion fields: every filter the chain leaves out explicitly off (the server's
    own defaults are llama.cpp's chain), and no repetition penalty, as tinyvllm's chains have none."""
    return {**OFF, **CHAINS[chain], "repeat_penalty": 1.0}
