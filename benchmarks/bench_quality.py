"""What each weight format costs in quality: perplexity on a fixed text, tinyvllm beside llama.cpp.

    python benchmarks/bench_quality.py                                  # float32, Q4_1, online Q8_0 and Q4_0
    python benchmarks/bench_quality.py --peers ../peers-cache           # + F32/Q8_0/Q4_K_M files, llama-perplexity
    python benchmarks/bench_quality.py --peers ../peers-cache --chunks 4 --hf

The text is Python's own LICENSE.txt (every machine has it) and the method llama.cpp's `llama-perplexity`
(tinyvllm/perplexity.py): chunks of --n-ctx tokens, each from scratch, the second half of each scored. One row
per format; with --peers, beside each, llama-perplexity on the same .gguf file and the same text, run right
after tinyvllm's in the same process, and the ratio tinyvllm / llama.cpp (the target: within 1%):

    row           tinyvllm loads                          --quantization   llama.cpp runs
    f32           the peers' F32 GGUF (without --peers:   auto (none)      the F32 GGUF
                  the shipped Q4_1, dequantized)
    q4_1          the shipped Q4_1 GGUF                   auto             the same file
    q8_0          the peers' Q8_0 GGUF                    auto             the same file            (--peers only)
    q8_0_online   the F32 GGUF (or the shipped Q4_1)      q8_0             the Q8_0 GGUF
    q4_0_online   the F32 GGUF (or the shipped Q4_1)      q4_0             llama-quantize --pure F32 -> Q4_0
    q4_k_m, q5_k_m, q3_k_m, q2_k, iq4_xs, iq4_nl
                  llama-quantize F32 -> that mixture      auto             the same file            (--peers only)
    iq4_nl_online, q4_k_online
                  the F32 GGUF                            iq4_nl, q4_k     llama-quantize --pure F32 -> that type

The peers' F32 and Q8_0 files were requantized from the shipped Q4_1 (benchmarks/peers/build_llama_cpp.py), so
every row starts from the same numbers: the F32 file holds exactly the Q4_1 weights dequantized. The files made
here (Q4_0, Q4_K_M) are cached in the peers' models folder. Each row says what its weights were stored as on
the device (`LlamaForCausalLM.weight_formats()`), so a format that tinyvllm dequantizes at load shows as float32.

The quantized kernels round the activations to 8-bit blocks at every batch size (tinyvllm/kernels/qlinear.py),
as llama.cpp's do, so feeding a chunk in one forward measures what a decode step computes. Where their float path
is turned on (TINYVLLM_QMATMUL_FLOAT_MIN_M=N), a whole chunk would take it instead: the run records N, and
--step-tokens feeds the chunks that many tokens per forward.

With --peers, the token ids llama-perplexity cut its chunks from are read back once and compared with
tinyvllm's: the two figures score the same tokens only if they are equal. --hf adds HF transformers' perplexity
of the float row (the same chunks, the same token ids), the oracle of tests/test_perplexity.py.

Results go to benchmarks/results/bench_quality.json (with --file, bench_quality_<the file's stem>.json).
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import (  # noqa: E402  (benchmarks/common.py)
    BenchParser, add_peers_arg, code_version, find_peers, log, machine_description, table, write_results)

from tinyvllm.kernels.qlinear import FLOAT_PATH_MIN_M  # noqa: E402
from tinyvllm.model.loader import load_model  # noqa: E402
from tinyvllm.model.weights import default_model_path  # noqa: E402
from tinyvllm.perplexity import default_text_path, perplexity, read_text, text_digest  # noqa: E402


@dataclass(frozen=True)
class Row:
    key: str  # the results-file key
    label: str
    model: Path  # what tinyvllm loads
    quantization: str
    llama_model: Path | None  # what llama-perplexity runs (None: no twin)


def plan(peers, peers_dir: Path | None) -> list[Row]:
    shipped = default_model_path()
    if peers is None:
        return [Row("f32", "float32 (Q4_1 dequantized)", shipped, "none", None),
                Row("q4_1", "Q4_1 (shipped)", shipped, "auto", None),
                Row("q8_0_online", "Q8_0 online, from Q4_1", shipped, "q8_0", None),
                Row("q4_0_online", "Q4_0 online, from Q4_1", shipped, "q4_0", None)]
    f32, q8_0 = peers.models["F32"], peers.models["Q8_0"]
    stem = f32.name.removesuffix(".F32.gguf")
    models = peers_dir / "models"
    log("making the Q4_0 and Q4_K_M files with llama-quantize (cached in the peers' models folder)")
    q4_0 = peers.quantize("F32", models / f"{stem}.Q4_0-pure.gguf", "Q4_0", pure=True)
    # llama-quantize's mixtures, each as llama.cpp users download them (SmolLM2's 576-wide rows fall back to
    # 32-element formats: Q4_K_M is mostly Q5_0, Q5_K_M Q5_1, Q2_K and Q3_K_M Q4_0, IQ4_XS IQ4_NL)
    mixes = {name: peers.quantize("F32", models / f"{stem}.{name}.gguf", name)
             for name in ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")}
    # what `--quantization iq4_nl|q4_k` makes of the F32 weights, the tied embedding included: llama-quantize --pure
    online = {name: peers.quantize("F32", models / f"{stem}.{name}-pure.gguf", name, pure=True)
              for name in ("IQ4_NL", "Q4_K")}
    return [Row("f32", "F32", f32, "auto", f32),
            Row("q4_1", "Q4_1 (shipped)", shipped, "auto", shipped),
            Row("q8_0", "Q8_0", q8_0, "auto", q8_0),
            Row("q8_0_online", "Q8_0 online, from F32", f32, "q8_0", q8_0),
            Row("q4_0_online", "Q4_0 online, from F32", f32, "q4_0", q4_0),
            *[Row(name.lower(), name, path, "auto", path) for name, path in mixes.items()],
            Row("iq4_nl_online", "IQ4_NL online, from F32", f32, "iq4_nl", online["IQ4_NL"]),
            Row("q4_k_online", "Q4_K online, from F32", f32, "q4_k", online["Q4_K"])]


def stored_as(weight_bytes: dict[str, int]) -> str:
    """'Q4_1 66.4 MB + Q8_0 30.1 MB + float32 0.1 MB' -> the short form the table shows: 'Q4_1+Q8_0'."""
    big = [name for name, size in sorted(weight_bytes.items(), key=lambda kv: -kv[1])
           if size > 0.01 * sum(weight_bytes.values())]
    return "+".join(big)


def hf_perplexity(model_path: Path, token_ids: list[int], n_ctx: int, chunks: int) -> float:
    """HF transformers on the same GGUF (dequantized to float32) and the same chunks: the oracle's figure."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                              dtype=torch.float32).eval()
    first, total, count = n_ctx // 2, 0.0, 0
    with torch.no_grad():
        for i in range(chunks):
            chunk = torch.tensor([token_ids[i * n_ctx:(i + 1) * n_ctx]])
            logprobs = torch.log_softmax(hf(chunk).logits[0, first:n_ctx - 1].double(), dim=-1)
            targets = chunk[0, first + 1:]
            total -= float(logprobs[torch.arange(len(targets)), targets].sum())
            count += len(targets)
    return math.exp(total / count)


def main() -> None:
    p = BenchParser(description="perplexity per weight format, beside llama.cpp's (--peers)")
    p.add_argument("--n-ctx", type=int, default=512, help="tokens per chunk, the second half scored (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="only the first N chunks (default: all of the text)")
    p.add_argument("--file", default=None, help="the text (default: Python's LICENSE.txt)")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="tokens per forward (default: a whole chunk; see the float path above)")
    p.add_argument("--hf", action="store_true", help="also HF transformers' perplexity of the float row")
    add_peers_arg(p)
    args = p.parse_args()
    peers = find_peers(args)
    text_path = Path(args.file) if args.file else default_text_path()
    text = read_text(text_path)
    print(f"machine: {machine_description()}")
    print(f"code: {code_version()}")

    rows, results, token_ids = plan(peers, Path(args.peers).expanduser().resolve() if peers else None), {}, None
    tokens_match = None
    for row in rows:
        log(f"{row.key}: tinyvllm on {row.model.name}, --quantization {row.quantization}")
        model, tokenizer, _ = load_model(row.model, quantization=row.quantization)
        weights = model.weight_formats()
        r = perplexity(model, tokenizer, text, n_ctx=args.n_ctx, max_chunks=args.chunks,
                       tokens_per_step=args.step_tokens)
        log(f"  ppl {r.ppl:.4f} ({r.chunks} chunks, {r.seconds:.1f} s)")
        results[row.key] = {"label": row.label, "file": row.model.name, "quantization": row.quantization,
                            "stored_as": stored_as(weights), "weight_bytes": weights, "ppl": r.ppl, "nll": r.nll,
                            "seconds": r.seconds}
        token_ids = tokenizer.encode(text)
        del model
        gc.collect()  # the next row's weights replace this one's
        if row.llama_model is not None:
            ref = peers.perplexity(row.llama_model, text_path, args.n_ctx, r.chunks, tokens=tokens_match is None)
            if "tokens" in ref:
                theirs = ref.pop("tokens")
                tokens_match = theirs == token_ids[:len(theirs)]
            assert ref["chunks"] == r.chunks, f"llama-perplexity ran {ref['chunks']} chunks, tinyvllm {r.chunks}"
            results[row.key]["llama_cpp"] = ref
            results[row.key]["ratio"] = r.ppl / ref["ppl"]
            log(f"  llama.cpp ppl {ref['ppl']:.4f} ({ref['seconds']:.1f} s)")
        if row.key == "f32" and args.hf:
            log("  HF transformers on the same weights and chunks")
            results[row.key]["hf_ppl"] = hf_perplexity(row.model, token_ids, args.n_ctx, r.chunks)
            results[row.key]["hf_ratio"] = r.ppl / results[row.key]["hf_ppl"]
    f32_ppl = results["f32"]["ppl"]
    for entry in results.values():
        entry["vs_f32"] = entry["ppl"] / f32_ppl - 1

    chunks = r.chunks
    print(f"\ntext: {text_path.name} of Python {platform.python_version()}, {len(text):,} characters, "
          f"{len(token_ids):,} tokens (sha256 {text_digest(text)}); {chunks} chunks of {args.n_ctx}, "
          f"{r.tokens_scored:,} tokens scored")
    if tokens_match is not None:
        verdict = "yes" if tokens_match else "NO: the two figures score different tokens"
        print(f"token ids identical to llama-perplexity's: {verdict}")
    headers = ("format", "--quantization", "stored as", "tinyvllm ppl", "vs F32")
    if peers:
        headers += ("llama.cpp ppl", "ratio")
    out_rows = []
    for e in results.values():
        cells = (e["label"], e["quantization"], e["stored_as"], f"{e['ppl']:.4f}", f"{e['vs_f32']:+.2%}")
        if peers:
            cells += (f"{e['llama_cpp']['ppl']:.4f}", f"{e['ratio']:.4f}") if "llama_cpp" in e else ("-", "-")
        out_rows.append(cells)
    print(table(out_rows, headers))
    print("files: " + ", ".join(f"{e['label']}: {e['file']}" for e in results.values()))
    if "hf_ppl" in results["f32"]:
        print(f"HF transformers, float row: ppl {results['f32']['hf_ppl']:.4f} "
              f"(tinyvllm / HF = {results['f32']['hf_ratio']:.6f})")
    name = "bench_quality" if args.file is None else f"bench_quality_{Path(args.file).stem}"  # a text of its own
    write_results(name, {
        "text": {"file": text_path.name, "python": platform.python_version(), "characters": len(text),
                 "tokens": len(token_ids), "sha256": text_digest(text)},
        "n_ctx": args.n_ctx, "chunks": chunks, "tokens_scored": r.tokens_scored,
        "tokens_identical_to_llama_cpp": tokens_match, "qmatmul_float_min_m": FLOAT_PATH_MIN_M,
        "formats": results}, args)


if __name__ == "__main__":
    main()
