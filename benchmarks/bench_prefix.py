"""What automatic prefix caching buys: the same workloads with it on and off, in one run (Phase 7).

    .venv/bin/python benchmarks/bench_prefix.py                    # both workloads, caching on and off
    .venv/bin/python benchmarks/bench_prefix.py --peers DIR        # + llama-server with cache_prompt on / off

  1. Shared system prompt: a ~1,000-token system prompt and a ~20-token question, 16 requests one after the
     other (each arrives when the one before has its answer). Time to first token per request, p50.
  2. Multi-turn chat replay: 16 users, 6 turns each, every turn resends the whole history (as chat clients
     do) plus a new question; a user's next turn arrives when its previous answer is complete, all 16 users
     at once. Total generated tokens/s, and the mean time to first token of each turn.
  3. n = 4 completions of one ~500-token prompt (sampled, seeded): one request with n = 4 (the engine adds the
     first completion, then the others once its prompt is in the prefix cache, so they compute only its last
     partial block) against the same four completions as four n = 1 requests arriving together, with prefix
     caching off (each computes and holds the prompt) and on (admitted in one step, before any block of the
     prompt is full, they still compute it each). The step profile counts the prompt tokens each step
     computes; the blocks in use show the KV memory the prompt holds. Each mode has a prompt of its own.

Both engines share one loaded model in this process and have warmed up the same graphs before timing. The
first request of workload 1 pays for putting the system prompt into the cache; its figure is kept apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import BenchParser, add_peers_arg, find_peers, log, machine_description, table, write_results  # noqa: E402

TEXT = ("The history of computing is a story of ideas building on ideas. Early machines filled rooms and were "
        "programmed by rewiring them; later, stored programs let the same hardware run any algorithm. Memory "
        "grew faster than anyone expected, and so did the software that filled it. ")


def tokens_of_length(tokenizer, n: int, offset: int = 0) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = ids * (n // len(ids) + 2)
    return ids[offset:offset + n]


def questions(tokenizer, count: int, length: int) -> list[list[int]]:
    """Distinct short questions: the same text at different offsets, with a number in front."""
    return [tokenizer.encode(f" Question {i}:", add_special_tokens=False) + tokens_of_length(tokenizer, length, 7 * i)
            for i in range(count)]


def first_token_times(engine, prompts: list[list[int]], params) -> list[float]:
    """One request after the other: seconds from add_request to its first output."""
    times = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"shared-{id(engine)}-{i}-{time.monotonic_ns()}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and outputs:
                first = time.perf_counter() - start
        times.append(first)
    return times


def chat_replay(engine, system: list[int], turns: list[list[list[int]]], params) -> dict:
    """Every user's turns in order, all users at once; returns the throughput and TTFT per turn."""
    history = {user: list(system) for user in range(len(turns))}
    turn_of = {user: 0 for user in history}
    ttft: dict[int, list[float]] = {t: [] for t in range(len(turns[0]))}
    started, generated, start = {}, 0, time.perf_counter()

    def submit(user: int) -> None:
        prompt = history[user] + turns[user][turn_of[user]]
        request_id = f"chat-{user}-{turn_of[user]}"
        started[request_id] = (time.perf_counter(), prompt)
        engine.add_request(request_id, prompt, params)

    for user in history:
        submit(user)
    seen: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            begun, prompt = started[out.request_id]
            if out.request_id not in seen:
                seen.add(out.request_id)
                ttft[int(out.request_id.split("-")[2])].append(time.perf_counter() - begun)
            if out.finished:
                user = int(out.request_id.split("-")[1])
                generated += len(out.outputs[0].token_ids)
                history[user] = prompt + out.outputs[0].token_ids
                turn_of[user] += 1
                if turn_of[user] < len(turns[user]):
                    submit(user)
    elapsed = time.perf_counter() - start
    return {"generated_tokens": generated, "seconds": elapsed, "tok_s": generated / elapsed,
            "ttft_mean_s_per_turn": [statistics.mean(ttft[t]) for t in sorted(ttft)]}


def shared_prompt_n(engine, prompt: list[int], params, shared: bool) -> dict:
    """n completions of one prompt: one request with n (shared), or n requests with n = 1 and seed + i. Returns
    the step profile (prompt tokens computed and blocks in use per step) and the timings."""
    from tinyvllm.sampling_params import SamplingParams

    bm, scheduler = engine.scheduler.block_manager, engine.scheduler
    outputs: list = []
    schedule = scheduler.schedule

    def profiled():
        out = schedule()
        outputs.append(out)
        return out

    if shared:
        engine.add_request(f"n-{time.monotonic_ns()}", prompt, params)
    else:
        for i in range(params.n):
            one = SamplingParams(**{**params.__dict__, "n": 1, "seed": params.seed + i})
            engine.add_request(f"one-{i}-{time.monotonic_ns()}", prompt, one)
    steps, first, start = [], None, time.perf_counter()
    scheduler.schedule = profiled
    try:
        while engine.has_unfinished_requests():
            got = engine.step()
            first = first or (time.perf_counter() - start if got else None)
            so = outputs[-1]
            prompt_tokens = sum(max(0, min(s.num_prompt_tokens, s.num_computed_tokens)
                                    - (s.num_computed_tokens - so.num_scheduled_tokens[s.seq_id]))
                                for s in so.scheduled_seqs if not s.is_finished)
            steps.append({"prompt_tokens": prompt_tokens, "tokens": so.total_num_scheduled_tokens,
                          "blocks_used": bm.num_blocks - bm.num_free_blocks})
    finally:
        del scheduler.schedule
    elapsed = time.perf_counter() - start
    return {"prompt_tokens_computed": sum(s["prompt_tokens"] for s in steps),
            "peak_blocks_used": max(s["blocks_used"] for s in steps),
            "ttft_s": first, "total_s": elapsed,
            "steps": steps[:4]}


def build_parser() -> argparse.ArgumentParser:
    p = BenchParser(description="prefix caching on and off: shared system prompt, multi-turn chat")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt length (default 1000)")
    p.add_argument("--question-tokens", type=int, default=20, help="question length (default 20)")
    p.add_argument("--requests", type=int, default=16, help="requests of workload 1 (default 16)")
    p.add_argument("--users", type=int, default=16, help="chat users of workload 2 (default 16)")
    p.add_argument("--turns", type=int, default=6, help="turns per user (default 6)")
    p.add_argument("--chat-system-tokens", type=int, default=100, help="workload 2's system prompt (default 100)")
    p.add_argument("--output-len", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--n-prompt-tokens", type=int, default=500, help="workload 3's prompt (default 500)")
    p.add_argument("--n", type=int, default=4, help="workload 3's completions per prompt (default 4)")
    add_peers_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    llama = find_peers(args)
    from tinyvllm.engine.llm_engine import LLMEngine
    from tinyvllm.model.loader import load_model
    from tinyvllm.sampling_params import SamplingParams

    model, tokenizer, path = load_model()
    engines = {caching: LLMEngine(model, tokenizer=tokenizer, max_model_len=2048, max_num_seqs=32,
                                  max_num_batched_tokens=512, kv_cache_memory="1GiB", enable_prefix_caching=caching)
               for caching in (True, False)}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    system = tokens_of_length(tokenizer, args.system_tokens)
    asked = questions(tokenizer, args.requests + 2, args.question_tokens)
    print(f"model {path.name}   machine {machine_description()}")

    results: dict = {"shared_system_prompt": {}, "chat_replay": {}}
    log("warm-up: every graph both workloads use, in both engines ...")
    other_system = tokens_of_length(tokenizer, args.system_tokens, 11)  # same length, not the measured prompt
    for engine in engines.values():
        first_token_times(engine, [other_system + q for q in asked[-2:]], params)
    for caching, engine in engines.items():
        name = "on" if caching else "off"
        log(f"workload 1, caching {name}: {args.requests} requests of {len(system)} + ~{args.question_tokens} tokens")
        times = first_token_times(engine, [system + q for q in asked[:args.requests]], params)
        stats = engine.get_stats()
        results["shared_system_prompt"][name] = {
            "ttft_first_s": times[0], "ttft_p50_s": statistics.median(times[1:]), "ttft_all_s": times,
            "prefix_cache_hit_rate": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)}
    on, off = results["shared_system_prompt"]["on"], results["shared_system_prompt"]["off"]
    on["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    print(f"\n== 1. shared system prompt ({len(system)} tokens) + a question, {args.requests} requests in turn ==")
    print(table([(name, f"{r['ttft_first_s'] * 1e3:.0f}", f"{r['ttft_p50_s'] * 1e3:.0f}",
                  f"{r['prefix_cache_hit_rate']:.0%}") for name, r in results["shared_system_prompt"].items()],
                ("prefix caching", "first request TTFT ms", "TTFT p50 ms (the rest)", "hit rate (tokens)")))
    print(f"TTFT p50 with caching: {on['ttft_p50_speedup']:.1f}x lower than without")

    chat_system = tokens_of_length(tokenizer, args.chat_system_tokens, 3)
    chat_questions = questions(tokenizer, args.users * args.turns, args.question_tokens)
    turns = [chat_questions[u * args.turns:(u + 1) * args.turns] for u in range(args.users)]
    chat_params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for caching, engine in engines.items():
        name = "on" if caching else "off"
        log(f"workload 2, caching {name}: {args.users} users x {args.turns} turns ...")
        results["chat_replay"][name] = chat_replay(engine, chat_system, turns, chat_params)
    on, off = results["chat_replay"]["on"], results["chat_replay"]["off"]
    on["throughput_vs_off"] = on["tok_s"] / off["tok_s"]
    print(f"\n== 2. multi-turn chat: {args.users} users x {args.turns} turns, each turn resends the history ==")
    print(table([(name, f"{r['tok_s']:.1f}", *(f"{t * 1e3:.0f}" for t in r["ttft_mean_s_per_turn"]))
                 for name, r in results["chat_replay"].items()],
                ("prefix caching", "generated tok/s", *(f"TTFT turn {t + 1} ms" for t in range(args.turns)))))
    print(f"throughput with caching: {on['throughput_vs_off']:.2f}x the run without")

    n_params = SamplingParams(n=args.n, temperature=0.8, seed=1, max_tokens=args.output_len, ignore_eos=True)
    # mode -> (prefix caching, one request with n), each on a prompt of its own (a cache must not serve a mode
    # the prompt of another)
    modes = {"shared_n": (True, True), "separate_n1": (False, False), "separate_n1_caching_on": (True, False)}
    prompts = {name: tokens_of_length(tokenizer, args.n_prompt_tokens, 5 + 101 * i) for i, name in enumerate(modes)}
    n_prompt = prompts["shared_n"]
    log(f"workload 3: n={args.n} completions of a {len(n_prompt)}-token prompt, shared and not ...")
    for engine in engines.values():  # warm-up: the graphs these steps use, on another prompt of the same length
        for shared in (True, False):
            shared_prompt_n(engine, tokens_of_length(tokenizer, args.n_prompt_tokens, 13), n_params, shared)
    results["n_completions"] = {name: shared_prompt_n(engines[caching], prompts[name], n_params, shared)
                                for name, (caching, shared) in modes.items()}
    results["n_completions"]["prompt_blocks"] = -(-len(n_prompt) // 16)
    print(f"\n== 3. n={args.n} completions of one {len(n_prompt)}-token prompt (block_size 16: "
          f"{-(-len(n_prompt) // 16)} blocks) ==")
    print(table([(name, str(r["prompt_tokens_computed"]), str(r["steps"][0]["prompt_tokens"]),
                  str(r["peak_blocks_used"]), f"{r['ttft_s'] * 1e3:.0f}", f"{r['total_s']:.2f}")
                 for name, r in results["n_completions"].items() if isinstance(r, dict)],
                ("completions", "prompt tokens computed", "in step 1", "peak blocks used", "TTFT ms", "total s")))

    if llama is not None:
        results["peers"] = {"llama_server_q4_1": peer_shared_prompt(llama, system, asked[:args.requests])}
        peer = results["peers"]["llama_server_q4_1"]
        print("\n== llama-server (shipped Q4_1 weights), workload 1, same prompts ==")
        print(table([(name, f"{peer[name]['ttft_p50_s'] * 1e3:.0f}") for name in ("cache_prompt", "no_cache_prompt")],
                    ("llama-server", "TTFT p50 ms")))
    write_results("bench_prefix", results, args)
    return 0


def peer_shared_prompt(llama, system: list[int], asked: list[list[int]]) -> dict:
    """llama-server, one slot, the same token prompts one after the other, with cache_prompt on and off."""
    out = {}
    with llama.server("Q4_1", context=4096) as url:
        from peers.llama_cpp import http_json

        for name, cache in (("no_cache_prompt", False), ("cache_prompt", True)):
            http_json(f"{url}/completion", {"prompt": system + asked[0], "n_predict": 1, "cache_prompt": cache})
            times = []
            for question in asked:
                start = time.perf_counter()
                http_json(f"{url}/completion", {"prompt": system + question, "n_predict": 1, "temperature": 0,
                                                "cache_prompt": cache}, timeout=600)
                times.append(time.perf_counter() - start)
            out[name] = {"ttft_p50_s": statistics.median(times), "ttft_all_s": times}
    return out


if __name__ == "__main__":
    sys.exit(main())
