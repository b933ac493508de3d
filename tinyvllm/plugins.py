"""Where a later phase plugs into the earlier ones: each hook, the module that provides it, and its phase.

    linear = provided("linear", portable_linear)     # Phase 1's x @ w.T, until Phase 5 provides its kernel
"""

from __future__ import annotations

import functools
import importlib

# hook -> (the module that provides it, the attribute; "": the module itself), by the phase that adds it
PROVIDERS: dict[str, tuple[str, str]] = {
    "device_sampler": ("tinyvllm.sample.device_sampler", ""),  # 4: a batch's tokens sampled on the device
    "jit": ("tinyvllm.kernels.cpu_graph", "GraphedJit"),  # 5: a captured step replayed by one C call on the CPU
    "reusable_function": ("tinyvllm.tinygrad_ext.speed", "reusable_function"),  # 5: a layer traced once ...
    "traces_reused": ("tinyvllm.tinygrad_ext.speed", "traces_reused"),  # 5: ... and called for every layer
    "linear": ("tinyvllm.kernels.linear", "linear"),  # 5: the matmul kernel
    "act_and_mul": ("tinyvllm.kernels.activation", "act_and_mul"),  # 5: SwiGLU / GeGLU in one kernel
    "attention_metadata": ("tinyvllm.attention.kernel_backend", "kernel_attention_metadata"),  # 5: paged kernels
    "sampler_kernel": ("tinyvllm.sample.sampler_kernel", "kernel_draw"),  # 5: sampling in one launch
    "quantization": ("tinyvllm.model.quantization", ""),  # 6: --quantization, GGUF blocks kept or made (the module)
    "persisted_graph": ("tinyvllm.kernels.graph_cache", "persisted_graph"),  # 6: captured graphs kept on disk
    "program_cache": ("tinyvllm.kernels.program_cache", "install"),  # 6: compiled kernels kept on disk
    "tokenizer_cache": ("tinyvllm.model.tokenizer_cache", "load_tokenizer"),  # 6: tokenizers kept on disk
    "gguf_header_cache": ("tinyvllm.model.gguf_header_cache", "header_cache"),  # 6: GGUF headers kept on disk
    "beam_search_params": ("tinyvllm.engine.beam_search", "BeamSearchParams"),  # 7a: beam search, above the core
    "pooling_params": ("tinyvllm.pooling_params", "PoolingParams"),  # 9: embeddings, a prompt's pooled states
    "vision_tower": ("tinyvllm.model.vision", "load_vision_tower"),  # 10: a vision tower
    "multimodal_inputs": ("tinyvllm.engine.multimodal", "MultiModalProcessor"),  # 10: prompts' images
    "media_connector": ("tinyvllm.engine.multimodal", "MediaConnector"),  # 10: image URLs to images
}


@functools.cache
def provided(hook: str, default=None):
    """What the module of `hook` provides, or `default` while that module's phase is not there."""
    module_name, attribute = PROVIDERS[hook]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # the provider's module (or its package) is not there: its phase is not built
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the provider is there but needs something missing: a real error
        return default
    return getattr(module, attribute) if attribute else module
