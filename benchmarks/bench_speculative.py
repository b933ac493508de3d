"""Speculative decoding on and off in one run (Phase 7b, docs/phases/07b-speculative-decoding.md).

    .venv/bin/python benchmarks/bench_speculative.py                          # the three parts below
    .venv/bin/python benchmarks/bench_speculative.py --parts ngram,batch --concurrency 1,4,32

Each part builds an engine with speculation off and one with it on, on the same weights, and runs the same
greedy requests on both, taking turns (off, on, off, on, ...), so a change of load on shared cores falls on both.

    ngram        prompt lookup (no second model) on copy-heavy chat prompts: edit this code, repeat this passage
                 with a change, extract fields from a given text. One request at a time; its decode tok/s =
                 (output tokens - 1) / (last token - first token), the median of --repeats runs.
    draft_model  the float32 target (quantization "none") with the same checkpoint, quantized, as its draft,
                 on free text: decode tok/s as above, and the greedy output must be the same token for token
                 (printed; the run fails if not).
    batch        bench_throughput's workload (N requests of --prompt-len tokens at once, --output-len each,
                 greedy, ignore_eos): total tok/s with ngram speculation always on (disable_by_batch_size None)
                 against off, for each N of --concurrency. The crossover is the largest N up to which
                 speculation still wins; then N = 32 and 64 again with SpeculativeConfig's default
                 disable_by_batch_size, which must keep them within 5% of off.

Every part also prints the acceptance rate (accepted / drafted tokens) and the mean accepted length (tokens a
verify step emitted: accepted drafts + the target's own one), from get_stats()'s spec_decode_* counters.
Results go to benchmarks/results/bench_speculative.json. llama.cpp's twins (llama-speculative, llama-lookup) are
looked for in --peers DIR; where they are not built, the run says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench_throughput import make_prompts, warm_up  # (benchmarks/bench_throughput.py)
from common import (BenchParser, add_peers_arg, code_version, load_average, log, machine_description, table,
                    write_results)

from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.weights import default_model_path
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode.config import SpeculativeConfig

CODE = '''def area(r):
    return 3.14159 * r * r


def perimeter(r):
    return 2 * 3.14159 * r


def describe(r):
    print("radius", r, "area", area(r), "perimeter", perimeter(r))
'''
PASSAGE = ("The river rises in the hills above the old mill, runs south through the town, and meets the sea "
           "at a wide, shallow bay. In summer the water is low and clear; children wade across at the ford, "
           "and the mill's wheel stands still. In autumn the rains come, the river fills its banks, and the "
           "wheel turns again from October until April.")
LOG = """2026-03-02 10:14:03 INFO server started on port 8080
2026-03-02 10:14:09 ERROR database connection refused: host db-1, port 5432
2026-03-02 10:15:22 INFO request GET /index.html 200
2026-03-02 10:16:40 ERROR disk /var/data is 98% full
2026-03-02 10:17:05 WARNING slow request GET /report 2.4 s
2026-03-02 10:18:51 ERROR worker 3 crashed: out of memory
"""
RECORD = ("name: Maria Lopez\njob: nurse\nworkplace: Riverside Hospital\ncity: Portland\n"
          "email: maria.lopez@example.org\nphone: 555-0142\n")
# copy-heavy: the answer quotes the prompt, so the tokens after an earlier occurrence are often the next ones
NGRAM_WORKLOADS = {
    "edit_code": f"Rename the function `area` to `circle_area` everywhere in this code. Reply with the whole "
                 f"code only.\n\n```python\n{CODE}```",
    "repeat_passage": f"Repeat this passage word for word, but write 'north' instead of 'south':\n\n{PASSAGE}",
    "extract_lines": f"Extract the lines with ERROR from this log, unchanged:\n\n{LOG}",
    # the values are copied, but the JSON around them is not in the prompt: fewer drafts are right
    "extract_json": f"Extract the fields of this record as a JSON object with the same keys:\n\n{RECORD}",
}
# free text: nothing to copy, the draft model has to guess
FREE_TEXT = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "explain": "Explain to a ten-year-old how a bicycle stays upright.",
}
CHECKED_BATCH_SIZES = (32, 64)  # where speculation may cost at most 5% (issue 14)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                            add_special_tokens=False)


def spec_counters(engine: LLMEngine) -> dict:
    stats = engine.get_stats()
    return {name: stats.get(f"spec_decode_{name}", 0)
            for name in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_verify_steps")}


def acceptance(engine: LLMEngine, before: dict) -> dict:
    """Acceptance rate and mean accepted length of what the engine verified since `before` (spec_counters)."""
    now = spec_counters(engine)
    delta = {name: now[name] - before[name] for name in now}
    drafts, accepted, steps = delta["num_draft_tokens"], delta["num_accepted_tokens"], delta["num_verify_steps"]
    return {**delta, "acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0}


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int, tag: str) -> tuple[list[int], float]:
    """One greedy request alone: (its output token ids, decode tok/s after the first token)."""
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = out
    ids, m = result.outputs[0].token_ids, result.metrics
    return list(ids), (len(ids) - 1) / (m.finished_time - m.first_token_time)


def compare_single(off: LLMEngine, on: LLMEngine, workloads: dict[str, str], max_tokens: int,
                   repeats: int) -> list[dict]:
    """Each workload alone on both engines, `repeats` times taking turns; the first run of each is a warm-up."""
    rows = []
    for name, text in workloads.items():
        prompt = chat_ids(off, text)
        reference, _ = run_one(off, prompt, max_tokens, f"{name}-warm-off")
        run_one(on, prompt, max_tokens, f"{name}-warm-on")
        speeds, before, differ = {"off": [], "on": []}, spec_counters(on), None
        for i in range(repeats):
            for label, engine in (("off", off), ("on", on)):
                ids, tok_s = run_one(engine, prompt, max_tokens, f"{name}-{label}-{i}")
                speeds[label].append(tok_s)
                if ids != reference and differ is None:  # greedy: speculation must not change a token
                    differ = next((j for j, (a, b) in enumerate(zip(ids, reference)) if a != b),
                                  min(len(ids), len(reference)))
                    log(f"{name}: the output with speculation {label} differs from off's at token {differ}:\n"
                        f"{off.tokenizer.decode(reference)!r}\n{off.tokenizer.decode(ids)!r}")
        off_tok_s, on_tok_s = statistics.median(speeds["off"]), statistics.median(speeds["on"])
        rows.append({"name": name, "prompt_tokens": len(prompt), "output_tokens": len(reference),
                     "off_tok_s": off_tok_s, "on_tok_s": on_tok_s, "speedup": on_tok_s / off_tok_s,
                     "identical": differ is None, "first_difference": differ, **acceptance(on, before),
                     "runs_tok_s": speeds,
                     "output": off.tokenizer.decode(reference), "load_average": load_average()})
        log(f"{name}: off {off_tok_s:.1f} tok/s, on {on_tok_s:.1f} tok/s ({on_tok_s / off_tok_s:.2f}x), "
            f"acceptance {rows[-1]['acceptance_rate']:.2f}, load average {load_average()}")
    return rows


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """All prompts at once until all finish: total tok/s (output tokens / wall time, prefill included)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * output_len / (time.perf_counter() - start)


def compare_batches(off: LLMEngine, on: LLMEngine, levels: list[int], args, first_prompt: int) -> list[dict]:
    """Total tok/s at each N, off then on, each on fresh prompts (prefix caching would skip a repeated prefill)."""
    rows = []
    for n in levels:
        prompts = make_prompts(off, n, args.prompt_len, first=first_prompt)
        first_prompt += n
        before = spec_counters(on)
        off_tok_s = run_batch(off, prompts, args.output_len, f"off-{n}")
        on_tok_s = run_batch(on, prompts, args.output_len, f"on-{n}")
        rows.append({"concurrency": n, "off_tok_s": off_tok_s, "on_tok_s": on_tok_s, "ratio": on_tok_s / off_tok_s,
                     **acceptance(on, before), "load_average": load_average()})
        log(f"concurrency {n}: off {off_tok_s:.1f} tok/s, on {on_tok_s:.1f} tok/s ({on_tok_s / off_tok_s:.2f}x), "
            f"acceptance {rows[-1]['acceptance_rate']:.2f}, load average {load_average()}")
    return rows


def crossover(sweep: list[dict]) -> tuple[int | None, int | None]:
    """(the largest N up to which speculation never lost, the first N where it lost): speculation pays up to the
    first and should be off from the second on (disable_by_batch_size). None where there is no such N."""
    wins = None
    for row in sorted(sweep, key=lambda r: r["concurrency"]):
        if row["ratio"] < 1.0:
            return wins, row["concurrency"]
        wins = row["concurrency"]
    return wins, None


def print_single(title: str, rows: list[dict]) -> None:
    print(f"\n== {title} ==")
    print(table([(r["name"], r["output_tokens"], f"{r['off_tok_s']:.1f}", f"{r['on_tok_s']:.1f}",
                  f"{r['speedup']:.2f}x", f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}",
                  "yes" if r["identical"] else f"no, from token {r['first_difference']}")
                 for r in rows], ("workload", "tokens", "off tok/s", "on tok/s", "speedup", "acceptance",
                                  "mean accepted length", "same output")))


def print_batches(title: str, rows: list[dict]) -> None:
    print(f"\n== {title} ==")
    print(table([(r["concurrency"], f"{r['off_tok_s']:.1f}", f"{r['on_tok_s']:.1f}", f"{r['ratio']:.2f}x",
                  f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}", r["load_average"])
                 for r in rows], ("N", "off tok/s", "on tok/s", "on / off", "acceptance", "mean accepted length",
                                  "load avg after")))


def peer_twins(peers_dir: str | None) -> str:
    """What --peers found: llama.cpp's speculative tools, when built."""
    if peers_dir is None:
        return "not asked (--peers)"
    found = [tool for tool in ("llama-speculative", "llama-lookup")
             if any(Path(peers_dir).glob(f"**/bin/{tool}"))]
    if not found:
        return ("absent: llama-speculative and llama-lookup are not built in --peers DIR (its build has "
                "llama-bench, llama-batched-bench, llama-server, ...), so no same-run llama.cpp figure")
    return f"found {', '.join(found)}; not run by this script yet"


def main(argv: list[str] | None = None) -> None:
    p = BenchParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="ngram,draft_model,batch", help="which parts to run, comma-separated")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=7,
                   help="k, drafts per step (default 7: a verify pass of 1 + 7 tokens fills the 8-token bucket)")
    p.add_argument("--draft-k", type=int, default=3,
                   help="draft_model part: k (default 3: each draft token costs a decode step of the draft model)")
    p.add_argument("--max-tokens", type=int, default=160, help="most output tokens per single request (default 160)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and workload (default 3)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="batch part: the N swept, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32, help="batch part: prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="batch part: output tokens per request (default 128)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the engines' token budget per step "
                   "(default 1024, as bench_throughput)")
    add_peers_arg(p)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"ngram", "draft_model", "batch"})
    if unknown:
        p.error(f"--parts: unknown {unknown}; the parts are ngram, draft_model, batch")
    levels = sorted(int(n) for n in args.concurrency.split(","))
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    default_disable = SpeculativeConfig.from_dict(ngram).disable_by_batch_size
    most = max([*levels, *CHECKED_BATCH_SIZES])
    engine_args = dict(max_model_len=2048, max_num_seqs=most, max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory="1GiB")
    figures: dict = {"model": default_model_path().name, "num_speculative_tokens": k,
                     "peers": peer_twins(args.peers)}

    if "ngram" in parts or "batch" in parts:
        # the shipped quantized weights; speculation always on here, to measure where it stops paying
        off = LLMEngine(**engine_args)
        on = LLMEngine(**engine_args, speculative_config={**ngram, "disable_by_batch_size": None})
        # compile every token bucket before the clock starts (one request alone needs only the small ones); each
        # engine its own: speculation's k + 1 tokens have a bucket of their own
        for engine in (off, on):
            warm_up(engine, [b for b in engine.model_runner.token_buckets if "batch" in parts or b <= 256], log=log)
    if "ngram" in parts:
        figures["ngram"] = {"workloads": compare_single(off, on, NGRAM_WORKLOADS, args.max_tokens, args.repeats)}
    if "batch" in parts:
        sweep = compare_batches(off, on, levels, args, first_prompt=0)
        wins_up_to, loses_from = crossover(sweep)
        # the check runs the config's default; while it has none, the value this sweep suggests
        checked_value = default_disable if default_disable is not None else loses_from
        # the same engine, its graphs already captured, as if built with that value (the speculator reads its
        # config each step)
        speculator = on.model_runner.speculator
        speculator.config = dataclasses.replace(speculator.config, disable_by_batch_size=checked_value)
        checked = compare_batches(off, on, list(CHECKED_BATCH_SIZES), args, first_prompt=sum(levels))
        figures["batch"] = {"prompt_len": args.prompt_len, "output_len": args.output_len, "sweep": sweep,
                            "wins_up_to": wins_up_to, "loses_from": loses_from,
                            "config_default_disable_by_batch_size": default_disable,
                            "checked_disable_by_batch_size": checked_value, "checked": checked,
                            "worst_checked_ratio": min(row["ratio"] for row in checked)}
    if "draft_model" in parts:
        draft = {"method": "draft_model", "num_speculative_tokens": args.draft_k, "model": str(default_model_path()),
                 "quantization": "auto"}
        args_f32 = dict(engine_args, max_num_seqs=1, max_num_batched_tokens=256, kv_cache_memory="256MiB",
                        quantization="none")
        target_off, target_on = LLMEngine(**args_f32), LLMEngine(**args_f32, speculative_config=draft)
        for engine in (target_off, target_on):
            warm_up(engine, log=log)
        rows = compare_single(target_off, target_on, FREE_TEXT, args.max_tokens, args.repeats)
        figures["draft_model"] = {"target_quantization": "none", "draft_quantization": "auto",
                                  "num_speculative_tokens": args.draft_k, "workloads": rows}

    print(f"bench_speculative: {figures['model']}, {machine_description(False)}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"code: {code_version()}; k = {k} drafts per step, greedy; decode tok/s = (tokens - 1) / (last - first "
          f"token), median of {args.repeats} runs per engine")
    if "ngram" in figures:
        print_single("ngram (prompt lookup), one request at a time, quantized weights (auto)",
                     figures["ngram"]["workloads"])
    if "draft_model" in figures:
        print_single(f"draft_model (k = {args.draft_k}): float32 target (quantization none), draft = the same GGUF "
                     f"quantized (auto)",
                     figures["draft_model"]["workloads"])
        for row in figures["draft_model"]["workloads"]:
            same = "the same tokens on and off" if row["identical"] else "DIFFERENT with speculation on"
            print(f"{row['name']} ({row['output_tokens']} tokens, {same}): {row['output']!r}")
    if "batch" in figures:
        b = figures["batch"]
        print_batches(f"ngram, N requests at once ({args.prompt_len} prompt tokens, {args.output_len} out, "
                      f"ignore_eos), speculation always on", b["sweep"])
        print(f"crossover: speculation wins up to N = {b['wins_up_to']} (on / off >= 1 at every N up to it) and "
              f"loses from N = {b['loses_from']}")
        print_batches(f"N = 32 and 64 with disable_by_batch_size = {b['checked_disable_by_batch_size']} "
                      f"(SpeculativeConfig's default: {default_disable})", b["checked"])
        print(f"worst on / off with it: {b['worst_checked_ratio']:.2f}x (the target: >= 0.95x)")
    print(f"\n--peers: {figures['peers']}")
    write_results("bench_speculative", figures, args)


if __name__ == "__main__":
    main()
