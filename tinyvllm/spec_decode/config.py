"""`speculative_config` in vLLM's shape ({"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}),
validated once when the engine is built (docs/phases/07b-speculative-decoding.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tinyvllm.model.quantization import METHODS as QUANTIZATION_METHODS

METHODS = ("ngram", "draft_model")  # vLLM also has "eagle", "medusa", ...: not built here

DEFAULT_DISABLE_BY_BATCH_SIZE = 4  # vLLM's default is None; where speculation stops paying (chapter 7b, section 6)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts per request per step
    prompt_lookup_min: int  # ngram: the shortest suffix matched
    prompt_lookup_max: int
    model: str | None = None  # draft_model: its checkpoint
    quantization: str = "auto"  # draft_model: as the engine's --quantization
    disable_by_batch_size: int | None = None  # no speculation with this many running (None: never off)

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """Check every key and value; ValueError names what is wrong and what would be right."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
                 "disable_by_batch_size"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; the keys are {sorted(known)}")
        method = config.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
        k = config.get("num_speculative_tokens")
        lo = config.get("prompt_lookup_min")
        hi = config.get("prompt_lookup_max")
        lo = hi if lo is None else lo  # vLLM: either one alone sets both
        hi = lo if hi is None else hi
        lo, hi = (1, 5) if lo is None else (lo, hi)
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        model, quantization = config.get("model"), config.get("quantization")
        if method == "draft_model":
            if model is None:
                raise ValueError("speculative_config with method 'draft_model' needs 'model': the draft's checkpoint "
                                 "path (a .gguf file or an HF directory sharing the target's tokenizer)")
            if not isinstance(model, (str, os.PathLike)):
                raise ValueError(f"speculative_config['model'] must be a checkpoint path, got {model!r}")
            if quantization is not None and quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"speculative_config['quantization'] (the draft's weights) must be one of "
                                 f"{', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")
        elif model is not None or quantization is not None:
            raise ValueError(f"speculative_config: 'model' and 'quantization' are for method 'draft_model', "
                             f"not {method!r}")
        disable = config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
            raise ValueError(f"speculative_config['disable_by_batch_size'] must be an integer >= 1 (speculation is off "
                             f"in steps with that many running requests) or None (never off), got {disable!r}")
        return cls(method, k, lo, hi, None if model is None else os.fspath(model),
                   "auto" if quantization is None else quantization, disable)


def parse_speculative_config(text: str | None) -> dict | None:
    """`--speculative-config`'s JSON as LLMEngine's dict (None: off), checked before the model loads (ValueError)."""
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the value is not JSON ({e}); give e.g. "
                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None
    SpeculativeConfig.from_dict(config)
    return config
