"""The engine's command-line flags, written once for every command that builds an `LLMEngine`: `tinyvllm generate` /
`chat` / `python main.py` (tinyvllm/cli.py) and the server (tinyvllm/api/cli_args.py). vLLM does the same with
`AsyncEngineArgs.add_cli_args` (vllm/engine/arg_utils.py); the flags keep vLLM's names.

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                         # --dtype, --max-model-len, --kv-cache-memory, ...
    args = parser.parse_args()
    engine = LLMEngine(args.model, **engine_kwargs(args))

Only argparse is imported here, so a command's --help stays instant.
"""

from __future__ import annotations

import argparse

KV_CACHE_DTYPES = ["auto", "float32", "float16", "int8", "fp8"]
QUANTIZATIONS = ["auto", "none", "q8_0", "q4_0", "q4_1", "iq4_nl", "q4_k"]


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add LLMEngine's flags (not --model: each command says how it takes the model)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
    p.add_argument("--device", default=None, help="tinygrad device, e.g. CPU, CUDA, METAL (default: tinygrad's choice)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length to reserve (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="memory for the paged KV cache, e.g. 2GiB (default: 512MiB on the CPU; on a GPU what "
                        "--gpu-memory-utilization leaves)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of a GPU's memory the engine may take; the KV cache gets what the weights and a "
                        "step's activations leave of it (vLLM's flag; default 0.9 on a GPU)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one batch (default 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step (default 512)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: in arrival order; priority: by each request's 'priority' (lower first; default fcfs)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes seen before (default on, as in vLLM)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="how K/V are stored: auto = the compute dtype; int8 and fp8 (e4m3) keep one scale per token "
                        "per KV head, about a quarter of float32's bytes (default auto)")
    p.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATIONS,
                   help="weights: auto keeps a GGUF's quantized blocks (fused kernels), none dequantizes them, "
                        "q8_0/q4_0/q4_1 quantize at load (default auto)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (docs/phases/07b-speculative-decoding.md; default off)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer over N devices of --device's kind (Megatron-style tensor parallel; N must "
                        "divide the attention heads, and divide or be a multiple of the KV heads) (default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="put consecutive layers on N devices of --device's kind, the hidden state passed between them "
                        "(pipeline parallel; any head count) (default 1)")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of LLMEngine (all but the model) from flags `add_engine_args` added. The JSON of
    --speculative-config is checked here, before any model loads: a ValueError says what is wrong."""
    from tinyvllm.spec_decode.config import parse_speculative_config  # here: --help never imports it

    try:
        speculative_config = parse_speculative_config(args.speculative_config)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                scheduling_policy=args.scheduling_policy, enable_prefix_caching=args.enable_prefix_caching,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                speculative_config=speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size)
