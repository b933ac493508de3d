"""`EngineArgs`: every knob of the engine under vLLM's names, as a dataclass, as command-line flags, and as the one
config tree the engine reads (vLLM's vllm/engine/arg_utils.py).

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)                 # --dtype, --max-model-len, --kv-cache-memory, ...
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))
    LLMEngine(model, max_num_seqs=8)                # or its keyword arguments: the same EngineArgs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from tinyvllm.sampling_params import MAX_LOGPROBS

KV_CACHE_DTYPES = ["auto", "float32", "float16", "int8", "fp8"]
QUANTIZATIONS = ["auto", "none", "q8_0", "q4_0", "q4_1", "iq4_nl", "q4_k"]


def dashed_flags(argv: list[str] | None) -> list[str]:
    """`--max_model_len` read as `--max-model-len`, as vLLM's parser reads a flag (argv None: the command line's)."""
    dashed = []
    for arg in sys.argv[1:] if argv is None else argv:
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            arg = name.replace("_", "-") + equals + value
        dashed.append(arg)
    return dashed


@dataclass
class EngineArgs:
    """The engine's arguments (see `add_cli_args` for what each means), checked when the config is made."""

    model: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_logprobs: int = MAX_LOGPROBS
    limit_mm_per_prompt: dict | None = None
    mmproj: str | os.PathLike | None = None
    seed: int = 0
    enforce_eager: bool = False
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    scheduling_policy: str = "fcfs"
    disable_chunked_mm_input: bool = False
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    portable_attention: bool = False

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """From the flags `add_cli_args` added (and --model, where the command has one)."""
        from tinyvllm.spec_decode.config import parse_speculative_config  # here: --help never imports it

        try:
            speculative_config = parse_speculative_config(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
        limit_mm_per_prompt = getattr(args, "limit_mm_per_prompt", None)
        if isinstance(limit_mm_per_prompt, str):
            try:
                limit_mm_per_prompt = json.loads(limit_mm_per_prompt)
            except json.JSONDecodeError as e:
                raise ValueError(f'--limit-mm-per-prompt takes JSON such as \'{{"image": 2}}\': {e}') from None
        names = {f.name for f in dataclasses.fields(cls)} - {"speculative_config", "limit_mm_per_prompt"}
        return cls(speculative_config=speculative_config, limit_mm_per_prompt=limit_mm_per_prompt,
                   **{name: getattr(args, name) for name in names if hasattr(args, name)})

    def create_engine_config(self):
        """The frozen config tree (tinyvllm/config.py); every value is checked as its part is made."""
        from tinyvllm.config import (
            CacheConfig,
            DeviceConfig,
            EngineConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
        )

        speculative_config = None
        if self.speculative_config is not None:  # Phase 7b: imported where a config asks for it
            from tinyvllm.spec_decode.config import SpeculativeConfig

            speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        return EngineConfig(
            ModelConfig(self.model, self.dtype, self.quantization, self.max_model_len, self.enforce_eager, self.seed,
                        self.max_logprobs, self.limit_mm_per_prompt, self.mmproj),
            CacheConfig(self.block_size, self.kv_cache_memory, self.gpu_memory_utilization,
                        self.num_gpu_blocks_override, self.enable_prefix_caching, self.kv_cache_dtype),
            SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.scheduling_policy,
                            self.disable_chunked_mm_input),
            ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size),
            DeviceConfig(self.device, self.portable_attention), speculative_config)

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine's flags (not --model: each command says how it takes the model)."""
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "float", "half"],
                       help="compute dtype: auto = float16 on a GPU, float32 on the CPU (default auto)")
        p.add_argument("--device", default=None,
                       help="tinygrad device, e.g. CPU, CUDA, METAL (default: tinygrad's choice)")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length to reserve (default: the model's)")
        p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                       help="the most logprobs (sampled or prompt) a request may ask for per position; -1: the whole "
                            f"vocabulary (vLLM's flag; default {MAX_LOGPROBS})")
        p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                       help='the most images one prompt may carry, e.g. \'{"image": 2}\' (vLLM\'s flag; default 999)')
        p.add_argument("--mmproj", default=None, metavar="FILE",
                       help="llama.cpp's mmproj GGUF: the vision tower for a text GGUF's images (llama.cpp's flag)")
        p.add_argument("--enforce-eager", action="store_true",
                       help="run each step as written, without captured graphs: slower, for debugging (vLLM's flag)")
        p.add_argument("--seed", type=int, default=0,
                       help="seeds the requests that give none, so a rerun samples the same text (vLLM's; default 0)")
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
                       help="fcfs: in arrival order; priority: by each request's 'priority' (lower first; "
                            "default fcfs)")
        p.add_argument("--disable-chunked-mm-input", action="store_true",
                       help="schedule an image's tokens in one step, never split across prefill chunks (vLLM's flag; "
                            "always on for a model whose image tokens attend both ways, Gemma 3)")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of prompt prefixes seen before (default on, as in vLLM)")
        p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="how K/V are stored: auto = the compute dtype; int8 and fp8 (e4m3) keep one scale per "
                            "token per KV head, about a quarter of float32's bytes (default auto)")
        p.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATIONS,
                       help="weights: auto keeps a GGUF's quantized blocks (fused kernels), none dequantizes them, "
                            "q8_0/q4_0/q4_1 quantize at load (default auto)")
        p.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4}\' (docs/phases/07b-speculative-decoding.md; default off)')
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split every layer over N devices of --device's kind (Megatron-style tensor parallel; "
                            "N must divide the attention heads, and divide or be a multiple of the KV heads) "
                            "(default 1)")
        p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="put consecutive layers on N devices of --device's kind, the hidden state passed between "
                            "them (pipeline parallel; any head count) (default 1)")
        return p
