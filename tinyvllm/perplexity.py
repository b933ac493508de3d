"""Perplexity: how surprised the model is by a fixed text, the quality meter of quantized weights.

    python -m tinyvllm.perplexity [--model PATH] [--quantization auto|none|q8_0|q4_0|q4_1|iq4_nl|q4_k]
                                  [--n-ctx 512] [--chunks N] [--tokens-per-step N] [--file PATH]

Taught in docs/phases/06-quantized-weights.md, section 5.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinygrad import Tensor

from tinyvllm.attention.paged import attention_metadata as portable_attention_metadata
from tinyvllm.attention.kv_cache import PagedKVCache, resolve_kv_cache_dtype
from tinyvllm.input_buffer import InputBuffer
from tinyvllm.jit import Jit
from tinyvllm.plugins import provided
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.tokenizer import Tokenizer

attention_metadata = provided("attention_metadata", portable_attention_metadata)  # Phase 5: the paged kernels


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float  # exp(nll)
    nll: float  # mean negative log-likelihood of a scored token, in nats
    tokens_scored: int  # chunks * (n_ctx - n_ctx // 2 - 1)
    chunks: int
    text_tokens: int = 0  # the whole text's
    seconds: float = 0.0  # all of it, compilation included


def default_text_path() -> Path:
    """Python's LICENSE.txt in the standard library directory: a fixed text every machine has."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from this Python installation: pass a text file with --file")
    return path


def read_text(path: str | Path) -> str:
    """The file's text with one trailing newline dropped, as `llama-perplexity -f` reads it."""
    text = Path(path).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def text_digest(text: str) -> str:
    """A short sha256 of the text, to tell two machines' LICENSE.txt apart."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def num_chunks(num_tokens: int, n_ctx: int, max_chunks: int | None = None) -> int:
    """How many chunks llama-perplexity evaluates: floor(tokens / n_ctx), at most max_chunks."""
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"n_ctx must be an even number >= 4 (half context, half scored), got {n_ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"chunks must be >= 1 (or None for all of them), got {max_chunks}")
    if num_tokens < 2 * n_ctx:
        raise ValueError(f"the text has {num_tokens} tokens; perplexity with n_ctx {n_ctx} needs at least "
                         f"{2 * n_ctx} (llama-perplexity's rule): use a longer text or a smaller n_ctx")
    n = num_tokens // n_ctx
    return n if max_chunks is None else min(n, max_chunks)


def chunk_tokens(token_ids: list[int], n_ctx: int, chunks: int, bos_token_id: int | None) -> list[list[int]]:
    """The chunks' token ids, each one's first token replaced by `bos_token_id` if given."""
    out = []
    for i in range(chunks):
        chunk = list(token_ids[i * n_ctx:(i + 1) * n_ctx])
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        out.append(chunk)
    return out


def scored_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits (T, V) float32, targets (T,) -> -log softmax(logits)[target] per row, (T,) float64."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)  # (T,1): subtracted so that exp never overflows
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=-1))
    return log_z - x[np.arange(len(targets)), targets]


class ChunkScorer:
    """One chunk of n_ctx tokens -> the float32 logits of its scored positions, (n_ctx - n_ctx/2 - 1, vocab)."""

    BLOCK_SIZE = 16

    def __init__(self, model: LlamaForCausalLM, n_ctx: int, tokens_per_step: int | None = None,
                 kv_cache_dtype: str = "auto"):
        step = n_ctx if tokens_per_step is None else tokens_per_step
        if not 0 < step <= n_ctx or n_ctx % step:
            raise ValueError(f"tokens_per_step must divide n_ctx ({n_ctx}), got {tokens_per_step}")
        self.model, self.n_ctx, self.first, self.step = model, n_ctx, n_ctx // 2, step
        device, num_blocks = model.device, -(-n_ctx // self.BLOCK_SIZE)
        # the chunk's K/V stored in kv_cache_dtype: its rounding is in every score
        self.cache = PagedKVCache(model.config, num_blocks, self.BLOCK_SIZE,
                                  dtype=resolve_kv_cache_dtype(kv_cache_dtype, model.dtype), device=device)
        self.block_table = Tensor(np.arange(num_blocks, dtype=np.int32).reshape(1, -1), device=device).realize()
        # refilled in place per step: token ids, positions (1,step) and slots (step,); slot i holds position i
        self._ids = InputBuffer((1, step), np.int32, device)
        self._positions = InputBuffer((1, step), np.int32, device)
        self._slots = InputBuffer((step,), np.int32, device)
        self._jit = Jit(self._forward)

    def _forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor) -> Tensor:
        metadata = attention_metadata(slot_mapping, self.block_table, positions, self.block_table.shape[1])
        hidden = self.model(input_ids, positions, self.cache.kv_caches, metadata)  # (1,step,D)
        if self.step == self.n_ctx:  # only the scored rows through the lm_head: first ..
            hidden = hidden[:, self.first:self.n_ctx - 1]
        return self.model.compute_logits(hidden).realize()  # (1,rows,V)

    def __call__(self, chunk: list[int]) -> np.ndarray:
        if len(chunk) != self.n_ctx:
            raise ValueError(f"a chunk has {self.n_ctx} tokens, got {len(chunk)}")
        scored = []
        for start in range(0, self.n_ctx, self.step):
            positions = np.arange(start, start + self.step, dtype=np.int32)
            logits = self._jit(self._ids.write(np.asarray(chunk[start:start + self.step], dtype=np.int32)),
                               self._positions.write(positions), self._slots.write(positions)).numpy()[0]
            if self.step == self.n_ctx:
                return logits
            lo, hi = max(self.first, start), min(self.n_ctx - 1, start + self.step)
            if lo < hi:
                scored.append(logits[lo - start:hi - start])
        return np.concatenate(scored)


def perplexity(model: LlamaForCausalLM, tokenizer: Tokenizer, text: str, n_ctx: int = 512,
               max_chunks: int | None = None, tokens_per_step: int | None = None, progress=None,
               kv_cache_dtype: str = "auto") -> PerplexityResult:
    """llama-perplexity's chunked perplexity of `text`; `progress(chunk index, running perplexity)` per chunk."""
    start = time.perf_counter()
    token_ids = tokenizer.encode(text, add_special_tokens=True)
    chunks = num_chunks(len(token_ids), n_ctx, max_chunks)
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    scorer = ChunkScorer(model, n_ctx, tokens_per_step, kv_cache_dtype)
    total, count = 0.0, 0
    for i, chunk in enumerate(chunk_tokens(token_ids, n_ctx, chunks, bos)):
        logits = scorer(chunk)  # (n_ctx-1-first, V)
        nll = scored_nll(logits, np.asarray(chunk[scorer.first + 1:]))
        total, count = total + float(nll.sum()), count + len(nll)
        if progress is not None:
            progress(i, math.exp(total / count))
    mean = total / count
    return PerplexityResult(ppl=math.exp(mean), nll=mean, tokens_scored=count, chunks=chunks,
                            text_tokens=len(token_ids), seconds=time.perf_counter() - start)


def describe_formats(model: LlamaForCausalLM) -> str:
    """The weights' storage formats by bytes on the device, e.g."""
    formats = sorted(model.weight_formats().items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in formats)


def main(argv: list[str] | None = None, prog: str = "python -m tinyvllm.perplexity") -> int:
    from tinyvllm.model.loader import load_model
    from tinyvllm.model.quantization import METHODS

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quantization", default="auto", choices=METHODS,
                   help="how the weights are served (default auto: the checkpoint's own format; "
                   "none: dequantized to float32; q8_0/q4_0/q4_1/iq4_nl/q4_k: quantized at load)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
    p.add_argument("--device", default=None, help="tinygrad device, e.g. CPU, CUDA (default: tinygrad's choice)")
    p.add_argument("--n-ctx", type=int, default=512, help="tokens per chunk; the second half is scored (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="evaluate only the first N chunks (default: all)")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="feed each chunk N tokens per forward (default: all at once; the same figure unless the "
                   "quantized kernels' float path is turned on, see tinyvllm/kernels/qlinear.py)")
    p.add_argument("--file", default=None, help="the text (default: Python's LICENSE.txt from the stdlib directory)")
    args = p.parse_args(argv)

    path = Path(args.file) if args.file else default_text_path()
    text = read_text(path)
    load_start = time.perf_counter()
    model, tokenizer, model_path = load_model(args.model, dtype=args.dtype, device=args.device,
                                              quantization=args.quantization)
    load_s = time.perf_counter() - load_start
    print(f"model {model_path.name}, --quantization {args.quantization}, {model.dtype.itemsize * 8}-bit float compute "
          f"on {model.device}: weights {describe_formats(model)}; loaded in {load_s:.1f} s")

    def progress(i: int, ppl: float) -> None:
        print(f"[{i + 1}]{ppl:.4f}", end=" ", flush=True)

    try:
        r = perplexity(model, tokenizer, text, n_ctx=args.n_ctx, max_chunks=args.chunks,
                       tokens_per_step=args.tokens_per_step, progress=progress)
    except ValueError as e:
        p.error(str(e))
    print()
    print(f"text {path.name}: {len(text):,} characters, {r.text_tokens:,} tokens, sha256 {text_digest(text)}")
    print(f"perplexity {r.ppl:.4f} (mean NLL {r.nll:.5f}) over {r.tokens_scored:,} scored tokens in {r.chunks} "
          f"chunks of {args.n_ctx}; {r.seconds:.1f} s ({r.chunks * args.n_ctx / r.seconds:.0f} tokens/s evaluated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
