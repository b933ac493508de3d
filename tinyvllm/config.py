"""The engine's configuration: one frozen tree, built once from `EngineArgs` (engine/arg_utils.py), read everywhere.

    EngineConfig                       (vLLM's VllmConfig)
      model_config      ModelConfig       which checkpoint, its dtype and weight format, the context length
      cache_config      CacheConfig       KV blocks: size, budget, dtype, prefix caching
      scheduler_config  SchedulerConfig   the limits of one step and the queue's order
      parallel_config   ParallelConfig    how many devices a layer, or the stack of layers, is split over
      device_config     DeviceConfig      which device, which attention kernels
      speculative_config                  SpeculativeConfig or None (Phase 7b, spec_decode/config.py)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyvllm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from tinygrad.dtype import DType

    from tinyvllm.spec_decode.config import SpeculativeConfig


MAX_IMAGES_PER_PROMPT = 999  # vLLM's default limit per modality


@dataclass(frozen=True)
class ModelConfig:
    model: str | os.PathLike | None = None  # a .gguf file, an HF directory; None: the default model
    dtype: str | DType = "auto"  # "auto": float16 on a GPU, float32 on the CPU (tinyvllm/platforms.py)
    quantization: str = "auto"  # "auto" keeps a GGUF's blocks, "none" dequantizes, "q8_0"/... quantize at load
    max_model_len: int | None = None  # None: the model's, at most what the KV cache holds
    enforce_eager: bool = False  # vLLM's: every step scheduled anew, no captured graphs (slow; for debugging)
    seed: int = 0  # vLLM's: where unseeded random requests' seeds come from (the same run twice: the same text)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs alternatives a request may ask for; -1: the vocabulary
    limit_mm_per_prompt: dict | None = None  # vLLM's: the most images one prompt may carry, {"image": N} (default 999)
    mmproj: str | os.PathLike | None = None  # llama.cpp's: the vision tower's GGUF beside a text model

    def __post_init__(self) -> None:
        from tinyvllm.model.loader import check_dtype
        from tinyvllm.model.weights import check_quantization

        check_quantization(self.quantization)
        check_dtype(self.dtype)
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 (or None for the model's), "
                             f"got {self.max_model_len!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0 (or -1: the whole vocabulary), "
                             f"got {self.max_logprobs!r}")
        limits = self.limit_mm_per_prompt
        if limits is not None and (not isinstance(limits, dict) or set(limits) - {"image"} or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values())):
            raise ValueError(f'limit_mm_per_prompt is {{"image": N}} with N an integer >= 0, got {limits!r}')

    @property
    def max_images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", MAX_IMAGES_PER_PROMPT)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: str | int | None = None  # e.g. "2GiB"; None: 512MiB on the CPU, on a GPU what the next leaves
    gpu_memory_utilization: float | None = None  # the share of a GPU's memory the engine may take (default 0.9)
    num_gpu_blocks_override: int | None = None  # the number of KV blocks, instead of a budget
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: auto, float32, float16, int8, fp8
    num_gpu_blocks: int | None = None  # set once the model runner has sized the cache (with_kv_cache)

    def __post_init__(self) -> None:
        from tinyvllm.attention.kv_cache import resolve_kv_cache_dtype

        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.cache_dtype != "auto":
            resolve_kv_cache_dtype(self.cache_dtype)  # a bad name fails here, before the model loads


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # the most sequences in one step
    max_num_batched_tokens: int = 512  # the token budget of one step
    policy: str = "fcfs"  # vLLM's scheduling_policy: "fcfs" or "priority"
    disable_chunked_mm_input: bool = False  # an image's tokens in one step (always for a prefix LM, Gemma 3)

    def __post_init__(self) -> None:
        from tinyvllm.core.scheduler import check_scheduler_limits

        check_scheduler_limits(self.max_num_seqs, self.max_num_batched_tokens, self.policy)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # devices each layer is split over (Phase 8)
    pipeline_parallel_size: int = 1  # devices the stack of layers is split over (Phase 8)


@dataclass(frozen=True)
class DeviceConfig:
    device: str | None = None  # a tinygrad device, "CPU", "CUDA", ...; None: tinygrad's choice
    portable_attention: bool = False  # the portable paged attention instead of the device's kernels


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = ParallelConfig()
    device_config: DeviceConfig = DeviceConfig()
    speculative_config: SpeculativeConfig | None = None

    @property
    def max_model_len(self) -> int | None:
        return self.model_config.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    def with_kv_cache(self, num_blocks: int, max_model_len: int) -> EngineConfig:
        """The tree once the KV cache is sized: its number of blocks, and the context length it resolves to."""
        return dataclasses.replace(
            self, model_config=dataclasses.replace(self.model_config, max_model_len=max_model_len),
            cache_config=dataclasses.replace(self.cache_config, num_gpu_blocks=num_blocks))
