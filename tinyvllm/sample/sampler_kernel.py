"""The sampler kernel (kernels/<device>/sampler.*): a batch's draws in one launch, one thread block per row."""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from tinyvllm.attention import kernel_backend
from tinyvllm.kernels import launcher

KERNEL = "sampler"  # kernels/<device>/sampler.*
NUM_THREADS = 256  # threads per row (one thread block per row) on GPUs: TV_NUM_THREADS


def uses_kernel(logits: Tensor, portable: bool = False) -> bool:
    """Does this device run the sampler kernel?"""
    device = logits.device
    if portable or kernel_backend.PORTABLE or not isinstance(device, str):
        return False
    return launcher.has_kernel(KERNEL, device)


def kernel_draw(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor,
                thresholds: bool = True, portable: bool = False) -> tuple[Tensor, Tensor] | None:
    """device_sampler's `draw` in one kernel launch; None where the device has no kernel (or `portable`)."""
    if not uses_kernel(logits, portable):
        return None
    rows, vocab = logits.shape
    device = logits.device
    outs = [Tensor.empty(rows, dtype=dtypes.int32, device=device), Tensor.empty(rows, device=device),
            Tensor.empty(rows, 2 * vocab, dtype=dtypes.int32, device=device)]  # tokens, thresholds, scratch
    ins = [logits.float().contiguous(), temperature.float().contiguous(), top_k.cast(dtypes.int32).contiguous(),
           top_p.float().contiguous(), min_p.float().contiguous(), keys.cast(dtypes.uint32).contiguous()]
    defines = {"TV_NUM_ROWS": rows, "TV_VOCAB": vocab, "TV_NUM_THREADS": NUM_THREADS,
               "TV_THRESHOLDS": int(thresholds)}
    tokens, found, _ = launcher.launch(KERNEL, outs, ins, defines, grid=(rows, 1, 1), local_size=(NUM_THREADS, 1, 1))
    return tokens, found.reshape(rows, 1)
