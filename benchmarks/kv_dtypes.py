"""Part 6 of bench_memory.py: the KV cache's dtype (Phase 7c: float32, float16, int8, fp8), each in the same run.

    kv_decode_speed          decode tok/s of several sequences at a long context, one engine per dtype, in turn
    kv_attention_kernel_ms   one layer's paged-attention kernel alone on each dtype's cache
    kv_rounding_error        what rounding the real model's K/V costs, with and without the Hadamard rotation
    kv_perplexity            perplexity of a fixed text with each dtype (tinyvllm/perplexity.py's method)

Run through `benchmarks/bench_memory.py` (all parts, or `--kv-only`), which writes the figures.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from tinyvllm.core.kv_cache import KV_CACHE_DTYPES
from tinyvllm.model.config import ModelConfig


def kv_decode_speed(model, tokenizer, prompt: list[int], names: list[str], num_seqs: int, context: int, steps: int,
                    warmup: int, block_size: int) -> dict:
    """num_seqs greedy sequences decoding at ~`context` tokens of context (`prompt`: context - warmup tokens), one
    engine per KV dtype on the same model (the kernels), the engines' steps interleaved. The sequences share one prompt through the prefix cache: the first
    is prefilled alone, the others then find its blocks cached and compute only their last token. Every step still
    reads each sequence's whole context (the kernel reads a block once per sequence that holds it); only the prefill
    and the memory are shared."""
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.sampling_params import SamplingParams

    tail_blocks = -(-(warmup + steps + 4) // block_size) + 1  # each sequence's own blocks past the shared prompt
    num_blocks = -(-context // block_size) + num_seqs * tail_blocks
    max_model_len = num_blocks * block_size  # what the pool holds (>= context + warmup + steps: one sequence fits)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=warmup + steps + 4)
    engines, prefill_s = {}, {}
    for name in names:
        print(f"  kv {name}: prefilling {len(prompt)} tokens, then {num_seqs - 1} more sequences on the prefix "
              "cache ...", file=sys.stderr, flush=True)
        engine = LLMEngine(model, tokenizer=tokenizer, max_model_len=max_model_len, block_size=block_size,
                           num_gpu_blocks_override=num_blocks, max_num_seqs=num_seqs, kv_cache_dtype=name)
        t = time.perf_counter()
        engine.add_request("kv-0", prompt, params)
        while engine.requests["kv-0"].seq.num_output_tokens == 0:
            engine.step()
        prefill_s[name] = time.perf_counter() - t
        for i in range(1, num_seqs):
            engine.add_request(f"kv-{i}", prompt, params)
        while any(state.seq.num_output_tokens == 0 for state in engine.requests.values()):
            engine.step()
        for _ in range(warmup):  # the num_seqs-row decode graph compiles here
            engine.step()
        assert len(engine.scheduler.running) == num_seqs, "every sequence must be decoding"
        engines[name] = engine
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    tokens = {name: engine.requests["kv-0"].seq.output_token_ids[:warmup + steps] for name, engine in engines.items()}
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"num_seqs": num_seqs, "context": context, "steps": steps, "block_size": block_size,
            "prefill_s": prefill_s, "step_ms_median": {k: 1e3 * v for k, v in med.items()},
            "tok_per_s": {k: num_seqs / v for k, v in med.items()},
            "over_float32": {k: med["float32"] / v for k, v in med.items()} if "float32" in med else {},
            "same_tokens_as_float32": {k: v == tokens.get("float32") for k, v in tokens.items()}}


def kv_attention_kernel_ms(config: ModelConfig, names: list[str], num_seqs: int, context: int, block_size: int,
                           repeats: int) -> dict[str, float]:
    """Median ms of one layer's decode attention kernel alone (num_seqs rows at `context`), per KV dtype, the
    kernels interleaved: what dequantizing costs against what the smaller reads save."""
    from tinygrad import Tensor, TinyJit

    from tinyvllm.attention.kernel_backend import kernel_paged_attention

    H, KvH, Hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_seq = -(-context // block_size)
    rng = np.random.default_rng(0)
    tables = Tensor(rng.permutation(num_seqs * per_seq).reshape(num_seqs, per_seq).astype(np.int32)).realize()
    lens = Tensor(np.full(num_seqs, context, np.int32)).realize()
    shape = (num_seqs * per_seq + 1, block_size, KvH, Hd)
    jits = {}
    for name in names:
        spec = KV_CACHE_DTYPES[name]
        if spec.quantized:  # random codes; their values do not change the work
            codes = rng.integers(-120, 120, shape).astype(np.int8).view(np.uint8 if name == "fp8" else np.int8)
            caches = [Tensor(codes).realize(), Tensor(codes.copy()).realize(),
                      *(Tensor(rng.random(shape[:3], dtype=np.float32)).realize() for _ in range(2))]
        else:
            caches = [Tensor(rng.standard_normal(shape, dtype=np.float32)).cast(spec.storage).realize()
                      for _ in range(2)]
        jits[name] = TinyJit(lambda q, c=caches: kernel_paged_attention(q, c[0], c[1], tables, lens, None,
                                                                        *c[2:]).realize())
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats + 3):
        for name, jit in jits.items():
            q = Tensor(rng.standard_normal((num_seqs, H, Hd), dtype=np.float32)).realize()
            t = time.perf_counter()
            jit(q)
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def kv_rounding_error(layers: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Relative RMS error, ||x' - x|| / ||x||, of the real model's K and V (all layers) stored as int8 and fp8 with
    per-token scales: as stored (rotated by the Hadamard matrix first) and without the rotation."""
    from tinygrad import Tensor

    from tinyvllm.attention.kv_quant import dequantize, quantize, rotate

    out: dict = {}
    for name in ("int8", "fp8"):
        spec = KV_CACHE_DTYPES[name]
        for label, rotated in (("rotated", True), ("plain", False)):
            err = total = 0.0
            for k, v in layers:
                for x in (k, v):
                    t = Tensor(x.reshape(-1, *x.shape[2:]))
                    t = rotate(t) if rotated else t
                    back = dequantize(*quantize(t, spec), spec)
                    err += float(((back - t) ** 2).sum().item())
                    total += float((t ** 2).sum().item())
            out.setdefault(name, {})[label] = (err / total) ** 0.5
        out[name]["plain_over_rotated"] = out[name]["plain"] / out[name]["rotated"]
    return out


def kv_perplexity(model, tokenizer, names: list[str], n_ctx: int, max_chunks: int) -> dict:
    """Perplexity of the fixed text with each KV dtype, by llama-perplexity's method (tinyvllm/perplexity.py: chunks
    of n_ctx tokens, each from an empty cache, the second half of each scored). Each chunk's one forward writes its
    K/V into a paged cache of the dtype and attends over them as stored: the quantization is in every score."""
    from tinyvllm import perplexity as ppl

    path = ppl.default_text_path()
    ids = tokenizer.encode(ppl.read_text(path), add_special_tokens=True)
    chunks = ppl.chunk_tokens(ids, n_ctx, ppl.num_chunks(len(ids), n_ctx, max_chunks),
                              tokenizer.bos_token_id if tokenizer.add_bos_token else None)
    first = n_ctx // 2
    out = {"text": path.name, "tokens": len(ids), "n_ctx": n_ctx, "chunks": len(chunks),
           "scored_tokens": len(chunks) * (n_ctx - first - 1), "ppl": {}, "nll": {}}
    for name in names:
        scorer = ppl.ChunkScorer(model, n_ctx, kv_cache_dtype=name)
        nll = sum(float(ppl.scored_nll(scorer(chunk), np.asarray(chunk[first + 1:])).sum()) for chunk in chunks)
        if name == "float32":  # the real K/V of the last chunk: what rounding them costs, with and without rotation
            nb = scorer.block_table.shape[1]
            out["rounding_error"] = kv_rounding_error([(k.numpy()[:nb], v.numpy()[:nb])
                                                       for k, v in scorer.cache.kv_caches])
        out["nll"][name] = nll / out["scored_tokens"]
        out["ppl"][name] = float(np.exp(out["nll"][name]))
        print(f"  kv {name}: perplexity {out['ppl'][name]:.4f}", file=sys.stderr, flush=True)
    if "float32" in out["ppl"]:
        out["ppl_delta_pct"] = {k: 100 * (v / out["ppl"]["float32"] - 1) for k, v in out["ppl"].items()}
    return out
