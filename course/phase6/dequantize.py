"""Phase 6, tasks dequantize_q8_0, dequantize_q4_1 and dequantize_q5_0: GGUF's 32-element blocks back to floats.

The engine calls them through `tinyvllm.model.quant.dequantize(data, ggml_type, shape)` (its table of block
formats) wherever a GGUF weight becomes float32: at load for every tensor not kept in its blocks, for a format a
kernel does not compute, for `--quantization none`. Each takes the blocks of a tensor, (n_blocks, bytes per block)
uint8, and returns (n_blocks, 32) float32; a block's scales are float16, little-endian (`blocks[:, 0:2]
.view(np.float16)` is (n, 1) of them, `.astype(np.float32)` before you multiply). Numpy only: whole arrays at a
time, no loop over blocks. Chapter: docs/phases/06-quantized-weights.md (section 2, "Build it"); every format
drawn byte by byte in tinyvllm/model/quant.py's docstrings and 06-appendix-formats.md. Grade: make course P=6
"""

from __future__ import annotations

import numpy as np


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0: 34 bytes per block, x = d * q.

        byte  0      2                            34
              | d    | qs[0..31]  int8            |
              | f16  |                            |
    """
    raise NotImplementedError("course/phase6/dequantize.py: dequantize_q8_0 is yours to write")


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1: 20 bytes per block, x = d * q + m, q in 0..15.

        byte  0      2      4                            20
              | d    | m    | qs[0..15]                  |
              | f16  | f16  | lo nibble of byte j: q[j]  |
              |      |      | hi nibble of byte j: q[j + 16] |

    The low nibbles of the 16 bytes are elements 0..15, the high nibbles 16..31 (not interleaved).
    """
    raise NotImplementedError("course/phase6/dequantize.py: dequantize_q4_1 is yours to write")


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0: 22 bytes per block, x = d * (q - 16), q in 0..31.

        byte  0      2            6                            22
              | d    | qh (u32)   | qs[0..15]                  |
              | f16  | bit j:     | lo nibble: q[j] low 4 bits |
              |      | q[j] bit 4 | hi nibble: q[j+16] low 4   |

    Element j's fifth bit (worth 16) is bit j of the little-endian uint32 at bytes 2..5; its low 4 bits are
    nibbles as in Q4_1. Hint: `blocks[:, 2:6].copy().view(np.uint32)` is (n, 1), `>> np.arange(32, dtype=np.uint32)`
    & 1 gives its 32 bits.
    """
    raise NotImplementedError("course/phase6/dequantize.py: dequantize_q5_0 is yours to write")
