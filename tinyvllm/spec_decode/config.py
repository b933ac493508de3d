"""`speculative_config`, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}, validated once when the engine is built (STYLE: config flows one way)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram",)  # vLLM also has "draft_model", "eagle", "medusa", ...: not built here


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: draft tokens proposed per request per step
    prompt_lookup_min: int  # ngram: the shortest suffix matched against the earlier tokens
    prompt_lookup_max: int  # ngram: the longest

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """Check every key and value; a ValueError names what is wrong and what would be right."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
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
        lo, hi = (1, 5) if lo is None else (lo, hi)  # neither given: match suffixes of 5 down to 1 token
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi)
