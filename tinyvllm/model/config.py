"""The model's shape, derived once from the weights' own metadata and then frozen.

Config flows one way: a GGUF file's metadata or an HF `config.json` is read into one
`ModelConfig`, and every module (the model, the KV cache, the scheduler) reads it and never
writes it back. Field names follow HF's `LlamaConfig`, the names vLLM uses too.

    GGUF metadata  --from_gguf_metadata-->  ModelConfig  <--from_hf_config--  config.json
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HF's `rope_scaling`. Two kinds:

    "llama3": low frequencies (long wavelengths) are divided by `factor`, high ones kept, and the band
              between is interpolated smoothly (Llama 3.1+).
    "linear": every frequency is divided by `factor` (position interpolation).
    See `tinyvllm.model.rope.rope_frequencies`.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # model width, "dim" in llama2.c
    intermediate_size: int  # SwiGLU hidden width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention (GQA)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context length the model was trained for
    tie_word_embeddings: bool  # lm_head shares the token embedding matrix
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA needs n_heads divisible by n_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE rotates pairs of dimensions: head_dim must be even"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def num_params(self) -> int:
        d, f, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + embed + d

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in float32."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    # ---- construction from the two checkpoint formats ----

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from an HF `config.json` dict (LlamaForCausalLM and compatible)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") not in ("llama", "mistral") and archs[0] not in ("LlamaForCausalLM",):
            raise ValueError(f"unsupported architecture {archs[0]!r} (model_type {cfg.get('model_type')!r}): "
                             "tinyvllm runs LLaMA-architecture models (LlamaForCausalLM)")
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling")),
        )

    def to_hf_config(self) -> dict:
        """The inverse of `from_hf_config`: what `convert` writes as config.json."""
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
        elif rs is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                                   "high_freq_factor": rs.high_freq_factor,
                                   "original_max_position_embeddings": rs.original_max_position_embeddings}
        return cfg

    @classmethod
    def from_gguf_metadata(cls, md: dict, tensor_names: set[str] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata (llama.cpp's `llama.*` keys)."""
        arch = md.get("general.architecture", "llama")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}: tinyvllm runs 'llama' models")

        def key(name, default=None):
            v = md.get(f"{arch}.{name}", default)
            if v is None:
                raise ValueError(f"GGUF metadata lacks '{arch}.{name}', which a LLaMA model needs")
            return v

        n_heads = key("attention.head_count")
        dim = key("embedding_length")
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        if not vocab:
            raise ValueError("GGUF metadata has neither 'llama.vocab_size' nor 'tokenizer.ggml.tokens'")
        if tensor_names is not None and "rope_freqs.weight" in tensor_names:
            # llama.cpp writes Llama 3.1's scaling as per-frequency factors in a tensor, not as metadata
            raise ValueError("this GGUF scales RoPE with a 'rope_freqs.weight' tensor (Llama 3.1 style), which "
                             "tinyvllm does not read; load the HF checkpoint (its config.json rope_scaling) instead")
        scaling, kind = None, md.get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling(factor=float(key("rope.scaling.factor")), rope_type="linear")
        elif kind != "none":
            raise ValueError(f"unsupported GGUF rope scaling type {kind!r}: tinyvllm implements 'linear' (or none)")
        return cls(
            vocab_size=int(vocab),
            hidden_size=int(dim),
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=int(n_heads),
            num_key_value_heads=int(md.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=int(md.get(f"{arch}.attention.key_length", dim // n_heads)),
            rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            # llama.cpp omits output.weight when the output layer reuses the token embedding
            tie_word_embeddings=tensor_names is not None and "output.weight" not in tensor_names,
            rope_scaling=scaling,
        )


def _rope_scaling_from_hf(rs: dict | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(factor=float(rs["factor"]), rope_type="linear")
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: tinyvllm implements 'llama3' and 'linear' (or none)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )
