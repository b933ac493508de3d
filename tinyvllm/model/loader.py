"""One call from a path (or nothing: the default model) to a ready model and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from tinygrad import dtypes
from tinygrad.dtype import DType

from tinyvllm.model import tokenizer
from tinyvllm.model.llama import LlamaForCausalLM
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.model.weights import load_checkpoint
from tinyvllm.platforms import resolve_dtype
from tinyvllm.plugins import provided

# Phase 6's cold start: what earlier processes compiled (kernels/program_cache.py), built (model/tokenizer_cache.py)
# and repacked (model/repacked_cache.py)
install_program_cache = provided("program_cache", lambda device=None: None)
repacked_model_identity = provided("repacked_cache", lambda path, quantization: None)
load_tokenizer = provided("tokenizer_cache", tokenizer.load_tokenizer)


def _no_mmproj(*args):
    raise ValueError("an mmproj (images) needs Phase 10's tinyvllm/model/vision.py")

DTYPES: dict[str, DType] = {"float32": dtypes.float32, "float16": dtypes.float16,
                             "float": dtypes.float32, "half": dtypes.float16}  # the last two: vLLM's other names


def check_dtype(dtype: str | DType) -> str | DType:
    """A dtype name the engine takes ('auto', 'float32', 'float16') or a tinygrad DType; a ValueError otherwise."""
    if not isinstance(dtype, DType) and dtype not in (*DTYPES, "auto"):
        raise ValueError(f"dtype must be one of {['auto', *sorted(DTYPES)]}, got {dtype!r}")
    return dtype


def parse_dtype(dtype: str | DType, device: str | None = None) -> DType:
    """'float32', 'float16', or 'auto' (the device's) -> the compute dtype."""
    if isinstance(check_dtype(dtype), DType):
        return dtype
    return DTYPES[resolve_dtype(dtype, device)]


def load_model(model: str | os.PathLike | None = None, dtype: str | DType = "auto",
               device: str | None = None, quantization: str = "auto",
               tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
               mmproj: str | os.PathLike | None = None) -> tuple[LlamaForCausalLM, Tokenizer, Path]:
    """model: a .gguf file, an HF checkpoint directory, or None for SmolLM2-135M-Instruct -> (model, tokenizer,
    the resolved path); mmproj: llama.cpp's vision GGUF for the model's images.
    """
    install_program_cache(device=device)  # what earlier processes lowered and chose
    dt = parse_dtype(dtype, device)
    checkpoint = load_checkpoint(model, quantization=quantization)
    tokenizer = load_tokenizer(checkpoint.path)
    llm = LlamaForCausalLM(checkpoint.config, checkpoint.state_dict, dtype=dt, device=device,
                           quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                           pipeline_parallel_size=pipeline_parallel_size,
                           model_id=repacked_model_identity(checkpoint.path, checkpoint.quantization))
    if mmproj is not None:
        llm.vision_tower = provided("mmproj", _no_mmproj)(mmproj, tokenizer, dt, llm.device)
    elif checkpoint.path.is_dir():  # Phase 10's vision module (and Pillow) imported only for a directory's
        llm.vision_tower = provided("vision_tower", lambda *args: None)(checkpoint.path, dt, llm.device)
    return llm, tokenizer, checkpoint.path
