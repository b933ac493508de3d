"""LLaMA in tinygrad: embedding -> N x (attention + SwiGLU MLP) -> norm -> lm_head (the diagram: chapter 01,
section 5).

Taught in docs/phases/01-foundation.md; the switches in 01-appendix-architectures.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

from tinyvllm import ops
from tinyvllm.tinygrad_ext import buffers
from tinyvllm.device_memory import host_view
from tinyvllm.ggml_types import KERNEL_TYPES as QUANT_NAMES
from tinyvllm.model.config import ModelConfig
from tinyvllm.model.gguf import let_go, populate
from tinyvllm.model.quant import QuantizedArray
from tinyvllm.model.rope import apply_rope, rope_cos_sin, rope_frequencies
from tinyvllm.platforms import platform_for
from tinyvllm.plugins import provided

if TYPE_CHECKING:
    from tinyvllm.distributed.pipeline_parallel import PipelineParallel
    from tinyvllm.distributed.tensor_parallel import TensorParallel
    from tinyvllm.kernels.qlinear import QuantizedWeight

linear = provided("linear", ops.linear)  # Phase 5: the matmul kernel where the device has it
act_and_mul = provided("act_and_mul", ops.act_and_mul)  # Phase 5: the gated activation in one kernel
# Phase 5: a layer traced once and called for every layer of a forward pass (tinygrad_ext/speed.py)
reusable_function = provided("reusable_function", lambda fxn: fxn)
traces_reused = provided("traces_reused", contextlib.nullcontext)

# a tuple: one per part where fused parts are stored in different formats (Q4_K_M: attn_v in Q6_K, q and k in Q4_K)
Weight = "Tensor | QuantizedWeight | tuple"


def project(x: Tensor, w: Weight) -> Tensor:
    """x (..., K) @ w.T -> (..., N), whatever w is stored as."""
    if isinstance(w, tuple):  # split over devices (tensor parallel), each device's parts side by side on it
        shards = len(x.device) if isinstance(x.device, tuple) else 1
        outs = [project(x, part) for part in w]
        return Tensor.cat(*[o.reshape(*o.shape[:-1], shards, -1) for o in outs], dim=-1).reshape(*x.shape[:-1], -1)
    if not isinstance(w, Tensor):  # a QuantizedWeight
        from tinyvllm.kernels.qlinear import qlinear

        return qlinear(x.float(), w).cast(x.dtype)  # the kernels compute in float32 (a no-op cast there)
    return linear(x, w)


def embed(w: Weight, input_ids: Tensor, dtype: DType) -> Tensor:
    """input_ids (B,T) -> their rows of the embedding (B,T,D)."""
    if not isinstance(w, Tensor):  # a QuantizedWeight
        from tinyvllm.kernels.qlinear import embedding

        return embedding(w, input_ids).cast(dtype)  # only the looked-up rows are dequantized
    return w[input_ids]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 (as HF does) whatever the model dtype."""
    xf = x.float()
    return (xf * (xf.square().mean(axis=-1, keepdim=True) + eps).rsqrt()).cast(x.dtype) * weight


class OneDevice:
    """The whole model on one device (TensorParallel and PipelineParallel take its place for several)."""

    size = 1

    def __init__(self, config: ModelConfig, device: str | None = None):
        self.devices = (device,)
        self.first = self.last = device
        self.layer_devices = [device] * config.num_hidden_layers
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_kv_heads = config.num_key_value_heads

    def fused_rows(self, sizes: list[int], parts: list[str]) -> None:
        return None  # fused weights keep their rows in order

    def pad_vocab(self, rows):
        return rows

    def replicate(self, t: Tensor) -> Tensor:
        return t

    def gather(self, t: Tensor) -> Tensor:
        return t


class LlamaDecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], tp: TensorParallel | None = None,
                 layer: int = 0):
        self.config = config
        self.tp = tp or OneDevice(config)  # tensor parallel: each weight's rows of this device's heads
        self.sliding_window = config.layer_window(layer)  # None: this layer attends over the whole context
        self.input_layernorm = weights["input_layernorm"]  # (D,)
        self.qkv_proj = weights["qkv_proj"]  # (H*Hd + 2*KvH*Hd, D)
        self.qkv_bias = weights.get("qkv_bias")  # (H*Hd + 2*KvH*Hd,) with attention_bias, else None
        self.q_norm, self.k_norm = weights.get("q_norm"), weights.get("k_norm")  # (Hd,) each with qk_norm
        self.o_proj = weights["o_proj"]  # (D, H*Hd)
        self.post_attention_layernorm = weights["post_attention_layernorm"]  # (D,): the MLP's input norm
        self.attn_output_norm = weights.get("attn_output_norm")  # (D,) with sandwich_norms, else None
        self.mlp_output_norm = weights.get("mlp_output_norm")  # (D,) with sandwich_norms, else None
        self.gate_up_proj = weights["gate_up_proj"]  # (2*F, D)
        self.down_proj = weights["down_proj"]  # (D, F)

    def weights(self) -> list[Weight]:
        names = ("input_layernorm", "qkv_proj", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_attention_layernorm",
                 "attn_output_norm", "mlp_output_norm", "gate_up_proj", "down_proj")
        return [w for w in (getattr(self, n) for n in names) if w is not None]

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache, attn_metadata) -> Tensor:
        B, T, _ = x.shape
        S, H, KvH, Hd = self.tp.size, self.tp.heads, self.tp.kv_heads, self.config.head_dim  # H, KvH: per device
        qkv = project(x, self.qkv_proj)  # (B,T,S*(H+2*KvH)*Hd)
        if self.qkv_bias is not None:  # Qwen2
            qkv = qkv + self.qkv_bias
        qkv = qkv.reshape(B, T, S, (H + 2 * KvH) * Hd)  # device s: [q_s k_s v_s]
        q = qkv[..., : H * Hd].reshape(B, T, S * H, Hd)
        k = qkv[..., H * Hd: (H + KvH) * Hd].reshape(B, T, S * KvH, Hd)
        v = qkv[..., (H + KvH) * Hd:].reshape(B, T, S * KvH, Hd)
        eps = self.config.rms_norm_eps
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head's q and k normalized over head_dim
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if (scalar := self.config.query_pre_attn_scalar) is not None:  # attention scales by Hd^-0.5; Gemma by this
            q = q * (Hd / scalar) ** 0.5
        out = attn_metadata.attend(q, k, v, kv_cache, self.sliding_window)  # (B,T,S*H,Hd)
        return project(out.reshape(B, T, S * H * Hd), self.o_proj)  # row-parallel: the all-reduce

    def mlp(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        S, F = self.tp.size, self.config.intermediate_size // self.tp.size  # F: per device
        gate_up = project(x, self.gate_up_proj).reshape(B, T, S, 2 * F)  # (B,T,S,2F), device s: [gate_s up_s]
        # SwiGLU: silu(gate) * up; GeGLU (Gemma): gelu_tanh(gate) * up
        act = "silu" if self.config.hidden_act == "silu" else "gelu_tanh"
        h = act_and_mul(gate_up, act).reshape(B, T, S * F)
        return project(h, self.down_proj)  # row-parallel: the all-reduce

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache, attn_metadata) -> Tensor:
        return _decoder_layer(self, x, cos, sin, kv_cache, attn_metadata)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache, attn_metadata) -> Tensor:
        eps = self.config.rms_norm_eps
        a = self.attention(rms_norm(x, self.input_layernorm, eps), cos, sin, kv_cache, attn_metadata)
        if self.attn_output_norm is not None:  # Gemma's sandwich: the branch is normalized before it is added
            a = rms_norm(a, self.attn_output_norm, eps)
        h = x + a
        m = self.mlp(rms_norm(h, self.post_attention_layernorm, eps))
        if self.mlp_output_norm is not None:
            m = rms_norm(m, self.mlp_output_norm, eps)
        return (h + m).contiguous()


@reusable_function  # tinygrad's function(precompile=True), one trace per forward
def _decoder_layer(layer, x, cos, sin, kv_cache, attn_metadata):
    return layer.forward(x, cos, sin, kv_cache, attn_metadata)


# tensor parallel: 0 column-parallel, 1 row-parallel; others replicated
SPLIT_AXIS = {"qkv_proj": 0, "qkv_bias": 0, "gate_up_proj": 0, "o_proj": 1, "down_proj": 1}


def place(tp: TensorParallel, w: Weight, axis: int | None) -> Weight:
    """A weight split along `axis` over the devices (None: replicated); GGUF blocks split only between blocks."""
    if isinstance(w, tuple):
        return tuple(place(tp, part, axis) for part in w)
    if not isinstance(w, Tensor):  # a QuantizedWeight
        per_device = w.shape[1] // tp.size
        if axis == 1 and per_device % w.format.block_size != 0:
            raise ValueError(f"tensor_parallel_size {tp.size} splits a {w.format.name} weight of shape {w.shape} "
                             f"into {per_device} columns per device, not whole blocks of {w.format.block_size}: "
                             "load it with --quantization none (or a format of smaller blocks)")
        return dataclasses.replace(w, data=tp.place(w.data, axis))
    return tp.place(w, axis)


def upload(parts: list[np.ndarray], device: str | None, pool: ThreadPoolExecutor | None = None,
           copies: list[Future] | None = None) -> Tensor:
    """`parts` concatenated along dim 0 into a device tensor (float32, or uint8 GGUF blocks), in place if it can be."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    np_dtype = np.dtype(np.uint8 if parts[0].dtype == np.uint8 else np.float32)
    if (mapped := in_place(parts, shape, np_dtype, device)) is not None:
        if pool is not None:  # its pages mapped in while the rest loads; nothing waits for it
            pool.submit(populate, parts)
        return mapped
    out = buffers.empty(shape, dtypes.uint8 if np_dtype == np.uint8 else dtypes.float32, device)
    return fill(out, functools.partial(copy_out, parts), pool, copies)


def upload_repacked(parts: list[np.ndarray], ggml_type: int, device: str | None, pool: ThreadPoolExecutor | None,
                    copies: list[Future] | None, kept=None, key: str | None = None) -> Tensor:
    """GGUF rows of blocks, concatenated and reordered for the CPU's kernel (kernels/repack.py), into a new buffer;
    with `kept` (model/repacked_cache.py's KeptWeights, on a device the host sees) the copy an earlier start kept under
    `key`, used in place, else the new buffer, handed to `kept` to be written to disk."""
    from tinyvllm.kernels import repack

    N, row_bytes = sum(p.shape[0] for p in parts), parts[0].shape[1]
    shape = (N // repack.GROUP, row_bytes * repack.GROUP)
    if kept is not None and (view := kept.get(key, shape)) is not None:
        return buffers.tensor_over_memory(view.ctypes.data, shape, dtypes.uint8, device, owner=view)

    def write(dst: np.ndarray) -> None:
        repack.REPACK[ggml_type](parts[0] if len(parts) == 1 else np.concatenate(parts), out=dst)
        let_go(parts)
    out = fill(buffers.empty(shape, dtypes.uint8, device), write, pool, copies)
    if kept is not None:
        kept.keep(key, host_view(out))
    return out


def fill(out: Tensor, write: Callable[[np.ndarray], None], pool: ThreadPoolExecutor | None,
         copies: list[Future] | None) -> Tensor:
    """`out` with `write(dst)`'s bytes: written into out's own memory where the host sees it (on the pool when there
    is one: page faults and memory traffic, numpy releases the GIL, so the weights fill in parallel), else into a
    host array, then copied in (device memory the host cannot see)."""
    if (dst := host_view(out)) is None:
        host = np.empty(out.shape, np.dtype(out.dtype.fmt))
        write(host)
        buffers.copy_in(out, memoryview(host).cast("B"))
    elif pool is None:
        write(dst)
    else:
        copies.append(pool.submit(write, dst))
    return out


def copy_out(parts: list[np.ndarray], dst: np.ndarray) -> None:
    """The parts concatenated into `dst`; a GGUF's pages they were read from are then let go (counted once)."""
    np.concatenate(parts, axis=0, out=dst, casting="same_kind")
    let_go(parts)


def in_place(parts: list[np.ndarray], shape: tuple[int, ...], np_dtype: np.dtype, device: str | None) -> Tensor | None:
    """The parts as one tensor over their own memory (a GGUF's mapped pages), or None where that cannot be."""
    if not platform_for(device).host_views or any(p.dtype != np_dtype or not p.flags.c_contiguous for p in parts):
        return None
    start = parts[0].ctypes.data
    if start % 32 or any(a.ctypes.data + a.nbytes != b.ctypes.data for a, b in zip(parts, parts[1:])):
        return None
    dtype = dtypes.uint8 if np_dtype == np.uint8 else dtypes.float32
    return buffers.tensor_over_memory(start, shape, dtype, device, owner=list(parts))


class LlamaForCausalLM:
    """The whole model, from an HF-named state dict of float arrays or `QuantizedArray`s (uploaded as they are)."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, np.ndarray | QuantizedArray],
                 dtype: DType = dtypes.float32, device: str | None = None, quantization: str = "none",
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, model_id: str | None = None):
        # model_id: where the weights come from (repacked_cache.model_identity), their repacked copies kept on disk
        self.config, self.dtype = config, dtype
        self.quantization = quantization  # the --quantization method the weights were loaded with
        self.tp: OneDevice | TensorParallel = OneDevice(config, device)
        self.pp: OneDevice | PipelineParallel = self.tp
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
            from tinyvllm.distributed.pipeline_parallel import PipelineParallel
            from tinyvllm.distributed.tensor_parallel import TensorParallel

            self.tp = TensorParallel(config, tensor_parallel_size, device)
            self.pp = PipelineParallel(config.num_hidden_layers, pipeline_parallel_size, device)
        tp, pp = self.tp, self.pp
        if tp.size > 1 and pp.size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size > 1 together are not supported: "
                             "give one of them")
        device = tp.devices[0] if tp.size > 1 else pp.first

        loaded: list[Tensor] = []
        pool, copies = ThreadPoolExecutor(max_workers=os.cpu_count() or 1), []
        kept = None  # the repacked weights an earlier start kept on disk (model/repacked_cache.py), in place
        if model_id is not None and platform_for(device).host_views:
            from tinyvllm.model.repacked_cache import KeptWeights

            kept = KeptWeights(model_id)
            pool.submit(populate, kept.whole())  # its pages mapped in while the rest loads

        def load(*names: str, axis: int | None = None, parts_of: tuple[str, ...] = (), at: str | None = None,
                 by_rows: bool = False) -> Weight:
            # HF tensors fused along dim 0; axis: split over devices (None: replicated); at: a pipeline stage's device;
            # by_rows: looked up row by row (an embedding), so never repacked for the CPU's matmuls
            dev = at or device
            parts = [tp.pad_vocab(state_dict[n]) if "embed" in n or "lm_head" in n else state_dict[n] for n in names]
            if all(isinstance(p, np.ndarray) for p in parts):
                rows = tp.fused_rows([p.shape[0] for p in parts], list(parts_of))
                t = upload(parts if rows is None else [np.concatenate(parts)[rows]], dev, pool, copies)
                loaded.append(t.cast(dtype))
                return loaded[-1]
            if all(isinstance(p, QuantizedArray) and p.ggml_type == parts[0].ggml_type for p in parts):
                from tinyvllm.kernels import repack
                from tinyvllm.kernels.qlinear import QuantizedWeight

                rows = tp.fused_rows([p.shape[0] for p in parts], list(parts_of))
                data = [p.data for p in parts] if rows is None else [np.concatenate([p.data for p in parts])[rows]]
                N, ggml_type = sum(d.shape[0] for d in data), parts[0].ggml_type
                layout = None if by_rows or tp.size > 1 else repack.repack_for(ggml_type, N, dev)
                if layout is not None:  # reordered for the CPU's kernel: a copy, not the file's pages
                    key = None if kept is None else kept.weight_key(names, ggml_type)
                    loaded.append(upload_repacked(data, ggml_type, dev, pool, copies, kept, key))
                else:
                    loaded.append(upload(data, dev, pool, copies))  # (N, bytes per row) uint8: whole rows of blocks
                return QuantizedWeight(loaded[-1], ggml_type, (N, parts[0].shape[1]), layout)
            # formats differ: fused on paper only
            return tuple(load(n, axis=axis, parts_of=parts_of[i:i + 1], at=at, by_rows=by_rows)
                         for i, n in enumerate(names))

        # (V, D), or its blocks: split by vocabulary
        self.embed_tokens = load("model.embed_tokens.weight", axis=0, by_rows=True)
        layer_weights = []
        for i in range(config.num_hidden_layers):
            p, at = f"model.layers.{i}.", pp.layer_devices[i]
            weights = {
                "input_layernorm": load(p + "input_layernorm.weight", at=at),
                "qkv_proj": load(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                 p + "self_attn.v_proj.weight", axis=0, parts_of=("q", "k", "v"), at=at),
                "o_proj": load(p + "self_attn.o_proj.weight", axis=1, at=at),
                "post_attention_layernorm": load(p + "post_attention_layernorm.weight", at=at),
                "gate_up_proj": load(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", axis=0,
                                     parts_of=("gate", "up"), at=at),
                "down_proj": load(p + "mlp.down_proj.weight", axis=1, at=at),
            }
            if config.attention_bias:
                weights["qkv_bias"] = load(p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                           p + "self_attn.v_proj.bias", axis=0, parts_of=("q", "k", "v"), at=at)
            if config.qk_norm:
                weights["q_norm"] = load(p + "self_attn.q_norm.weight", at=at)
                weights["k_norm"] = load(p + "self_attn.k_norm.weight", at=at)
            if config.sandwich_norms:  # Gemma: HF's post_attention_layernorm is the attention output's norm
                weights["attn_output_norm"] = weights["post_attention_layernorm"]
                weights["post_attention_layernorm"] = load(p + "pre_feedforward_layernorm.weight", at=at)
                weights["mlp_output_norm"] = load(p + "post_feedforward_layernorm.weight", at=at)
            layer_weights.append(weights)
        self.norm = load("model.norm.weight", at=pp.last)  # the last pipeline stage's
        if pp.size > 1:  # a tied one: a second copy there
            self.lm_head = load("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight",
                                at=pp.last)
        else:
            self.lm_head = self.embed_tokens if config.tie_word_embeddings else load("lm_head.weight", axis=0)
        self.inv_freq = upload([rope_frequencies(config)], device)  # (Hd/2,), in place on the CPU
        # Gemma 3's sliding layers' own RoPE base
        self.inv_freq_local = None if config.rope_local_theta is None else upload(
            [rope_frequencies(config, local=True)], device)
        for copy in copies:
            copy.result()
        if kept is not None:  # the weights repacked now, written for the next start
            kept.save()
        pool.shutdown(wait=False)  # the populates left: in the background
        del load  # a cycle (it calls itself) holding `state_dict`: freed now
        if pending := [t for t in loaded if not buffers.is_realized(t)]:
            Tensor.realize(*pending)
        if tp.size > 1:
            layer_weights = [{name: place(tp, w, SPLIT_AXIS.get(name)) for name, w in lw.items()}
                             for lw in layer_weights]
            self.embed_tokens, self.norm, self.inv_freq = (place(tp, self.embed_tokens, 0), place(tp, self.norm, None),
                                                           place(tp, self.inv_freq, None))
            self.lm_head = self.embed_tokens if config.tie_word_embeddings else place(tp, self.lm_head, 0)
            if self.inv_freq_local is not None:
                self.inv_freq_local = place(tp, self.inv_freq_local, None)
            extra = [] if self.inv_freq_local is None else [self.inv_freq_local]
            placed = [self.embed_tokens, self.norm, self.inv_freq, self.lm_head, *extra] + [w for lw in layer_weights
                                                                                          for w in lw.values()]
            Tensor.realize(*[t if isinstance(t, Tensor) else t.data for w in placed
                             for t in (w if isinstance(w, tuple) else (w,))])  # every copy in one schedule
        self.layers = [LlamaDecoderLayer(config, lw, tp, i) for i, lw in enumerate(layer_weights)]
        self._weight_formats = self._count_weight_formats()
        self.vision_tower = None  # Phase 10, set by the loader

    @property
    def device(self) -> str:
        """The device a step's inputs go to and its logits come back on (the first, with tensor parallel)."""
        return self.tp.devices[0] if self.tp.size > 1 else self.inv_freq.device

    @property
    def devices(self) -> tuple[str, ...] | str:
        """Where the weights and the KV cache live: the device, or the tuple of devices they are split over."""
        return self.tp.devices if self.tp.size > 1 else self.pp.devices if self.pp.size > 1 else self.device

    @property
    def kv_cache_devices(self) -> list:
        """Where each layer's KV cache lives: its pipeline stage's device, or the devices it is split over."""
        if self.pp.size > 1:
            return list(self.pp.layer_devices)
        return [self.devices] * self.config.num_hidden_layers

    @property
    def kv_cache_config(self) -> ModelConfig:
        """The config the KV cache is shaped by: one KV head per device when KV heads are replicated."""
        if self.tp.num_kv_heads == self.config.num_key_value_heads:
            return self.config
        return dataclasses.replace(self.config, num_key_value_heads=self.tp.num_kv_heads)

    def weight_formats(self) -> dict[str, int]:
        """Bytes of weights on the device, by storage format: {'Q4_1': ..., 'Q8_0': ..., 'float32': ...}."""
        return dict(self._weight_formats)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every weight once, but of the embedding table one row (unless the
        lm_head is that table, read whole). Its rate times this is how fast a decode streams its weights."""
        held = sum(self._weight_formats.values())
        return held if self.lm_head is self.embed_tokens else held - _nbytes(self.embed_tokens)

    def _count_weight_formats(self) -> dict[str, int]:
        formats: dict[str, int] = {}
        weights = [self.embed_tokens, self.norm] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        for layer in self.layers:
            weights += layer.weights()
        flat: list = []
        for w in weights:
            flat += list(w) if isinstance(w, tuple) else [w]
        for w in flat:
            name = np.dtype(w.dtype.fmt).name if isinstance(w, Tensor) else QUANT_NAMES[w.ggml_type]
            formats[name] = formats.get(name, 0) + _nbytes(w)
        return formats

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list, attn_metadata,
                 mm_embeds: Tensor | None = None, mm_mask: Tensor | None = None) -> Tensor:
        """input_ids, positions: (B,T) -> hidden states (B,T,D), writing this step's K/V into kv_caches;
        mm_embeds (B,T,D) replace the embeddings where mm_mask (B,T,1) is set."""
        input_ids, positions = self.tp.replicate(input_ids), self.tp.replicate(positions)  # on every device
        x = embed(self.embed_tokens, input_ids, self.dtype)  # (B,T,D)
        if self.config.scale_embeddings:  # Gemma: times sqrt(D), a constant of the model's dtype as in HF
            x = x * self.config.hidden_size**0.5
        if mm_embeds is not None:
            x = (self.tp.replicate(mm_mask) != 0).where(self.tp.replicate(mm_embeds).cast(x.dtype), x)
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # (B,T,1,Hd/2) each
        local = None if self.inv_freq_local is None else rope_cos_sin(positions, self.inv_freq_local)
        with traces_reused():  # the layers share one trace (see there)
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                if self.pp.size > 1 and (stage := self.pp.layer_devices[i]) != x.device:  # the next pipeline stage:
                    x, cos, sin = x.to(stage), cos.to(stage), sin.to(stage)  # the hidden state moves, in one graph
                    local = None if local is None else (local[0].to(stage), local[1].to(stage))
                    attn_metadata = attn_metadata.to(stage)
                layer_cos, layer_sin = local if local is not None and layer.sliding_window is not None else (cos, sin)
                x = layer(x, layer_cos, layer_sin, kv_cache, attn_metadata)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: (..., D) -> logits (..., V) in float32."""
        return self.logits_of_normed(self.final_norm(hidden))

    def final_norm(self, hidden: Tensor) -> Tensor:
        """hidden: (..., D) -> after the last norm: what lm_head reads and a pooling request pools."""
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def logits_of_normed(self, normed: Tensor) -> Tensor:
        """final hidden states (..., D) -> logits (..., V) in float32."""
        logits = project(normed, self.lm_head).float()
        if self.pp.size > 1:
            logits = logits.to(self.device)  # from the last stage back to the first device, for the sampler
        elif self.tp.size > 1:
            logits = self.tp.gather(logits)[..., : self.config.vocab_size]  # each device's vocabulary slice
        if (cap := self.config.final_logit_softcapping) is not None:  # Gemma 2: logits squashed into (-cap, cap)
            logits = (logits / cap).tanh() * cap
        return logits


def _nbytes(w: Weight) -> int:
    """A weight's bytes on the device: a float tensor's, a QuantizedWeight's blocks', or the sum of its parts."""
    if isinstance(w, tuple):
        return sum(_nbytes(part) for part in w)
    return (w if isinstance(w, Tensor) else w.data).nbytes()
