"""HF checkpoint directories: config.json + safetensors (one file, or shards with an index), read as they are.

The layout is drawn in docs/phases/01-appendix-weights-and-layers.md.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from tinyvllm.model.config import ModelConfig
from tinyvllm.model.weights import check_state_dict

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# tensors older HF checkpoints carry that a LLaMA forward pass recomputes (RoPE's inverse frequencies)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- reading ----

def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's bytes (uint8) in safetensors dtype `dtype` -> float32."""
    if dtype == "F32":
        return raw.view(np.float32)
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F64":
        return raw.view(np.float64).astype(np.float32)
    raise ValueError(f"safetensors dtype {dtype} is not a float type tinyvllm reads (F32, F16, BF16, F64)")


def read_safetensors(path: str | os.PathLike, names: set[str] | None = None,
                     keep: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """Read the tensors of one safetensors file (all, or those in `names`, or those `keep` keeps) as float32 arrays."""
    path = Path(path)
    tensors = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names) or (keep and not keep(name)):
                continue
            begin, end = info["data_offsets"]
            raw = np.empty(end - begin, dtype=np.uint8)
            f.seek(data_start + begin)
            f.readinto(raw)
            try:
                tensors[name] = _to_float32(raw, info["dtype"]).reshape(info["shape"])
            except ValueError as e:
                raise ValueError(f"{path}: tensor {name!r}: {e}") from None
    return tensors


def _weight_files(model_dir: Path) -> dict[Path, set[str] | None]:
    """Which safetensors files hold the weights, and which tensor names to take from each (None: all)."""
    if (model_dir / SINGLE_FILE).is_file():
        return {model_dir / SINGLE_FILE: None}
    index_path = model_dir / INDEX_FILE
    if not index_path.is_file():
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pth"))
        hint = f" (found {', '.join(other)}: only safetensors weights are read)" if other else ""
        raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    files: dict[Path, set[str] | None] = {}
    for name, file in weight_map.items():
        files.setdefault(model_dir / file, set()).add(name)
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{index_path} lists {file.name}, which is not in {model_dir}")
    return files


def read_hf_tensors(model_dir: Path, keep: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory that `keep` keeps (None: all), by its name in the files, as float32."""
    tensors: dict[str, np.ndarray] = {}
    for file, names in _weight_files(model_dir).items():
        tensors.update(read_safetensors(file, names, keep))
    return tensors


# where a vision-language checkpoint keeps its LLaMA's tensors: {prefix in the files: the LLaMA's own prefix}
TEXT_MODEL_PREFIXES = {"idefics3": {"model.text_model.": "model.", "lm_head.": "lm_head."},
                       "llava": {"language_model.": ""},  # LLaVA's: a whole LlamaForCausalLM under language_model.
                       "gemma3": {"language_model.model.": "model.", "model.language_model.": "model.",
                                  "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}}
# what Gemma3TextConfig fills in where a Gemma 3 checkpoint's text_config leaves a key out
GEMMA3_TEXT_DEFAULTS = {"model_type": "gemma3_text", "vocab_size": 262_208, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                        "max_position_embeddings": 131_072, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                        "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True}


def text_config(cfg: dict) -> tuple[dict, dict[str, str] | None]:
    """(the LLaMA's config, TEXT_MODEL_PREFIXES' renames) of a config.json: a vision-language one nests the config
    as `text_config`; any other is the LLaMA's own (None: its tensors' names are the LLaMA's)."""
    prefixes = TEXT_MODEL_PREFIXES.get(cfg.get("model_type"))
    if "text_config" not in cfg or prefixes is None:
        return cfg, None
    text = {**(GEMMA3_TEXT_DEFAULTS if cfg["model_type"] == "gemma3" else {}), **cfg["text_config"]}
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text, prefixes


def load_hf(model_dir: str | os.PathLike, dtype=np.float32) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF LLaMA directory into (config, state dict); HF's names and layout are ours already (a
    vision-language checkpoint: its LLaMA's, the vision tower left to model/vision.py)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: an HF model directory holds config.json "
                                f"and {SINGLE_FILE} (or sharded safetensors with {INDEX_FILE})")
    cfg, prefixes = text_config(json.loads(config_path.read_text()))
    config = ModelConfig.from_hf_config(cfg)
    state_dict: dict[str, np.ndarray] = {}
    keep = None if prefixes is None else (lambda n: n.startswith(tuple(prefixes)))
    for name, tensor in read_hf_tensors(model_dir, keep).items():
        if prefixes is not None:
            prefix = next(p for p in prefixes if name.startswith(p))
            name = prefixes[prefix] + name.removeprefix(prefix)
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # a tied lm_head that was saved anyway is the embedding matrix again
        if config.norm_weight_offset and name.endswith("norm.weight"):
            tensor = tensor + np.float32(config.norm_weight_offset)  # Gemma's (1 + w), added once here
        state_dict[name] = tensor.astype(dtype, copy=False)
    check_state_dict(config, state_dict, model_dir)
    return config, state_dict


# ---- writing ----

def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like torch's .to(bfloat16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: rounds half to even
    rounded = (bits >> 16) & 1
    rounded += bits
    rounded += 0x7FFF
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0  # the rounding could carry a NaN's mantissa into infinity
    return out


def save_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike, dtype: str = "float32") -> None:
    """Write float32 arrays as one safetensors file in `dtype` (float32, float16 or bfloat16)."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    arrays = {}
    for name, t in tensors.items():
        arrays[name] = to_bfloat16_bits(t) if dtype == "bfloat16" else np.ascontiguousarray(t, dtype=dtype)
    # TensorSpec takes the dtype by name, so bfloat16 can be written from raw uint16 bits
    specs = {name: TensorSpec(dtype=dtype, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
             for name, a in arrays.items()}
    # "format": "pt" is what transformers checks before it loads a safetensors file
    serialize_file(specs, str(path), metadata={"format": "pt"})


def save_hf_weights(state_dict: dict[str, np.ndarray], model_dir: str | os.PathLike, dtype: str = "float32",
                    max_shard_size: int | None = None) -> list[Path]:
    """Write a state dict as model.safetensors, or as HF does in shards of at most `max_shard_size` + an index."""
    model_dir = Path(model_dir)
    itemsize = 4 if dtype == "float32" else 2
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name, t in state_dict.items():
        nbytes = t.size * itemsize
        if max_shard_size is not None and shards[-1] and shard_bytes + nbytes > max_shard_size:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes

    if len(shards) == 1:
        save_safetensors(shards[0], model_dir / SINGLE_FILE, dtype)
        return [model_dir / SINGLE_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        path = model_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path, dtype)
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    total = sum(t.size * itemsize for t in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths
