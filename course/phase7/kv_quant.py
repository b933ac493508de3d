"""Phase 7c, task quantize_kv: K and V written to an 8-bit cache, one scale per token and head.

The engine calls it as `tinyvllm.attention.kv_quant.quantize` from `reshape_and_cache` (tinyvllm/attention/
paged.py) with `--kv-cache-dtype int8` or `fp8` on the portable path (every device without Phase 5's kernels; the
kernels quantize the same way in C), each layer, each step. Chapter: docs/phases/07c-kv-cache-quantization.md
("Build it"). Grade: make course P=7
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.attention.kv_quant import fp8_e4m3_encode


def quantize(x: Tensor, spec) -> tuple[Tensor, Tensor]:
    """x: (..., head_dim) float -> (codes (..., head_dim) of spec.storage, scales (...) float32).

    Each vector of head_dim values (one token, one KV head) gets its own scale: amax = max |x| over the last axis,
    scale = amax / spec.qmax (int8: 127, fp8: 448), so x / scale fills the code's range. The codes:

        int8 (spec.name == "int8"):  round(x * qmax / amax), cast to dtypes.int8
        fp8:                         fp8_e4m3_encode(x * qmax / amax)   (the e4m3 bits, uint8)

    A vector of zeros has amax 0: its scale is 0 and its codes 0 (multiply by 0 there, never divide by 0:
    `(amax > 0).where(qmax / amax, 0.0)`). Compute in float32 whatever x's dtype. Dequantizing is codes * scale.
    """
    raise NotImplementedError("course/phase7/kv_quant.py: quantize is yours to write")
