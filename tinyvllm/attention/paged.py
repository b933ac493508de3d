"""Paged attention in portable tinygrad, the reference the custom kernels are checked against.

Taught in docs/phases/02-paged-attention.md, sections 6 and 7.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tinygrad import Tensor, UOp, dtypes

from tinyvllm.attention.contiguous import grouped_query_attention
from tinyvllm.attention.kv_cache import kv_cache_dtype_of
from tinyvllm.tinygrad_ext.programs import kernel_info as KernelInfo  # noqa: N813 (tinygrad's name)


def _reshape_and_cache_kernel(cache: UOp, new: UOp, slot_mapping: UOp) -> UOp:
    """cache: (num_slots, W), new: (N, W), slot_mapping: (N,) -> cache[slot_mapping[i], j] = new[i, j]."""
    n, width = new.shape
    i, j = UOp.range(n, 0), UOp.range(width, 1)
    slot = slot_mapping[i].cast(dtypes.weakint)
    store = cache[slot, j].store(new[i, j].cast(cache.dtype))
    return store.end(i, j).sink(arg=KernelInfo(name="reshape_and_cache", opts_to_apply=()))


def _scatter(x: Tensor, cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """x: (N, ...) -> cache (num_blocks, block_size, ...) after cache[slot_mapping[i]] = x[i]."""
    num_slots = cache.shape[0] * cache.shape[1]
    flat_cache = cache.reshape(num_slots, -1)
    written = flat_cache.uop.custom_kernel(x.reshape(x.shape[0], -1).contiguous().uop, slot_mapping.uop,
                                           fxn=_reshape_and_cache_kernel)[0]
    return Tensor(cache.uop.after(written))


def reshape_and_cache(x: Tensor, cache: Tensor, slot_mapping: Tensor,
                      scale_cache: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x: (N, n_kv_heads, head_dim) -> cache (num_blocks, block_size, n_kv_heads, head_dim) after the write (and
    a quantized cache's scales, (num_blocks, block_size, n_kv_heads))."""
    spec = kv_cache_dtype_of(cache)
    if not spec.quantized:
        return _scatter(x, cache, slot_mapping)
    assert scale_cache is not None, f"an {spec.name} KV cache needs its scale tensor"
    from tinyvllm.attention.kv_quant import quantize  # Phase 7c: a quantized cache only
    codes, scales = quantize(x, spec)  # (N, KvH, Hd), (N, KvH)
    return _scatter(codes, cache, slot_mapping), _scatter(scales, scale_cache, slot_mapping)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, num_blocks: int | UOp,
                    positions: Tensor, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                    sliding_window: int | None = None, context_lens: Tensor | None = None) -> Tensor:
    """q: (B,T,H,Hd) at positions (B,T) -> (B,T,H,Hd), over the first `num_blocks` blocks of each table.
    k_scale, v_scale: (num_blocks, block_size, KvH) for an 8-bit cache; sliding_window W: no key before p-W+1;
    context_lens (B,T): no key from there on (default p + 1; an image token of a prefix LM: its image's end)."""
    B, T = q.shape[0], q.shape[1]
    _, block_size, kv_heads, head_dim = k_cache.shape
    table = block_tables[:, :num_blocks]  # (B, nb)
    keys = k_cache[table].reshape(B, -1, kv_heads, head_dim)  # (B, nb*block_size, KvH, Hd)
    values = v_cache[table].reshape(B, -1, kv_heads, head_dim)
    spec = kv_cache_dtype_of(k_cache)
    if spec.quantized:  # the gathered codes and their scales (B, nb*block_size, KvH) back to float32
        from tinyvllm.attention.kv_quant import dequantize
        keys = dequantize(keys, k_scale[table].reshape(B, -1, kv_heads), spec)
        values = dequantize(values, v_scale[table].reshape(B, -1, kv_heads), spec)
    # a fixed-length arange cut: tinygrad 0.14 makes a symbolic-length arange an O(context^2) running sum
    key_pos = Tensor.arange(block_tables.shape[1] * block_size)[: num_blocks * block_size].reshape(1, 1, 1, 1, -1)
    query_pos = positions.reshape(B, 1, 1, T, 1)  # (B,1,1,T,1), broadcast over (B,KvH,G,T,S)
    ends = query_pos + 1 if context_lens is None else context_lens.reshape(B, 1, 1, T, 1)
    hidden = key_pos >= ends  # the future (an image token: past its image)
    if sliding_window is not None:
        hidden = hidden | (key_pos <= query_pos - sliding_window)  # and what slid out of the window
    mask = hidden.where(float("-inf"), 0.0).cast(q.dtype)
    return grouped_query_attention(q, keys.cast(q.dtype), values.cast(q.dtype), mask)


@dataclass
class PagedAttentionMetadata:
    """Everything a step's attention needs to find its tokens' K/V, as tensors (JIT inputs) and variables."""

    slot_mapping: Tensor
    block_tables: Tensor
    positions: Tensor
    num_blocks: int | UOp
    context_lens: Tensor | None = None  # (R,) each row's keys end (default: position + 1)

    def to(self, device: str | tuple[str, ...]) -> PagedAttentionMetadata:
        """The same metadata with its tensors on `device` (a pipeline stage's)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.init
                 and isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **moved)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, ...],
               sliding_window: int | None = None) -> Tensor:
        """q: (B,T,H,Hd), k/v: (B,T,KvH,Hd) -> (B,T,H,Hd); kv_cache: (k_cache, v_cache[, k_scale, v_scale])."""
        if kv_cache_dtype_of(kv_cache[0]).rotated:
            from tinyvllm.attention.kv_quant import rotate
            return rotate(self._attend(rotate(q), rotate(k), rotate(v), kv_cache, sliding_window))
        return self._attend(q, k, v, kv_cache, sliding_window)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, ...],
                sliding_window: int | None = None) -> Tensor:
        B, T, kv_heads, head_dim = k.shape
        k, v = k.reshape(B * T, kv_heads, head_dim), v.reshape(B * T, kv_heads, head_dim)
        if len(kv_cache) == 4:
            k_cache, k_scale = reshape_and_cache(k, kv_cache[0], self.slot_mapping, kv_cache[2])
            v_cache, v_scale = reshape_and_cache(v, kv_cache[1], self.slot_mapping, kv_cache[3])
        else:
            k_cache, v_cache = (reshape_and_cache(x, c, self.slot_mapping) for x, c in ((k, kv_cache[0]),
                                                                                         (v, kv_cache[1])))
            k_scale = v_scale = None
        if self.block_tables.shape[0] == B:
            return paged_attention(q, k_cache, v_cache, self.block_tables, self.num_blocks, self.positions,
                                   k_scale, v_scale, sliding_window, self.context_lens)
        # a flattened batch: every token a query row, with its sequence's block table
        H, Hd = q.shape[2], q.shape[3]
        out = paged_attention(q.reshape(B * T, 1, H, Hd), k_cache, v_cache, self.block_tables, self.num_blocks,
                              self.positions.reshape(B * T, 1), k_scale, v_scale, sliding_window,
                              None if self.context_lens is None else self.context_lens.reshape(B * T, 1))
        return out.reshape(B, T, H, Hd)


def attention_metadata(slot_mapping: Tensor, block_tables: Tensor, positions: Tensor, num_blocks: int | UOp,
                       portable: bool = True, context_lens: Tensor | None = None) -> PagedAttentionMetadata:
    """What a model runner attends with: the portable paged attention (Phase 5 plugs in its kernels)."""
    return PagedAttentionMetadata(slot_mapping, block_tables, positions, num_blocks, context_lens)
