"""Part 6 of bench_memory.py: the KV cache's dtype (Phase 7c: float32, float16, int8, fp8), each in the same run.

    kv_decode_speed          decode tok/s of several sequences at a long context, one engine per dtype, in turn
    kv_attention_kernel_ms   one layer's paged-attention kernel alone on each dtype's cache
    kv_rounding_error        what rounding the real model's K/V costs, with and without the Hadamard rotation
    kv_perplexity            perplexity of a fixed text with each dtype (tinyvllm/perplexity.py's method)

Run through `benchmarks/bench_memory.py` (all parts, or `--kv-only`), which writes the figures.

Run on its own, this script measures one more thing, with llama.cpp's q8_0 cache beside ours under --peers, and
writes benchmarks/results/kv_dtypes.json:

    greedy_agreement         the 6 oracle prompts of tests/engine/test_generate.py (as token ids, chat-templated as the
                             tests do), 16 greedy tokens each on the float32 weights: how many continuations with an
                             8-bit cache equal the same engine's with a float32 cache, and how close float32's own
                             top two tokens were where they part (a near tie, which any rounding can flip)

    python benchmarks/kv_dtypes.py [--peers DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tinyvllm.attention.kv_cache import KV_CACHE_DTYPES
from tinyvllm.model.config import ModelConfig


def kv_decode_speed(model, tokenizer, prompt: list[int], names: list[str], num_seqs: int, context: int, steps: int,
                    warmup: int, block_size: int) -> dict:
    """num_seqs greedy sequences decoding at ~`context` tokens of context (`prompt`: context - warmup tokens), one
    engine per KV dtype on the same model (the kernels), the engines' steps interleaved. The sequences share one
    prompt through the prefix cache: the first is prefilled alone, the others then find its blocks cached and compute
    only their last token. Every step still reads each sequence's whole context (the kernel reads a block once per
    sequence that holds it); only the prefill and the memory are shared."""
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
        while engine.scheduler.requests["kv-0"].num_output_tokens == 0:
            engine.step()
        prefill_s[name] = time.perf_counter() - t
        for i in range(1, num_seqs):
            engine.add_request(f"kv-{i}", prompt, params)
        while any(state.num_output_tokens == 0 for state in engine.scheduler.requests.values()):
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
    tokens = {name: engine.scheduler.requests["kv-0"].output_token_ids[:warmup + steps]
              for name, engine in engines.items()}
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


# ---- greedy agreement on the oracle prompts (run on its own) ----

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CACHES = {"f32": ("-ctk", "f32", "-ctv", "f32"), "f16": ("-ctk", "f16", "-ctv", "f16"),
                "q8_0": ("-ctk", "q8_0", "-ctv", "q8_0")}  # llama-server's cache types, flash attention on for all


def oracle_prompts(tokenizer) -> dict[str, list[int]]:
    """tests/engine/test_generate.py's PROMPTS as token ids, by its own prompt_ids (the "chat" one chat-templated) on a
    stand-in for the tests' Generator that encodes as Generator.encode_prompt does."""
    from types import SimpleNamespace

    from tinyvllm.engine.generator import Generator

    spec = importlib.util.spec_from_file_location("test_generate", ROOT / "tests" / "engine" / "test_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generator = SimpleNamespace(tokenizer=tokenizer)
    generator.encode_prompt = lambda prompt, chat=False: Generator.encode_prompt(generator, prompt, chat)
    return {name: module.prompt_ids(generator, name) for name in module.PROMPTS}


def agreement(runs: dict[str, dict], reference: str) -> dict:
    """runs: cache -> prompt -> {"tokens": [...], "margins": [top-1 minus top-2 logprob at each step]}. Per cache:
    how many prompts' tokens equal the reference cache's, where each first differs with the reference's margin
    there (nats between its top two tokens), and the mean |change| of the margins over the steps before that."""
    ref = runs[reference]
    out = {}
    for cache, by_prompt in runs.items():
        prompts, changes = {}, []
        for name, run in by_prompt.items():
            want, margins = ref[name]["tokens"], ref[name]["margins"]
            first = next((i for i, (a, b) in enumerate(zip(want, run["tokens"])) if a != b), None)
            prompts[name] = {"first_difference": first,
                             "reference_margin_there": None if first is None or margins is None else margins[first]}
            if margins is not None and run["margins"] is not None:
                changes += [abs(a - b) for a, b in zip(margins[:first], run["margins"][:first])]
        out[cache] = {"agree": sum(p["first_difference"] is None for p in prompts.values()), "of": len(prompts),
                      "margin_change_mean": float(np.mean(changes)), "margin_change_steps": len(changes),
                      "prompts": prompts}
    return out


def tinyvllm_greedy(model, tokenizer, prompts: dict[str, list[int]], names: list[str], max_tokens: int) -> dict:
    """One engine per KV dtype, all prompts in one batch, greedy, logprobs of the top 2. A name "int8:portable" runs
    that dtype on the portable tinygrad path instead of the kernels (the same codes, bit for bit, and the same
    attention up to the order of its float sums)."""
    from tinyvllm.attention import kernel_backend
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    runs = {}
    for name in names:
        dtype, _, path = name.partition(":")
        # the switch, and the variable that says so (the on-disk graph cache keys its graphs by TINYVLLM_ variables)
        before = kernel_backend.PORTABLE, os.environ.get("TINYVLLM_PORTABLE")
        kernel_backend.PORTABLE = path == "portable" or before[0]
        os.environ["TINYVLLM_PORTABLE"] = "1" if kernel_backend.PORTABLE else "0"
        try:
            engine = LLMEngine(model, tokenizer=tokenizer, max_model_len=512, kv_cache_memory="64MiB",
                               kv_cache_dtype=dtype)
            for prompt, ids in prompts.items():
                engine.add_request(prompt, ids, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
        finally:
            kernel_backend.PORTABLE = before[0]
            if before[1] is None:
                del os.environ["TINYVLLM_PORTABLE"]
            else:
                os.environ["TINYVLLM_PORTABLE"] = before[1]
        runs[name] = {p: {"tokens": list(done[p].token_ids),
                          "margins": [top[0][1] - top[1][1] for _, top in done[p].logprobs]} for p in prompts}
        print(f"  tinyvllm {name}: done", file=sys.stderr, flush=True)
    return runs


def llama_cpp_greedy(llama, prompts: dict[str, list[int]], caches: list[str], max_tokens: int) -> dict:
    """llama-server on the F32 weights, one server per cache type (flash attention on), the prompts as token ids,
    greedy (temperature 0), the top 2 logprobs of each step."""
    from peers.llama_cpp import http_json

    runs = {}
    for cache in caches:
        with llama.server("F32", context=512, extra=("-fa", "on", *LLAMA_CACHES[cache])) as url:
            runs[cache] = {}
            for prompt, ids in prompts.items():
                r = http_json(f"{url}/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0,
                                                    "n_probs": 2, "ignore_eos": True, "cache_prompt": False,
                                                    "return_tokens": True}, timeout=600)
                assert r["tokens_evaluated"] == len(ids), f"llama-server read {r['tokens_evaluated']} prompt tokens"
                # one entry per token, except that tokens ending inside a UTF-8 character share one entry
                # ('unicode'): then the steps' margins cannot be told apart and are left out
                steps = r["completion_probabilities"]
                margins = [s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"] for s in steps]
                runs[cache][prompt] = {"tokens": list(r["tokens"]),
                                       "margins": margins if len(margins) == len(r["tokens"]) else None}
        print(f"  llama.cpp {cache} cache: done", file=sys.stderr, flush=True)
    return runs


# What a variant of the 8-bit rounding does to the oracle prompts' greedy choices: HF transformers (float32, the
# tests' oracle) with each variant's rounding applied to every layer's K and V (after RoPE, as the cache stores
# them), teacher-forced on float32's own greedy continuation. Up to its first different choice a free-running
# greedy continuation sees exactly these inputs, so "agree" below is the greedy agreement, from one forward.
ROTATED = {"k": True, "v": True, "rotate_k": True, "rotate_v": True}
ROUNDING_VARIANTS = {  # name (a results key) -> (what it is, the rounding)
    "as_stored": ("int8 as the cache stores it: K and V rotated", ROTATED),
    "k_only": ("int8 K only (V exact)", {"k": True, "rotate_k": True}),
    "v_only": ("int8 V only (K exact)", {"v": True, "rotate_v": True}),
    "no_rotation": ("int8, no rotation", {"k": True, "v": True}),
    "k_only_no_rotation": ("int8 K only, no rotation", {"k": True}),
    "v_only_no_rotation": ("int8 V only, no rotation", {"v": True}),
    "rotate_k_only": ("int8, K rotated, V not", {"k": True, "v": True, "rotate_k": True}),
    "rotate_v_only": ("int8, V rotated, K not", {"k": True, "v": True, "rotate_v": True}),
    "scale_float16": ("int8, the scale rounded to float16", {**ROTATED, "scale_f16": True}),
    "least_squares_scale": ("int8, the scale that fits the codes best (least squares)", {**ROTATED, "refit": True}),
    "group_32": ("int8, a scale per 32 elements (not this format)", {**ROTATED, "group": 32}),
    "group_32_no_rotation": ("int8, a scale per 32, no rotation (q8_0's grouping)", {"k": True, "v": True,
                                                                                    "group": 32}),
    **{f"random_signs_{seed}": (f"int8, the rotation with random signs (seed {seed})", {**ROTATED, "signs": seed})
       for seed in range(1, 6)},
}


def round_rows(x, variant: dict, rotate: bool):
    """x: torch (..., head_dim) -> x after int8 rounding, one symmetric scale per row (or per `group` elements),
    optionally through the Hadamard rotation (with random signs first: QuaRot's randomized form)."""
    import torch

    head_dim = x.shape[-1]
    if rotate:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / head_dim**0.5
        if "signs" in variant:
            rng = np.random.default_rng(variant["signs"])
            h = torch.tensor(rng.choice([-1.0, 1.0], head_dim), dtype=torch.float32)[:, None] * h
        return round_rows(x @ h, variant, False) @ h.T
    group = variant.get("group", head_dim)
    g = x.reshape(*x.shape[:-1], head_dim // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    scale = amax * (1.0 / 127)
    codes = torch.round(g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))  # half to even
    if variant.get("scale_f16"):
        scale = scale.half().float()
    if variant.get("refit"):  # the scale minimizing |x - s * codes|^2 for these codes
        scale = torch.where(amax > 0, (g * codes).sum(-1, keepdim=True) / (codes * codes).sum(-1, keepdim=True)
                            .clamp_min(1), scale)
    return (codes * scale).reshape(x.shape)


def rounding_variants(prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """Per variant: prompts whose 16 greedy choices all stay float32's, the mean |change| of the margin between
    float32's top two tokens over every step, and the change at each prompt's closest tie."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinyvllm.model.weights import default_model_path

    current: dict = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if current.get("k"):
            key = round_rows(key, current, current.get("rotate_k", False))
        if current.get("v"):
            value = round_rows(value, current, current.get("rotate_v", False))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kv_rounding", attention)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="kv_rounding").eval()

    def logprobs(ids: list[int], start: int):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, start:].log_softmax(-1)

    reference = {}
    for name, ids in prompts.items():  # float32's greedy continuation, then its logprobs in one forward
        tokens = list(ids)
        for _ in range(max_tokens):
            tokens.append(int(logprobs(tokens, len(tokens) - 1)[-1].argmax()))
        lp = logprobs(tokens[:-1], len(ids) - 1)
        top2 = lp.topk(2, -1).indices
        reference[name] = (tokens[:-1], len(ids) - 1, top2, lp.gather(1, top2[:, :1]) - lp.gather(1, top2[:, 1:]))
    out = {"float32_closest_tie": {name: {"step": int(m.argmin()), "margin": float(m.min())}
                                   for name, (_, _, _, m) in reference.items()}, "variants": {}}
    for label, (what, variant) in ROUNDING_VARIANTS.items():
        current.clear()
        current.update(variant)
        agree, moved, at_tie = [], [], {}
        for name, (tokens, start, top2, margin) in reference.items():
            lp = logprobs(tokens, start)
            changed = (lp.gather(1, top2[:, :1]) - lp.gather(1, top2[:, 1:])) - margin
            if bool((lp.argmax(-1) == top2[:, 0]).all()):
                agree.append(name)
            moved.append(changed.abs().mean().item())
            at_tie[name] = float(changed[int(margin.argmin())])
        out["variants"][label] = {"what": what, "agree": len(agree), "agreeing": agree,
                                  "margin_change_mean": float(np.mean(moved)), "margin_change_at_closest_tie": at_tie}
        print(f"  {what}: {len(agree)} of {len(prompts)}, margins move {np.mean(moved):.4f} nats on average",
              file=sys.stderr, flush=True)
    current.clear()
    signs = [v for k, v in out["variants"].items() if k.startswith("random_signs_")]
    out["random_signs"] = {"agree_min": min(v["agree"] for v in signs), "agree_max": max(v["agree"] for v in signs),
                           "margin_change_mean_min": min(v["margin_change_mean"] for v in signs),
                           "margin_change_mean_max": max(v["margin_change_mean"] for v in signs)}
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from common import BenchParser, add_peers_arg, find_peers, machine_description, table, write_results

    from tinyvllm.model.loader import load_model

    p = BenchParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtypes", default="float32,int8,fp8,int8:portable", help="our caches, the first the "
                   "reference; NAME:portable on the portable path (default float32,int8,fp8,int8:portable)")
    p.add_argument("--llama-caches", default="f32,f16,q8_0", help="llama.cpp's cache types under --peers, the "
                   "first the reference (default f32,f16,q8_0)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    p.add_argument("--rounding-variants", action="store_true", help="also measure variants of the int8 rounding "
                   "on HF transformers' float32 model (needs torch and transformers)")
    add_peers_arg(p)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.kv_dtypes.split(",") if n.strip()]
    caches = [c.strip() for c in args.llama_caches.split(",") if c.strip()]
    for name in names:
        if name.partition(":")[0] not in KV_CACHE_DTYPES or name.partition(":")[2] not in ("", "portable"):
            raise SystemExit(f"--kv-dtypes: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}, optionally "
                             "followed by :portable")
    for cache in caches:
        if cache not in LLAMA_CACHES:
            raise SystemExit(f"--llama-caches: {cache!r} is none of {', '.join(LLAMA_CACHES)}")
    llama = find_peers(args)
    print(f"machine   {machine_description()}")
    model, tokenizer, _ = load_model(quantization="none")  # the float32 weights, as the tests' generator
    prompts = oracle_prompts(tokenizer)
    figures: dict = {"prompts": {k: len(v) for k, v in prompts.items()}, "max_tokens": args.max_tokens}
    ours = tinyvllm_greedy(model, tokenizer, prompts, names, args.max_tokens)
    figures["greedy_agreement"] = {"tinyvllm": agreement(ours, names[0])}
    runs = {"tinyvllm": ours}
    if llama is not None:
        theirs = llama_cpp_greedy(llama, prompts, caches, args.max_tokens)
        figures["greedy_agreement"]["llama_cpp"] = agreement(theirs, caches[0])
        runs["llama_cpp"] = theirs
        figures["llama_cpp_f32_cache_vs_tinyvllm_float32"] = agreement(
            {"tinyvllm": ours[names[0]], "llama_cpp": theirs[caches[0]]}, "tinyvllm")["llama_cpp"]
    figures["runs"] = runs
    if args.rounding_variants:
        figures["rounding_variants"] = rounding_variants(prompts, args.max_tokens)
    rows = []
    for engine, by_cache in figures["greedy_agreement"].items():
        for cache, a in by_cache.items():
            where = ", ".join(f"{p} at {v['first_difference']}" + ("" if v["reference_margin_there"] is None else
                                                                  f" (margin {v['reference_margin_there']:.3f})")
                              for p, v in a["prompts"].items() if v["first_difference"] is not None)
            rows.append((engine, cache, f"{a['agree']} of {a['of']}", f"{a['margin_change_mean']:.4f}",
                         where or "-"))
    print(f"\n== greedy continuations ({args.max_tokens} tokens) equal to the same engine's with the first cache; how "
          "far the margins between the first cache's top two tokens move, on average over the steps before any "
          "difference; where they part, that margin (nats) ==")
    print(table(rows, ("engine", "cache", "equal", "mean |margin change|", "first difference")))
    if args.rounding_variants:
        r = figures["rounding_variants"]
        ties = sorted(r["float32_closest_tie"], key=lambda n: r["float32_closest_tie"][n]["margin"])[:2]
        print(f"\n== variants of the int8 rounding (HF transformers, float32, teacher-forced): prompts whose greedy "
              f"choices all stay float32's; how far the margins between float32's top two tokens move ==")
        print(table([(v["what"], f"{v['agree']} of {len(prompts)}", f"{v['margin_change_mean']:.4f}",
                      *(f"{v['margin_change_at_closest_tie'][n]:+.4f}" for n in ties))
                     for v in r["variants"].values()],
                    ("variant", "equal", "mean |margin change|",
                     *(f"at {n}'s tie ({r['float32_closest_tie'][n]['margin']:.3f})" for n in ties))))
    write_results("kv_dtypes", figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
