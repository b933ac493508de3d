"""GGUF checkpoint -> HF LLaMA state dict: dequantize, rename (`GLOBAL_NAMES`, `ARCH_LAYER_NAMES`), and undo the
permutation llama.cpp's converter (`LlamaModel.permute`) gives q/k rows for its adjacent-pair RoPE, back to HF's
rotate_half order; only 'llama' files (Llama, Mistral) are permuted. Taught in
docs/phases/01-appendix-weights-and-layers.md.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.ggml_types import F32, KERNEL_TYPES
from tinyvllm.model.quant import QuantizedArray, as_blocks, dequantize, tensor_nbytes
from tinyvllm.model.weights import check_state_dict, expected_shapes

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.{i}.<GGUF name>  <->  model.layers.{i}.<HF name>
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# what the other GGUF architectures add to (or, for gemma3, change in) the LLaMA names
QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
ARCH_LAYER_NAMES = {
    "llama": LAYER_NAMES,
    "qwen2": {**LAYER_NAMES, "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": {**LAYER_NAMES, **QK_NORM_NAMES},
    "gemma3": {**LAYER_NAMES, **QK_NORM_NAMES, "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
# Llama-3.1-style RoPE factors: ModelConfig.from_gguf_metadata rejects such files before weights are read
IGNORED_TENSORS = {"rope_freqs.weight"}


def layer_names(arch: str = "llama") -> dict[str, str]:
    """GGUF name -> HF name of one layer's tensors in a GGUF of architecture `arch` (general.architecture)."""
    return ARCH_LAYER_NAMES[arch]


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if `arch` has no such tensor."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = layer_names(arch)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """The inverse of `hf_name`."""
    for g, h in GLOBAL_NAMES.items():
        if h == hf:
            return g
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for g, h in layer_names(arch).items():
            if h == parts[3]:
                return f"blk.{parts[2]}.{g}"
    return None


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate_half row order -> llama.cpp's interleaved order. w: (n_heads * head_dim, in)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved row order -> HF rotate_half order (the inverse of `permute_qk`)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_qk_rows(w: np.ndarray | QuantizedArray, n_heads: int) -> np.ndarray | QuantizedArray:
    """`unpermute_qk` for a float weight or one in blocks (whole rows of blocks move)."""
    if isinstance(w, np.ndarray):
        return unpermute_qk(w, n_heads)
    order = unpermute_qk(np.arange(w.shape[0])[:, None], n_heads)[:, 0]  # where each output row comes from
    return w.rows(order)


def read_tensor(gguf: GGUFFile, name: str, keep_quantized: bool = False) -> np.ndarray | QuantizedArray:
    """One GGUF tensor in numpy shape order: float32, or with `keep_quantized` a 2-D kernel format's blocks as is."""
    info = gguf.tensors[name]
    try:
        raw = gguf.raw(name, tensor_nbytes(info.ggml_type, info.shape))
        if keep_quantized and info.ggml_type in KERNEL_TYPES and len(info.shape) == 2:
            return as_blocks(raw, info.ggml_type, info.shape)
        return dequantize(raw, info.ggml_type, info.shape)
    except ValueError as e:
        raise ValueError(f"{gguf.path}: tensor {name!r}: {e}") from None


def load_gguf(path: str | os.PathLike | GGUFFile, dtype=np.float32, keep_quantized: bool = False,
              ) -> tuple[ModelConfig, dict[str, np.ndarray | QuantizedArray]]:
    """Read a LLaMA GGUF file (a path, or one already opened) into (config, state dict in HF names and layout)."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    state_dict: dict[str, np.ndarray | QuantizedArray] = {}
    arch = config.gguf_architecture
    file_names = {name: gguf_name(name, arch) for name in expected_shapes(config)}
    names = [name for name in gguf.tensors if name not in IGNORED_TENSORS]

    def read(name: str) -> np.ndarray | QuantizedArray:
        t = read_tensor(gguf, name, keep_quantized)
        return t if isinstance(t, QuantizedArray) else t.astype(dtype, copy=False)

    def kept_or_copied(name: str) -> bool:  # a view of the file's blocks, or float32 copied as it is: no work
        info = gguf.tensors[name]
        return info.ggml_type == F32 or (keep_quantized and info.ggml_type in KERNEL_TYPES and len(info.shape) == 2)

    # dequantizing is numpy work that releases the GIL: one thread per core cuts the load time by that factor.
    arrays = {name: read(name) for name in names if kept_or_copied(name)}
    if dequantized := [name for name in names if name not in arrays]:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            arrays.update(zip(dequantized, pool.map(read, dequantized)))
    for name in names:
        hf = hf_name(name, arch) or name  # an unknown name is kept, so check_state_dict reports it
        file_names[hf] = name
        state_dict[hf] = arrays[name]
    check_state_dict(config, state_dict, gguf.path, file_names)
    if not config.rope_interleaved:
        return config, state_dict
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        state_dict[p + "q_proj.weight"] = unpermute_qk_rows(state_dict[p + "q_proj.weight"], config.num_attention_heads)
        state_dict[p + "k_proj.weight"] = unpermute_qk_rows(state_dict[p + "k_proj.weight"], config.num_key_value_heads)
    return config, state_dict
