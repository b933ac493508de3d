"""The model's shape, derived once from the weights' own metadata and then frozen (HF `LlamaConfig`'s names).

    GGUF metadata  --from_gguf_metadata-->  ModelConfig  <--from_hf_config--  config.json

Taught in docs/phases/01-foundation.md; the switches in 01-appendix-architectures.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# HF architecture -> (HF model_type, GGUF general.architecture); llama.cpp writes Mistral as 'llama'
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Gemma3ForCausalLM": ("gemma3_text", "gemma3"),
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF's layer_types
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # SwiGLU (LLaMA, Mistral, Qwen), GeGLU (Gemma)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HF's `rope_scaling`: "llama3" (Llama 3.1+) or "linear" (`rope.rope_frequencies`)."""

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
    # ---- the switches other architectures set on the same block (defaults: LLaMA's) ----
    architecture: str = "LlamaForCausalLM"  # the HF class name, a key of ARCHITECTURES
    attention_bias: bool = False  # q_proj, k_proj, v_proj add a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a query at position p sees keys p-W+1 .. p only (Mistral, Gemma 3)
    layer_types: tuple[str, ...] | None = None  # per layer FULL_ATTENTION or SLIDING_ATTENTION (None: all alike)
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too, before each residual add (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, when theirs differs (Gemma 3)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA needs n_heads divisible by n_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE rotates pairs of dimensions: head_dim must be even"
        assert self.architecture in ARCHITECTURES, f"unknown architecture {self.architecture!r}"
        assert self.hidden_act in ACTIVATIONS, f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}"
        assert self.layer_types is None or len(self.layer_types) == self.num_hidden_layers, "one type per layer"

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def gguf_architecture(self) -> str:
        return ARCHITECTURES[self.architecture][1]

    @property
    def norm_weight_offset(self) -> float:
        """What HF's RMSNorm adds to a stored norm weight before multiplying: 1 for Gemma ((1 + w)), else 0."""
        return 1.0 if self.architecture == "Gemma3ForCausalLM" else 0.0

    @property
    def rope_interleaved(self) -> bool:
        """Are a GGUF's q/k rows permuted for llama.cpp's adjacent-pair RoPE?"""
        return self.gguf_architecture == "llama"

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer `layer`: Gemma 3's sliding layers rotate with their own."""
        local = self.rope_local_theta is not None and self.layer_window(layer) is not None
        return self.rope_local_theta if local else self.rope_theta

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def num_params(self) -> int:
        d, f, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + (4 if self.sandwich_norms else 2) * d
        per_layer += (q + 2 * kv if self.attention_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + embed + d

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in float32."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    # ---- construction from the two checkpoint formats ----

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from an HF `config.json` dict, as transformers 4 or 5 wrote it."""
        arch = architecture_of(cfg)
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_theta, rope_scaling, rope_local_theta = _rope_from_hf(cfg)
        gemma = arch == "Gemma3ForCausalLM"
        layer_types = cfg.get("layer_types")
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:  # Qwen: a window in the config, switched off
            window, layer_types = None, None
        if gemma and layer_types is None:  # older Gemma 3 configs: every sliding_window_pattern-th layer is global
            pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
            layer_types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                           for i in range(cfg["num_hidden_layers"])]
        if window is None or (layer_types is not None and SLIDING_ATTENTION not in layer_types):
            window, layer_types = None, None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
            rope_scaling=rope_scaling,
            architecture=arch,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=None if window is None else int(window),
            layer_types=None if layer_types is None else tuple(layer_types),
            hidden_act=_activation(cfg, "gelu_pytorch_tanh" if gemma else "silu"),
            scale_embeddings=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", head_dim)) if gemma else None,
            rope_local_theta=rope_local_theta,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )

    def to_hf_config(self) -> dict:
        """The inverse of `from_hf_config`, in transformers 4's keys (5 reads them too)."""
        cfg = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
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
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.sliding_window is not None:
            cfg.update(sliding_window=self.sliding_window, use_sliding_window=True, max_window_layers=0)
        if self.layer_types is not None:
            cfg["layer_types"] = list(self.layer_types)
        if self.architecture == "Gemma3ForCausalLM":
            cfg.update(hidden_activation=self.hidden_act, query_pre_attn_scalar=self.query_pre_attn_scalar,
                       rope_local_base_freq=self.rope_local_theta, final_logit_softcapping=None,
                       attn_logit_softcapping=None)
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
        """Build from GGUF key/value metadata (llama.cpp's `<arch>.*` keys, arch one of GGUF_ARCHITECTURES)."""
        arch = md.get("general.architecture", "llama")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}: tinyvllm runs "
                             f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)} models")
        names = tensor_names or set()

        def key(name, default=None):
            v = md.get(f"{arch}.{name}", default)
            if v is None:
                raise ValueError(f"GGUF metadata lacks '{arch}.{name}', which a {arch} model needs")
            return v

        n_heads = key("attention.head_count")
        dim = key("embedding_length")
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        if not vocab:
            raise ValueError(f"GGUF metadata has neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens'")
        if "rope_freqs.weight" in names:
            # llama.cpp writes Llama 3.1's scaling as per-frequency factors in a tensor, not as metadata
            raise ValueError("this GGUF scales RoPE with a 'rope_freqs.weight' tensor (Llama 3.1 style), which "
                             "tinyvllm does not read; load the HF checkpoint (its config.json rope_scaling) instead")
        scaling, kind = None, md.get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling(factor=float(key("rope.scaling.factor")), rope_type="linear")
        elif kind != "none":
            raise ValueError(f"unsupported GGUF rope scaling type {kind!r}: tinyvllm implements 'linear' (or none)")
        n_layers = int(key("block_count"))
        window = md.get(f"{arch}.attention.sliding_window")
        gemma = arch == "gemma3"
        layer_types = None
        if gemma:  # llama.cpp's Gemma 3: every 6th layer global, the others sliding with RoPE base 10000
            pattern = int(md.get(f"{arch}.attention.sliding_window_pattern", 6))
            layer_types = tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                                for i in range(n_layers))
        head_dim = int(md.get(f"{arch}.attention.key_length", dim // n_heads))
        architecture = {"llama": "MistralForCausalLM" if window else "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
        return cls(
            vocab_size=int(vocab),
            hidden_size=int(dim),
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(n_heads),
            num_key_value_heads=int(md.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6)),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            # llama.cpp omits output.weight when the output layer reuses the token embedding
            tie_word_embeddings=tensor_names is not None and "output.weight" not in tensor_names,
            rope_scaling=scaling,
            architecture=architecture,
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=None if not window else int(window),
            layer_types=layer_types if window else None,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            scale_embeddings=gemma,
            sandwich_norms=gemma,
            # llama.cpp scales Gemma 3's scores by head_dim^-0.5, by (D / H)^-0.5 for the 27B (62 layers), as its
            # config.json's query_pre_attn_scalar says
            query_pre_attn_scalar=(float(dim // n_heads if n_layers == 62 else head_dim)) if gemma else None,
            rope_local_theta=float(md.get(f"{arch}.rope.local_freq_base", 10000.0)) if gemma else None,
            final_logit_softcapping=md.get(f"{arch}.final_logit_softcapping"),
        )


def architecture_of(cfg: dict) -> str:
    """The HF architecture a config.json describes, if tinyvllm runs it; a ValueError naming it otherwise."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "llama")
    if archs and archs[0] in ARCHITECTURES:
        arch = archs[0]
    elif not archs:
        arch = next((a for a, (t, _) in ARCHITECTURES.items() if t == model_type), None)
    else:
        arch = None
    if arch is None:
        named = archs[0] if archs else model_type
        raise ValueError(f"unsupported architecture {named!r} (model_type {model_type!r}): tinyvllm runs "
                         f"{', '.join(ARCHITECTURES)}")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{arch}: attn_logit_softcapping {cfg['attn_logit_softcapping']} (Gemma 2's tanh on every "
                         "attention score) is not implemented by tinyvllm's attention kernels")
    return arch


def _activation(cfg: dict, default: str) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or default
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {act!r}: tinyvllm implements {', '.join(ACTIVATIONS)}")
    return act


def _rope_from_hf(cfg: dict) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, rope_scaling, the sliding layers' theta or None) from transformers 4's or 5's keys."""
    params = cfg.get("rope_parameters")
    if params is None:
        local = cfg.get("rope_local_base_freq")
        return (float(cfg.get("rope_theta", 10000.0)), _rope_scaling_from_hf(cfg.get("rope_scaling")),
                None if local is None else float(local))
    if FULL_ATTENTION in params:  # one set per layer type
        full, sliding = params[FULL_ATTENTION], params.get(SLIDING_ATTENTION)
        if sliding is not None and _rope_scaling_from_hf(sliding) is not None:
            raise ValueError("rope scaling on sliding-window layers is not implemented")
        local = None if sliding is None else float(sliding.get("rope_theta", 10000.0))
        return float(full.get("rope_theta", 10000.0)), _rope_scaling_from_hf(full), local
    return float(params.get("rope_theta", 10000.0)), _rope_scaling_from_hf(params), None


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
