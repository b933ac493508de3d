"""`--quantization`: the format the weights are served in (docs/phases/06-quantized-weights.md).

    auto (default)   the checkpoint's own: a GGUF's weights stay in their blocks, float stays float
    none             every weight dequantized to the compute dtype at load (Phases 1-5)
    q8_0 | q4_0 | q4_1 | iq4_nl | q4_k
                     every 2-D weight quantized at load (q4_k: rows not whole super-blocks in Q5_0)
"""

from __future__ import annotations

import sys

import numpy as np

from tinyvllm.model.gguf import GGUFFile
from tinyvllm.ggml_types import KERNEL_TYPES, type_name
from tinyvllm.model.quant import QuantizedArray

METHODS = ("auto", "none", "q8_0", "q4_0", "q4_1", "iq4_nl", "q4_k")
ONLINE_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q4_k": 12}  # method -> ggml type id
FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16


def check_quantization(method: str) -> str:
    """The method, validated (ValueError names those that exist)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    return method


def fallback_notice(gguf: GGUFFile) -> str | None:
    """The one line `auto` prints when a GGUF holds 2-D weights in a block format without a kernel."""
    slow = sorted({type_name(t.ggml_type) for t in gguf.tensors.values()
                   if len(t.shape) == 2 and t.ggml_type not in KERNEL_TYPES and t.ggml_type not in FLOAT_TYPES})
    if not slow:
        return None
    kernels = ", ".join(KERNEL_TYPES.values())
    return (f"tinyvllm: {', '.join(slow)} weights have no fused kernel (those have: {kernels}); "
            f"dequantizing them to float at load")


def quantize_state_dict(state_dict: dict[str, np.ndarray | QuantizedArray], method: str,
                        ) -> dict[str, np.ndarray | QuantizedArray]:
    """Online quantization: every 2-D float weight whose rows are whole blocks -> that format's blocks."""
    from tinyvllm.model.quantizer import quantize, storage_type  # bit-exact with ggml's

    out: dict[str, np.ndarray | QuantizedArray] = {}
    for name, w in state_dict.items():
        ggml_type = storage_type(ONLINE_TYPES[method], w.shape[-1]) if isinstance(w, np.ndarray) else None
        if isinstance(w, np.ndarray) and w.ndim == 2 and ggml_type is not None:
            data = quantize(np.ascontiguousarray(w, dtype=np.float32), ggml_type)
            out[name] = QuantizedArray(data, ggml_type, (int(w.shape[0]), int(w.shape[1])))
        else:
            out[name] = w
    return out


def describe(state_dict: dict[str, np.ndarray | QuantizedArray]) -> str:
    """What the weights are stored as, by share of weights."""
    counts: dict[str, int] = {}
    for w in state_dict.values():
        name = w.type_name if isinstance(w, QuantizedArray) else str(w.dtype).upper().replace("FLOAT", "F")
        counts[name] = counts.get(name, 0) + int(np.prod(w.shape))
    total = sum(counts.values())
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def notify(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr)
