"""KV cache memory, paged vs contiguous, and what paging costs a decode step (Phase 2).

    .venv/bin/python benchmarks/bench_memory.py                   # everything (parts 4 and 5 load the model)
    .venv/bin/python benchmarks/bench_memory.py --memory-only     # parts 1-3: pure Python, a second or two
    .venv/bin/python benchmarks/bench_memory.py --save              # into benchmarks/results/ (the docs quote it)

  1. KV bytes per token, per block, per sequence at the full context: arithmetic on the model's shape.
  2. A mix of sequence lengths (seeded, long-tailed like chat traffic), replayed through the real BlockManager as an
     engine would grow it: prompt blocks at prefill, one slot per decode step. Memory the blocks hold (block sizes 8,
     16, 32) against contiguous pre-allocation of max_model_len per sequence; the waste of each.
  3. How many of those sequences fit in a KV budget at once, each way.
  4. Single-sequence decode tokens/s, paged vs contiguous, at a few context lengths: the engine (paged, portable
     attention) and the contiguous runner on one model, greedy, warmed up, their steps interleaved against load.
  5. Why the speeds differ: one layer's attention step alone, timed the same way, split into the
     block-table gather and the causal mask, plus a variant of the paged read whose mask is built from
     a fixed-length arange (not in the engine: it isolates the cost of the gather itself); and the
     host-side cost of a step's inputs (the engine's model runner fills 5 small input arrays, the contiguous runner 1).
  6. The KV cache's dtype (Phase 7c: float32, float16, int8, fp8), each in the same run: bytes per token, how many
     sequences of the mix fit the budget, decode tokens/s of 8 sequences at context 4,096 on the kernels (the
     engines stepped in turn), one layer's attention kernel alone there, and the perplexity of a fixed text.

    .venv/bin/python benchmarks/bench_memory.py --kv-only     # parts 1-3 and 6 (prints; writes only --json)

On the CPU the model's matmuls run on the C kernel and its helper threads, which park when the gap
between two matmuls grows (the paged attention kernels widen it). `TINYVLLM_PORTABLE=1` runs tinygrad's
own matmuls instead and takes the helper threads out of the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import (  # noqa: E402
    BenchParser, add_peers_arg, machine_description, no_peer_twin, synchronize, table, write_results)
from kv_dtypes import kv_attention_kernel_ms, kv_decode_speed, kv_perplexity  # noqa: E402  (part 6)

from tinyvllm.attention.kv_cache import (  # noqa: E402
    KV_CACHE_DTYPES,
    KVCacheDtype,
    kv_cache_bytes_per_token,
    num_blocks_for_memory,
    parse_memory,
)
from tinyvllm.core.block_manager import BlockManager  # noqa: E402
from tinyvllm.core.sequence import Sequence  # noqa: E402
from tinyvllm.model.config import ModelConfig  # noqa: E402

MiB = 2**20
BLOCK_SIZES = (8, 16, 32)
KV_FIT_SEQS = 512  # part 6's mixes: part 2's distribution, long enough that no dtype runs out of sequences
KV_FIT_DRAWS = 50
BENCH_TEXT = ("A library keeps its books on shelves of equal size. When a new book arrives it goes on any free "
              "shelf, and a card in the catalogue says where; nobody reserves a whole wing for a reader who "
              "might, one day, borrow a thousand books. ")


# ---- the model's shape, without loading its weights ----

def read_config(model: str | None) -> tuple[ModelConfig, str]:
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights import default_model_path

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text())), path.name
    gguf = GGUFFile(path)
    return ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors)), path.name


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


# ---- 2. a length mix, replayed through the BlockManager ----

def length_mix(num_seqs: int, seed: int, max_model_len: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per sequence: log-normal, so most are short and a few are long.

    Prompts have a median of 200 tokens, outputs 150 (means about 330 and 210); both are clipped so
    that prompt + output fits in max_model_len.
    """
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(200), 1.0, num_seqs).round(), 4, max_model_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(150), 0.8, num_seqs).round(), 1, max_model_len // 2).astype(int)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def replay(mix: list[tuple[int, int]], block_size: int) -> list[int]:
    """Grow every sequence of the mix to its end as the engine does; return the blocks each holds then.

    Prefill allocates the prompt's blocks; every decode step computes the last sampled token and asks
    `append_slots` for its slot. When a sequence stops, its K/V cover prompt + output - 1 tokens (the
    last sampled token is never fed back). Nothing is freed, so the total is the peak if all overlap.
    """
    total_blocks = sum(-(-(p + o) // block_size) for p, o in mix)
    bm = BlockManager(total_blocks, block_size)
    held = []
    for seq_id, (p, o) in enumerate(mix):
        seq = Sequence(seq_id, [0] * p)
        assert bm.allocate(seq) is not None
        seq.num_computed_tokens = p
        seq.append_token_id(0)  # sampled by the prefill
        for _ in range(o - 1):  # each decode step: room for the last token, compute it, sample the next
            assert bm.append_slots(seq, 1) is not None
            seq.num_computed_tokens += 1
            seq.append_token_id(0)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size)
        held.append(len(seq.block_table))
    assert bm.num_blocks - bm.num_free_blocks == sum(held)
    return held


def fit_in_budget(lengths: list[int], config: ModelConfig, block_size: int, budget: int,
                  kv_dtype: KVCacheDtype = KV_CACHE_DTYPES["float32"]) -> int:
    """How many sequences of the mix, taken in order at their full length, the BlockManager admits at once
    (with the engine's own count of blocks for the budget, float32 unless `kv_dtype` says otherwise)."""
    bm = BlockManager(num_blocks_for_memory(config, block_size, budget, kv_dtype), block_size)
    admitted = 0
    for seq_id, n in enumerate(lengths):
        if bm.allocate(Sequence(seq_id, [0] * n)) is None:
            break
        admitted += 1
    return admitted


# ---- 4. decode speed ----

def prompt_of_length(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(BENCH_TEXT, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def decode_speed(model, tokenizer, contexts: list[int], steps: int, warmup: int, budget: int, block_size: int):
    """One greedy sequence decoded two ways, step for step: Phase 1's ContiguousModelRunner (decode + host
    argmax) and the engine on the paged cache with Phase 2's portable attention (one `LLMEngine.step()`:
    scheduling, the forward pass, device argmax)."""
    from tinyvllm.engine.contiguous_runner import ContiguousModelRunner
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.sampling_params import SamplingParams

    max_model_len = -(-(max(contexts) + warmup + steps + 1) // 256) * 256
    num_blocks = num_blocks_for_memory(model.config, block_size, budget, model.dtype)
    contiguous = ContiguousModelRunner(model, max_model_len)
    engine = LLMEngine(model, tokenizer=tokenizer, max_model_len=max_model_len, block_size=block_size,
                       num_gpu_blocks_override=num_blocks, portable_attention=True)
    rows = []
    for n in contexts:
        print(f"  decode at context {n}: prefilling both, then {warmup} + {steps} steps each ...",
              file=sys.stderr, flush=True)
        prompt = prompt_of_length(tokenizer, n)
        t = time.perf_counter()
        tokens = [int(contiguous.prefill(prompt).argmax())]
        prefill_s = {"contiguous": time.perf_counter() - t}
        t = time.perf_counter()
        engine.add_request("bench", prompt,
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=warmup + steps + 2))
        while not engine.step():  # the prompt, in chunks of the token budget, then the first token
            pass
        prefill_s["paged"] = time.perf_counter() - t

        def contiguous_step() -> None:
            tokens.append(int(contiguous.decode(tokens[-1], n + len(tokens) - 1).argmax()))

        steppers = {"contiguous": contiguous_step, "paged": engine.step}
        for step in steppers.values():  # warm-up steps (the first ones compile and capture the JIT)
            for _ in range(warmup):
                step()
        times: dict[str, list[float]] = {name: [] for name in steppers}
        for _ in range(steps):  # interleaved: one step of each, in turn
            for name, step in steppers.items():
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
        paged_tokens = engine.step()[0].outputs[0].token_ids  # the last one: the request is finished
        med = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append({"context": n, "steps": steps, "prefill_s": prefill_s,
                     "step_ms_median": {k: 1e3 * v for k, v in med.items()},
                     "tok_per_s": {k: 1 / v for k, v in med.items()},
                     "paged_over_contiguous": med["contiguous"] / med["paged"],
                     "same_greedy_tokens": paged_tokens[:len(tokens)] == tokens})
    return {"max_model_len": max_model_len, "num_blocks": num_blocks, "block_size": block_size, "rows": rows}


# ---- 5. one layer's attention step, taken apart ----

def paged_attention_fixed_arange(q, k_cache, v_cache, block_tables, num_blocks, positions, max_blocks: int):
    """tinyvllm.attention.paged.paged_attention with one change: the key positions come from an arange of
    fixed length, shrunk to the symbolic one. Not used by the engine; here it separates the gather's cost
    from the mask's."""
    from tinygrad import Tensor

    from tinyvllm.attention.contiguous import grouped_query_attention

    B, T = q.shape[0], q.shape[1]
    _, block_size, kv_heads, head_dim = k_cache.shape
    table = block_tables[:, :num_blocks]
    keys = k_cache[table].reshape(B, -1, kv_heads, head_dim)
    values = v_cache[table].reshape(B, -1, kv_heads, head_dim)
    key_pos = Tensor.arange(max_blocks * block_size)[: num_blocks * block_size].reshape(1, 1, 1, 1, -1)
    mask = (key_pos > positions.reshape(B, 1, 1, T, 1)).where(float("-inf"), 0.0)
    return grouped_query_attention(q, keys, values, mask)


def attention_parts(config: ModelConfig, contexts: list[int], block_size: int, num_blocks: int, repeats: int):
    """Median ms of one layer's decode attention (T = 1), each variant under TinyJit, interleaved."""
    from tinygrad import Tensor, TinyJit, UOp, dtypes

    from tinyvllm.attention.contiguous import ContiguousAttentionMetadata
    from tinyvllm.attention.paged import PagedAttentionMetadata

    H, KvH, Hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    max_len = max(contexts) + 1
    max_blocks = -(-max_len // block_size)
    rng = np.random.default_rng(0)
    cont_cache = (Tensor.randn(1, max_len, KvH, Hd).contiguous().realize(),
                  Tensor.randn(1, max_len, KvH, Hd).contiguous().realize())
    paged_cache = (Tensor.randn(num_blocks + 1, block_size, KvH, Hd).contiguous().realize(),
                   Tensor.randn(num_blocks + 1, block_size, KvH, Hd).contiguous().realize())
    table = Tensor(rng.permutation(num_blocks)[:max_blocks].astype(np.int32).reshape(1, -1)).realize()  # scattered
    v_pos = UOp.variable("start_pos", 0, max_len - 1)
    v_nb = UOp.variable("num_blocks", 1, max_blocks)

    def contiguous(q, k, v, pos, position):
        return ContiguousAttentionMetadata(pos).attend(q, k, v, cont_cache).realize()

    def paged(q, k, v, slot, position, nb):
        return PagedAttentionMetadata(slot, table, position, nb).attend(q, k, v, paged_cache).realize()

    def gather_only(q, k, v, slot, position, nb):
        rows = table[:, :nb]
        return Tensor.realize(paged_cache[0][rows].contiguous(), paged_cache[1][rows].contiguous())[0]

    def mask_only(q, k, v, slot, position, nb):
        key_pos = Tensor.arange(nb * block_size).reshape(1, -1)
        return (key_pos > position.reshape(1, 1)).where(1.0, 0.0).sum().realize()

    def paged_fixed_arange(q, k, v, slot, position, nb):
        return paged_attention_fixed_arange(q, *paged_cache, table, nb, position, max_blocks).realize()

    def call_overhead(q, k, v, slot, position, nb):
        return (q * 2).realize()

    variants = {"contiguous attend": contiguous, "paged attend": paged, "  gather K and V": gather_only,
                "  mask (symbolic arange)": mask_only, "paged, fixed-length arange": paged_fixed_arange,
                "(one tiny jitted kernel: call overhead)": call_overhead}
    jits = {name: TinyJit(fn) for name, fn in variants.items()}
    out = []
    for n in contexts:
        q = Tensor.randn(1, 1, H, Hd).realize()
        k, v = Tensor.randn(1, 1, KvH, Hd).realize(), Tensor.randn(1, 1, KvH, Hd).realize()
        position = Tensor([[n]], dtype=dtypes.int32).realize()
        nb = n // block_size + 1
        block_id = int(table.numpy()[0, n // block_size])
        slot = Tensor([block_id * block_size + n % block_size], dtype=dtypes.int32).realize()
        args = {name: ((q, k, v, v_pos.bind(n), position) if name == "contiguous attend"
                       else (q, k, v, slot, position, v_nb.bind(nb))) for name in variants}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(repeats + 3):  # 3 warm-up rounds: run, capture, replay
            for name, jit in jits.items():
                synchronize()
                t = time.perf_counter()
                jit(*args[name])
                synchronize()  # on a GPU the call returns before the kernels ran
                if i >= 3:
                    times[name].append(time.perf_counter() - t)
        out.append({"context": n, "ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()}})
    return out


def step_inputs_ms(max_blocks: int, repeats: int) -> dict[str, float]:
    """Median ms to make one decode step's inputs: a new tensor per input per step, against refilling
    persistent InputBuffers in place (the runners' way, docs/phases/01-appendix-tinygrad-speed.md)."""
    from tinygrad import Tensor, dtypes

    from tinyvllm.input_buffer import InputBuffer

    def contiguous_new():
        Tensor([[1]], dtype=dtypes.int32).realize()  # input_ids (the position is a bound variable)

    def paged_new():  # one realize per tensor
        Tensor([[1]], dtype=dtypes.int32).realize()  # input_ids
        Tensor([[100]], dtype=dtypes.int32).realize()  # positions
        Tensor([1600], dtype=dtypes.int32).realize()  # slot_mapping
        Tensor(np.zeros((1, max_blocks), dtype=np.int32)).realize()  # block_tables

    buffers = [InputBuffer(shape, np.int32, None) for shape in ((1, 1), (1, 1), (1,), (1, max_blocks))]
    table = np.zeros(max_blocks, np.int32)

    def paged_in_place():
        for buf, values in zip(buffers, (1, 100, 1600, table)):
            buf.write(values)

    variants = {"contiguous": contiguous_new, "paged": paged_new, "paged, in place": paged_in_place}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats + 3):
        for name, fn in variants.items():
            synchronize()
            t = time.perf_counter()
            fn()
            synchronize()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


# ---- reporting ----

def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(description="tinyvllm KV cache memory and paged-attention decode speed")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-model-len", type=int, default=None, help="context reserved per sequence by the "
                   "contiguous cache (default: the model's)")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences in the length mix (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the length mix (default 0)")
    p.add_argument("--budget", default="512MiB", help="KV cache memory for the fit and the paged engine "
                   "(default 512MiB)")
    p.add_argument("--contexts", default="128,512,2048", help="decode context lengths (default 128,512,2048)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per context and runner (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default 3)")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged engine (default 16)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds of part 5 (default 30)")
    p.add_argument("--memory-only", action="store_true", help="parts 1-3 only: no model, no device")
    p.add_argument("--kv-only", action="store_true", help="parts 1-3 and 6 only; writes only --json, not the "
                   "results file")
    p.add_argument("--kv-dtypes", default="float32,float16,int8,fp8", help="KV cache dtypes of part 6 "
                   "(default float32,float16,int8,fp8)")
    p.add_argument("--kv-seqs", type=int, default=8, help="sequences decoding at once in part 6 (default 8)")
    p.add_argument("--kv-context", type=int, default=4096, help="their context in part 6 (default 4096)")
    p.add_argument("--kv-steps", type=int, default=8, help="timed decode steps per KV dtype (default 8)")
    p.add_argument("--ppl-ctx", type=int, default=512, help="perplexity chunk length (default 512)")
    p.add_argument("--ppl-chunks", type=int, default=4, help="perplexity chunks at most (default 4)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    add_peers_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config, model_name = read_config(args.model)
    max_model_len = args.max_model_len or config.max_position_embeddings
    budget = parse_memory(args.budget)
    dtype_bytes = 4  # float32, tinyvllm's default
    per_token = kv_bytes_per_token(config, dtype_bytes)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine_description(),
                     "model": model_name, "args": vars(args), "kv_bytes_per_token": per_token}
    print(f"model     {model_name}: {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads of "
          f"{config.head_dim}, float32")
    print(f"machine   {results['machine']}")
    print(f"date      {results['date']}")

    # ---- 1 ----
    print("\n== 1. KV cache bytes ==")
    rows = [("per token: 2 (K, V) x layers x KV heads x head_dim x 4 B", f"{per_token:,} B",
             f"{per_token / 2**10:.0f} KiB")]
    rows += [(f"per block of {bs} tokens", f"{per_token * bs:,} B", f"{per_token * bs / MiB:.2f} MiB")
             for bs in BLOCK_SIZES]
    rows.append((f"per sequence at max_model_len {max_model_len}", f"{per_token * max_model_len:,} B",
                 f"{per_token * max_model_len / MiB:.0f} MiB"))
    print(table(rows, ("", "bytes", "")))

    # ---- 2 ----
    mix = length_mix(args.num_seqs, args.seed, max_model_len)
    cached = [p + o - 1 for p, o in mix]  # tokens whose K/V are in the cache when each sequence stops
    used = sum(cached) * per_token
    print(f"\n== 2. {len(mix)} sequences (seed {args.seed}): prompt tokens median "
          f"{np.median([p for p, _ in mix]):.0f}, output median {np.median([o for _, o in mix]):.0f}; cached tokens "
          f"at the end: mean {np.mean(cached):.0f}, max {max(cached)}, total {sum(cached):,} ==")
    longest = -(-max(cached) // 256) * 256
    mem_rows, mem = [], []
    for label, reserved in ((f"contiguous, max_model_len {max_model_len}", len(mix) * max_model_len * per_token),
                            (f"contiguous, max_model_len {longest} (the longest, rounded up)",
                             len(mix) * longest * per_token)):
        mem.append({"scheme": label, "bytes": reserved, "waste_bytes": reserved - used})
        mem_rows.append((label, f"{reserved / MiB:,.0f}", f"{(reserved - used) / MiB:,.0f}",
                         f"{(reserved - used) / reserved:.1%}", f"{(reserved - used) / per_token / len(mix):,.0f}"))
    for bs in BLOCK_SIZES:
        held = replay(mix, bs)
        held_bytes = sum(held) * bs * per_token
        waste_tokens = sum(held) * bs - sum(cached)
        assert all(h * bs - n < bs for h, n in zip(held, cached)), "waste must be under one block per sequence"
        mem.append({"scheme": f"paged, block_size {bs}", "blocks": sum(held), "bytes": held_bytes,
                    "waste_bytes": held_bytes - used})
        mem_rows.append((f"paged, block_size {bs} ({sum(held):,} blocks held)", f"{held_bytes / MiB:,.0f}",
                         f"{(held_bytes - used) / MiB:,.1f}", f"{(held_bytes - used) / held_bytes:.1%}",
                         f"{waste_tokens / len(mix):.1f}"))
    mem_rows.append(("the tokens themselves", f"{used / MiB:,.0f}", "0", "0%", "0"))
    print(table(mem_rows, ("KV cache", "MiB", "waste MiB", "waste %", "waste tokens / seq")))
    results["mix"] = {"prompt_output": mix, "cached_tokens": cached, "used_bytes": used, "schemes": mem}

    # ---- 3 ----
    print(f"\n== 3. sequences of the mix that fit in {args.budget} at once (at their full length) ==")
    fit_rows = [(f"contiguous, max_model_len {max_model_len}", budget // (max_model_len * per_token)),
                (f"contiguous, max_model_len {longest}", budget // (longest * per_token))]
    fit_rows += [(f"paged, block_size {bs} ({num_blocks_for_memory(config, bs, budget)} blocks)",
                  fit_in_budget(cached, config, bs, budget)) for bs in BLOCK_SIZES]
    print(table(fit_rows, ("KV cache", "sequences")))
    results["fit"] = {"budget_bytes": budget, "rows": dict(fit_rows)}
    kv_names = [n.strip() for n in args.kv_dtypes.split(",") if n.strip()]
    for name in kv_names:
        if name not in KV_CACHE_DTYPES:
            raise SystemExit(f"--kv-dtypes: {name!r} is none of {', '.join(KV_CACHE_DTYPES)}")
    kv: dict = {"bytes_per_token": {n: kv_cache_bytes_per_token(config, KV_CACHE_DTYPES[n]) for n in kv_names},
                "fit_draws": KV_FIT_DRAWS}
    # how many sequences fit is a small count at float32 (~25), and which sequence comes next decides it; so each
    # dtype is measured on KV_FIT_DRAWS draws of part 2's length distribution (seeds seed .. seed + draws - 1)
    draws = [[p + o - 1 for p, o in length_mix(KV_FIT_SEQS, args.seed + i, max_model_len)] for i in range(KV_FIT_DRAWS)]
    kv["fit_per_draw"] = {n: [fit_in_budget(d, config, args.block_size, budget, KV_CACHE_DTYPES[n]) for d in draws]
                          for n in kv_names}
    assert max(max(v) for v in kv["fit_per_draw"].values()) < KV_FIT_SEQS, "a draw ran out before the budget did"
    kv["fit"] = {n: float(np.mean(v)) for n, v in kv["fit_per_draw"].items()}
    if "float32" in kv_names:
        kv["fit_over_float32"] = {n: kv["fit"][n] / kv["fit"]["float32"] for n in kv_names}
    print(f"\n== 6a. the KV cache's dtype: bytes, and how many sequences of part 2's length distribution fit in "
          f"{args.budget} at once (block_size {args.block_size}; mean of {KV_FIT_DRAWS} draws) ==")
    print(table([(n, f"{kv['bytes_per_token'][n]:,}", f"{kv['fit'][n]:.1f}",
                  f"{kv.get('fit_over_float32', {}).get(n, float('nan')):.2f}") for n in kv_names],
                ("kv_cache_dtype", "bytes / token", "sequences", "x float32")))

    if args.kv_only or not args.memory_only:
        from tinyvllm.model.loader import load_model

        model, tokenizer, _ = load_model(args.model)
        print("\n(part 6: one engine per KV dtype, each prefilling its own cache: minutes on a small CPU)",
              file=sys.stderr, flush=True)
        kv["decode"] = kv_decode_speed(model, tokenizer, prompt_of_length(tokenizer, args.kv_context - args.warmup),
                                       kv_names, args.kv_seqs, args.kv_context, args.kv_steps, args.warmup,
                                       args.block_size)
        kv["attention_kernel_ms"] = kv_attention_kernel_ms(config, kv_names, args.kv_seqs, args.kv_context,
                                                           args.block_size, args.repeats)
        kv["perplexity"] = kv_perplexity(model, tokenizer, kv_names, args.ppl_ctx, args.ppl_chunks)
        d, ppl = kv["decode"], kv["perplexity"]
        print(f"\n== 6b. {d['num_seqs']} sequences decoding at context {d['context']} (the kernels; median of "
              f"{d['steps']} steps, engines in turn); one layer's attention kernel alone; perplexity of "
              f"{ppl['text']} ({ppl['chunks']} chunks of {ppl['n_ctx']}, {ppl['scored_tokens']} tokens scored) ==")
        if "rounding_error" in ppl:
            print("  the real K/V (float32 run, last chunk) stored per token: relative RMS error " + "; ".join(
                f"{n} {100 * e['rotated']:.2f}% rotated, {100 * e['plain']:.2f}% without the rotation"
                for n, e in ppl["rounding_error"].items()))
        print(table([(n, f"{d['tok_per_s'][n]:.1f}", f"{d.get('over_float32', {}).get(n, float('nan')):.2f}",
                      f"{kv['attention_kernel_ms'][n]:.2f}", f"{d['prefill_s'][n]:.1f}", f"{ppl['ppl'][n]:.4f}",
                      f"{ppl.get('ppl_delta_pct', {}).get(n, float('nan')):+.2f}%",
                      "yes" if d["same_tokens_as_float32"].get(n) else "no") for n in kv_names],
                    ("kv_cache_dtype", "decode tok/s", "x float32", "attention ms/layer", "prefill s",
                     "perplexity", "vs float32", "same tokens")))
    results["kv_dtypes"] = kv
    if args.kv_only:
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(results, indent=2, default=str) + "\n")
        return 0

    if not args.memory_only:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        # ---- 4 ----
        print("\nloading the model and compiling both runners (minutes on a small CPU) ...", file=sys.stderr,
              flush=True)
        speed = decode_speed(model, tokenizer, contexts, args.steps, args.warmup, budget, args.block_size)
        print(f"\n== 4. decode, one sequence, greedy: median of {args.steps} interleaved steps per runner after "
              f"{args.warmup} warm-up (paged: block_size {args.block_size}, {speed['num_blocks']} blocks; "
              f"max_model_len {speed['max_model_len']}) ==")
        print(table([(r["context"], f"{r['tok_per_s']['contiguous']:.1f}", f"{r['tok_per_s']['paged']:.1f}",
                      f"{r['paged_over_contiguous']:.2f}",
                      f"{r['step_ms_median']['paged'] - r['step_ms_median']['contiguous']:+.1f}",
                      "yes" if r["same_greedy_tokens"] else "NO") for r in speed["rows"]],
                    ("context", "contiguous tok/s", "paged tok/s", "paged / contiguous", "extra ms / token",
                     "same tokens")))
        results["decode"] = speed
        # ---- 5 ----
        parts = attention_parts(config, contexts, args.block_size, speed["num_blocks"], args.repeats)
        names = list(parts[0]["ms"])
        print(f"\n== 5. one layer's decode attention alone (median ms of {args.repeats}; x {config.num_hidden_layers} "
              "layers per token) ==")
        print(table([(name, *(f"{p['ms'][name]:.3f}" for p in parts)) for name in names],
                    ("", *(f"context {p['context']}" for p in parts))))
        results["attention_parts"] = parts
        inputs = step_inputs_ms(-(-speed["max_model_len"] // args.block_size), args.repeats)
        print(f"\nhost side, per decode step: making the step's inputs as new tensors takes "
              f"{inputs['contiguous']:.2f} ms (contiguous: 1 tensor) vs {inputs['paged']:.2f} ms (paged: 4 tensors); "
              f"refilling 4 InputBuffers in place (what the runners do) "
              f"{inputs['paged, in place']:.3f} ms")
        results["step_inputs_ms"] = inputs

    no_peer_twin(args, "llama.cpp has no paged-or-contiguous switch to measure (its KV cache is one pool of "
                 "token cells shared by all sequences)")
    figures = {k: v for k, v in results.items() if k not in ("date", "machine", "args")}
    write_results("bench_memory", figures, args, also=args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
