"""GGML's tensor types by id: their names, their block layouts, and which ones the fused kernels compute."""

from __future__ import annotations

# ggml's type ids (enum ggml_type). Ids 4 and 5 (Q4_2, Q4_3) were removed from ggml long ago.
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}

F32, F16, Q8_0 = 0, 1, 8  # the ids the loader and the GGUF writer name

QK_K = 256  # elements in a k-quant super-block

# the formats with fused dequant-matmul kernels (tinyvllm/kernels/qlinear.py): these stay quantized on the device;
# every block format tinyvllm/model/quant.py reads
KERNEL_TYPES: dict[int, str] = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
                                12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS"}


def type_name(ggml_type: int) -> str:
    return GGML_TYPES.get(ggml_type, f"unknown type {ggml_type}")
