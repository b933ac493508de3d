"""Phase 8, tasks split_layers and fused_rows: how a model is cut over several devices, by layers (pipeline
parallel) and inside each layer (tensor parallel).

The engine calls them as `tinyvllm.distributed.pipeline_parallel.split_layers` (`PipelineParallel`, with
`--pipeline-parallel-size N`: which device runs each layer) and `TensorParallel.fused_rows`
(tinyvllm/distributed/tensor_parallel.py; the model's loader asks it for the fused qkv_proj and gate_up_proj with
`--tensor-parallel-size N`, then `Tensor.shard(devices, axis=0)` hands device i the i-th 1/N of the rows).
Numpy and Python only: nothing here opens a device. Chapter: docs/phases/08-multi-device.md ("Build it").
Grade: make course P=8
"""

from __future__ import annotations

import numpy as np


def split_layers(num_layers: int, size: int) -> list[range]:
    """The layers of each of `size` pipeline stages: consecutive, as even as can be, the first stages taking one
    more when `size` does not divide `num_layers`.

        split_layers(10, 3) -> [range(0, 4), range(4, 7), range(7, 10)]
        split_layers(4, 4)  -> [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    """
    raise NotImplementedError("course/phase8/parallel.py: split_layers is yours to write")


def fused_rows(self, sizes: list[int], parts: list[str]) -> np.ndarray | None:
    """The row order of a weight made of `parts` fused along its rows (qkv_proj: ["q", "k", "v"] of sizes [H*Hd,
    KvH*Hd, KvH*Hd]; gate_up_proj: ["gate", "up"]) such that, cut into self.size equal slices, slice i is device
    i's own [q_i k_i v_i]: column parallel, each device computes its heads' q, k and v and its share of gate and up.
    Returns an index array into the fused rows, or None on one device (self.size == 1; the rows as they are).

    Part p occupies fused rows offsets[p] .. offsets[p] + sizes[p] - 1 (offsets: the sizes' running sum from 0).
    Within a part, its rows in device order are self.part_rows(p) (None: 0 .. sizes[p] - 1 in order; for "k" and
    "v" it may repeat KV heads, when there are more devices than KV heads); cut each into self.size equal chunks.
    Device i's rows: part 0's chunk i, then part 1's chunk i, ..., each shifted by its part's offset.

        2 devices, q 8 rows, k 4, v 4 (1 KV head each):
        -> [0 1 2 3  8 9  12 13    4 5 6 7  10 11  14 15]
            q_0      k_0  v_0      q_1      k_1    v_1
    """
    raise NotImplementedError("course/phase8/parallel.py: fused_rows is yours to write")
