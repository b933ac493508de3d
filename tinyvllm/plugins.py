"""Where a later phase plugs into the earlier ones: each hook, the module that provides it, and its phase.

    linear = provided("linear", portable_linear)     # Phase 1's x @ w.T, until Phase 5 provides its kernel
"""

from __future__ import annotations

import functools
import importlib

# hook -> (providing module, attribute; "": the module), by phase
PROVIDERS: dict[str, tuple[str, str]] = {
    "device_sampler": ("tinyvllm.sample.device_sampler", ""),  # 4: sampling on the device
    "jit": ("tinyvllm.kernels.cpu_graph", "GraphedJit"),  # 5: a step replayed by one C call on the CPU
    "reusable_function": ("tinyvllm.tinygrad_ext.speed", "reusable_function"),  # 5: a layer traced once ...
    "traces_reused": ("tinyvllm.tinygrad_ext.speed", "traces_reused"),  # 5: ... and called for every layer
    "linear": ("tinyvllm.kernels.linear", "linear"),  # 5: the matmul kernel
    "act_and_mul": ("tinyvllm.kernels.activation", "act_and_mul"),  # 5
    "attention_metadata": ("tinyvllm.attention.kernel_backend", "kernel_attention_metadata"),  # 5: paged kernels
    "sampler_kernel": ("tinyvllm.sample.sampler_kernel", "kernel_draw"),  # 5
    "quantization": ("tinyvllm.model.quantization", ""),  # 6: --quantization
    "persisted_graph": ("tinyvllm.kernels.graph_cache", "persisted_graph"),  # 6: kept on disk, as the next three
    "program_cache": ("tinyvllm.kernels.program_cache", "install"),  # 6
    "tokenizer_cache": ("tinyvllm.model.tokenizer_cache", "load_tokenizer"),  # 6
    "gguf_header_cache": ("tinyvllm.model.gguf_header_cache", "header_cache"),  # 6
    "repacked_cache": ("tinyvllm.model.repacked_cache", "model_identity"),  # 6: repacked weights kept on disk
    "beam_search_params": ("tinyvllm.engine.beam_search", "BeamSearchParams"),  # 7a
    "pooling_params": ("tinyvllm.pooling_params", "PoolingParams"),  # 9: embeddings
    "vision_tower": ("tinyvllm.model.vision", "load_vision_tower"),  # 10
    "mmproj": ("tinyvllm.model.vision", "load_mmproj"),  # 10: llama.cpp's vision GGUF beside a text model
    "multimodal_inputs": ("tinyvllm.engine.multimodal", "MultiModalProcessor"),  # 10
    "media_connector": ("tinyvllm.engine.multimodal", "MediaConnector"),  # 10
}


@functools.cache
def provided(hook: str, default=None):
    """What the module of `hook` provides, or `default` while that module's phase is not there."""
    module_name, attribute = PROVIDERS[hook]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # the provider's phase is not built
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the provider is there but lacks something: a real error
        return default
    return getattr(module, attribute) if attribute else module
