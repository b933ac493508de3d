"""Phase 5, task gpu_attention_launches: what a GPU runs for one paged-attention call, one launch or flash-decoding's
split and reduce.

The engine calls it as `tinyvllm.attention.kernel_backend.gpu_attention_launches` from `kernel_paged_attention`
on a GPU (Phase 5b), every time a step's graph is built: the grid it returns is captured with the graph. Chapters:
docs/phases/05-custom-kernels.md and 05b-gpu.md (flash-decoding's split), "Build it". Grade: make course P=5
"""

from __future__ import annotations

from tinyvllm.attention.kernel_backend import PARTITION_SIZE, SPLIT_MAX_BLOCKS, GpuLaunch


def gpu_attention_launches(rows: int, heads: int, kv_heads: int, max_keys: int,
                           partition_size: int = PARTITION_SIZE) -> list[GpuLaunch]:
    """The launches for `rows` query rows whose block tables hold up to `max_keys` keys.

    One thread block per (row, KV head) walks all of that row's keys: one launch,
    GpuLaunch("paged_attention", (kv_heads, rows, 1)). That is right when the grid is big enough to fill the GPU, or
    when the keys fit one partition of `partition_size`. Otherwise (a few rows, a long context: a GPU of 100+
    multiprocessors would run a handful of blocks) split each row's keys into parts = ceil(max_keys /
    partition_size) partitions, one thread block each, and merge their partial softmaxes in a second launch:

        GpuLaunch("paged_attention_split", (kv_heads * parts, rows, 1))
        GpuLaunch("paged_attention_reduce", (heads, rows, 1))

    Split only when parts > 1 and rows * kv_heads <= SPLIT_MAX_BLOCKS (a grid that small leaves the GPU idle).
    """
    raise NotImplementedError("course/phase5/launches.py: gpu_attention_launches is yours to write")
