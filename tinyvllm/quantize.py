"""Quantize a model into a GGUF file: the blocks tinyvllm (and llama.cpp) serve without dequantizing (Phase 6).

    python -m tinyvllm.quantize IN OUT.gguf --type q8_0|q4_0|q4_1|iq4_nl|q4_k|f16|f32

Byte for byte llama-quantize's files (docs/phases/06-appendix-formats.md).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from tinyvllm.model.bpe import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, SMOLLM_PATTERN, pattern_from_pre_tokenizer
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.gguf_writer import (
    ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, MetadataValue, TensorData, read_metadata, write_gguf,
)
from tinyvllm.ggml_types import F16, F32, Q8_0, type_name
from tinyvllm.model.quant import tensor_nbytes
from tinyvllm.model.quantizer import QUANTIZE_TYPES, quantize, storage_type
from tinyvllm.model.tokenizer import load_tokenizer, token_id_of
from tinyvllm.model.weights_gguf import gguf_name, layer_names, permute_qk, read_tensor
from tinyvllm.model.weights_hf import load_hf

# ggml type -> llama.cpp's llama_ftype for a file "mostly" of that type (include/llama.h)
FILE_TYPES = {0: 0, 1: 1, 2: 2, 3: 3, 8: 7, 12: 15, 20: 25}  # Q4_K: MOSTLY_Q4_K_M, IQ4_NL: MOSTLY_IQ4_NL
OUTPUT_TYPES = {**QUANTIZE_TYPES, "f16": F16, "f32": F32}
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: bumped by ggml when a block layout changes

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
# the split regex of an HF tokenizer.json -> llama.cpp's name for it (tokenizer.ggml.pre)
PRE_TOKENIZER_NAMES = {GPT2_PATTERN: "gpt2", SMOLLM_PATTERN: "smollm", LLAMA3_PATTERN: "llama-bpe",
                       QWEN2_PATTERN: "qwen2"}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the output file, before its bytes exist."""

    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a linear weight
    source: str
    source_bytes: int  # its size in the input
    ggml_type: int  # its type in the output
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)


def target_type(name: str, shape: tuple[int, ...], current: int, ggml_type: int, tied: bool) -> int:
    """The type llama-quantize gives tensor `name` for a file of `ggml_type` (norms F32, the output matrix Q8_0)."""
    if len(shape) < 2 or not name.endswith("weight") or name.endswith("_norm.weight"):
        return current
    if ggml_type in (F32, F16):
        return ggml_type
    new = Q8_0 if name == "output.weight" or (tied and name == "token_embd.weight") else ggml_type
    fits = storage_type(new, shape[-1])  # Q4_K: Q5_0 where a row is not whole super-blocks
    return F16 if fits is None else fits


def convert_tensor(name: str, array: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 values -> the bytes (or values) of `ggml_type`."""
    if ggml_type == F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    if ggml_type == F16:
        return array.astype(np.float16)
    try:
        return quantize(array, ggml_type)
    except ValueError as e:
        raise ValueError(f"tensor {name!r}: {e}") from None


# ---- from a GGUF file ----

def _from_gguf(path: Path, ggml_type: int) -> tuple[dict[str, MetadataValue], list[PlannedTensor]]:
    gguf = GGUFFile(path)
    ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))  # a clear error unless tinyvllm runs it
    metadata = read_metadata(path)
    tied = "output.weight" not in gguf.tensors
    plan = []
    for name, info in gguf.tensors.items():
        new = target_type(name, info.shape, info.ggml_type, ggml_type, tied)
        try:
            nbytes = tensor_nbytes(info.ggml_type, info.shape)
        except ValueError as e:  # a type tinyvllm cannot read: say which tensor
            raise ValueError(f"{path}: tensor {name!r}: {e}") from None
        if new == info.ggml_type:
            def produce(name=name, nbytes=nbytes):
                return gguf.raw(name, nbytes)
        else:
            def produce(name=name, new=new):
                return convert_tensor(name, read_tensor(gguf, name), new)
        plan.append(PlannedTensor(name, info.shape, type_name(info.ggml_type), nbytes, new, produce))
    return metadata, plan


# ---- from an HF directory ----

def _safetensors_dtypes(model_dir: Path) -> dict[str, tuple[str, int]]:
    """Each tensor's stored dtype and byte count, from the safetensors headers (for the size report)."""
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["dtype"], info["data_offsets"][1] - info["data_offsets"][0])
    return out


def llama_metadata(config: ModelConfig, name: str) -> dict[str, MetadataValue]:
    """The general.* and <arch>.* keys llama.cpp's convert_hf_to_gguf.py writes for the config (arch: its GGUF
    architecture, 'llama' for Llama and Mistral, 'qwen2', 'qwen3', 'gemma3')."""
    if config.rope_scaling is not None and config.rope_scaling.rope_type != "linear":
        raise ValueError(f"rope_scaling {config.rope_scaling.rope_type!r} cannot be written as GGUF metadata: "
                         "llama.cpp stores it as a rope_freqs tensor, which tinyvllm's GGUF loader does not read")
    u32 = lambda v: MetadataValue(int(v), UINT32)  # noqa: E731
    f32 = lambda v: MetadataValue(float(v), FLOAT32)  # noqa: E731
    arch = config.gguf_architecture
    md = {
        "general.architecture": MetadataValue(arch, STRING),
        "general.name": MetadataValue(name, STRING),
        f"{arch}.block_count": u32(config.num_hidden_layers),
        f"{arch}.context_length": u32(config.max_position_embeddings),
        f"{arch}.embedding_length": u32(config.hidden_size),
        f"{arch}.feed_forward_length": u32(config.intermediate_size),
        f"{arch}.attention.head_count": u32(config.num_attention_heads),
        f"{arch}.attention.head_count_kv": u32(config.num_key_value_heads),
        f"{arch}.attention.key_length": u32(config.head_dim),
        f"{arch}.attention.value_length": u32(config.head_dim),
        f"{arch}.rope.freq_base": f32(config.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": f32(config.rms_norm_eps),
        f"{arch}.vocab_size": u32(config.vocab_size),
        f"{arch}.rope.dimension_count": u32(config.head_dim),
    }
    if config.sliding_window is not None:
        md[f"{arch}.attention.sliding_window"] = u32(config.sliding_window)
    if arch == "gemma3":
        expected = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(config.num_hidden_layers))
        if config.layer_types not in (None, expected) or config.rope_local_theta not in (None, 10000.0) \
                or config.query_pre_attn_scalar != config.head_dim:
            raise ValueError("this Gemma 3 config differs from what llama.cpp assumes of a gemma3 GGUF (every 6th "
                             "layer global, local RoPE base 10000, query_pre_attn_scalar = head_dim)")
    if config.rope_scaling is not None:
        md[f"{arch}.rope.scaling.type"] = MetadataValue("linear", STRING)
        md[f"{arch}.rope.scaling.factor"] = f32(config.rope_scaling.factor)
    return md


def tokenizer_metadata(model_dir: Path, vocab_size: int) -> dict[str, MetadataValue]:
    """tokenizer.ggml.* keys from tokenizer.json + tokenizer_config.json: what convert.py reads back."""
    from tinyvllm.model.bpe import ByteLevelBPETokenizer

    tokenizer = load_tokenizer(model_dir)
    if not isinstance(tokenizer, ByteLevelBPETokenizer):
        raise ValueError(f"{model_dir}: only byte-level BPE tokenizers (tokenizer.json) are written to GGUF; "
                         f"this one is {type(tokenizer).__name__}")
    tok_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    pattern = pattern_from_pre_tokenizer(tok_json.get("pre_tokenizer"))
    if pattern not in PRE_TOKENIZER_NAMES:
        raise ValueError(f"{model_dir}: tokenizer.json splits text with {pattern!r}, which has no llama.cpp "
                         f"pre-tokenizer name here (known: {', '.join(PRE_TOKENIZER_NAMES.values())})")

    vocab: dict[str, int] = tok_json["model"]["vocab"]
    added = tok_json.get("added_tokens", [])
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(t["id"] + 1 for t in added)])
    tokens = [f"[PAD{i}]" for i in range(n)]  # as convert_hf_to_gguf.py fills them
    types = [TOKEN_UNUSED] * n
    for token, i in vocab.items():
        tokens[i], types[i] = token, TOKEN_NORMAL
    for t in added:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"].get("merges", [])]
    ids = {**vocab, **{t["content"]: t["id"] for t in added}}

    md = {
        "tokenizer.ggml.model": MetadataValue("gpt2", STRING),
        "tokenizer.ggml.pre": MetadataValue(PRE_TOKENIZER_NAMES[pattern], STRING),
        "tokenizer.ggml.tokens": MetadataValue(tokens, ARRAY, STRING),
        "tokenizer.ggml.token_type": MetadataValue(types, ARRAY, INT32),
        "tokenizer.ggml.merges": MetadataValue(merges, ARRAY, STRING),
    }
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.is_file() else {}
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
               "unknown": token_id_of(tok_config.get("unk_token"), ids),
               "padding": token_id_of(tok_config.get("pad_token"), ids) or generation.get("pad_token_id")}
    for key, token_id in special.items():
        if token_id is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = MetadataValue(int(token_id), UINT32)
    md["tokenizer.ggml.add_bos_token"] = MetadataValue(bool(tokenizer.add_bos_token), BOOL)
    if "add_eos_token" in tok_config:
        md["tokenizer.ggml.add_eos_token"] = MetadataValue(bool(tok_config["add_eos_token"]), BOOL)
    if tokenizer.chat_template is not None:
        md["tokenizer.chat_template"] = MetadataValue(tokenizer.chat_template, STRING)
    return md


def _hf_tensor_order(config: ModelConfig, state_dict: dict) -> list[str]:
    """GGUF names in llama.cpp's order: the embedding, each layer's tensors, the final norm, the output."""
    names = ["token_embd.weight"]
    arch = config.gguf_architecture
    for i in range(config.num_hidden_layers):
        names += [f"blk.{i}.{g}" for g, h in layer_names(arch).items() if f"model.layers.{i}.{h}" in state_dict]
    names.append("output_norm.weight")
    if not config.tie_word_embeddings:
        names.append("output.weight")
    return names


def _from_hf(model_dir: Path, ggml_type: int) -> tuple[dict[str, MetadataValue], list[PlannedTensor]]:
    config, state_dict = load_hf(model_dir)
    metadata = {**llama_metadata(config, model_dir.name), **tokenizer_metadata(model_dir, config.vocab_size)}
    stored = _safetensors_dtypes(model_dir)
    hf_names = {gguf_name(hf, config.gguf_architecture): hf for hf in state_dict}
    plan = []
    for name in _hf_tensor_order(config, state_dict):
        hf = hf_names[name]
        array = state_dict[hf]
        if config.rope_interleaved and name.endswith(("attn_q.weight", "attn_k.weight")):
            # HF rotate_half rows -> GGUF's interleaved rows (llama only: qwen and gemma keep HF's order)
            heads = config.num_attention_heads if name.endswith("attn_q.weight") else config.num_key_value_heads
            array = permute_qk(array, heads)
        new = target_type(name, array.shape, F32, ggml_type, config.tie_word_embeddings)
        dtype, nbytes = stored.get(hf, ("F32", array.nbytes))

        def produce(name=name, array=array, new=new):
            return convert_tensor(name, array, new)
        plan.append(PlannedTensor(name, array.shape, dtype, nbytes, new, produce))
    return metadata, plan


# ---- the command ----

def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, out: TextIO | None = None) -> Path:
    """Write the GGUF file `dst` holding the model at `src` quantized to `qtype` (a QUANTIZE_TYPES name, f16, f32)."""
    start = time.perf_counter()
    out = out if out is not None else sys.stdout
    if qtype not in OUTPUT_TYPES:
        raise ValueError(f"unknown quantization type {qtype!r}; supported: {', '.join(OUTPUT_TYPES)}")
    ggml_type = OUTPUT_TYPES[qtype]
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"no model at {src}: expected a .gguf file or an HF model directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"the output {dst} is the input: write the quantized model to another file")
    if dst.is_dir() or not dst.parent.is_dir():
        raise ValueError(f"the output {dst} must be a file path in an existing directory (e.g. model-{qtype}.gguf)")
    if src.is_dir():
        metadata, plan = _from_hf(src, ggml_type)
    elif src.suffix == ".safetensors":
        raise ValueError(f"{src} is one file of an HF checkpoint: pass its directory (with config.json) instead")
    else:
        metadata, plan = _from_gguf(src, ggml_type)
    metadata["general.file_type"] = MetadataValue(FILE_TYPES[ggml_type], UINT32)
    metadata["general.quantization_version"] = MetadataValue(QUANTIZATION_VERSION, UINT32)


    def report(i: int, p: PlannedTensor) -> Callable[[], np.ndarray]:
        def data() -> np.ndarray:  # one tensor in memory at a time
            array = p.produce()
            print(f"[{i + 1:4d}/{len(plan)}] {p.name:32s} {str(p.shape):14s} {p.source:>5s} -> "
                  f"{type_name(p.ggml_type):5s} {p.source_bytes / 2**20:9.3f} MiB -> {p.nbytes / 2**20:9.3f} MiB",
                  file=out)
            return array
        return data

    tensors = [TensorData(p.name, p.shape, p.ggml_type, report(i, p)) for i, p in enumerate(plan)]
    tmp = dst.with_name(dst.name + ".tmp")  # OUT appears whole or not at all
    try:
        size = write_gguf(tmp, metadata, tensors)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    before, after = sum(p.source_bytes for p in plan), sum(p.nbytes for p in plan)
    print(f"tensors: {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB ({after / before:.1%}); "
          f"wrote {dst} ({size / 2**20:.2f} MiB, {qtype}) in {time.perf_counter() - start:.2f} s", file=out)
    return dst


def main(argv: list[str] | None = None, prog: str = "python -m tinyvllm.quantize") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a LLaMA .gguf file, or an HF model directory (config.json + safetensors)")
    parser.add_argument("dst", help="the .gguf file to write")
    parser.add_argument("--type", required=True, choices=list(OUTPUT_TYPES), dest="qtype",
                        help="the block format of the linear weights")
    args = parser.parse_args(argv)
    try:
        quantize_model(args.src, args.dst, args.qtype)
    except (ValueError, OSError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
