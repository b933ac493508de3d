"""Pipeline parallel: the layers split into consecutive stages, one device each.

Taught in docs/phases/08-multi-device.md, section 6.
"""

from __future__ import annotations

from tinyvllm.distributed.tensor_parallel import shard_devices


def split_layers(num_layers: int, size: int) -> list[range]:
    """Consecutive layers per stage, the first stages taking the remainder (the last holds lm_head too)."""
    base, extra = divmod(num_layers, size)
    stages, start = [], 0
    for s in range(size):
        n = base + (1 if s < extra else 0)
        stages.append(range(start, start + n))
        start += n
    return stages


class PipelineParallel:
    """Which device each layer runs on. size 1: every layer on the one device."""

    def __init__(self, num_layers: int, size: int = 1, device: str | None = None):
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= num_layers:
            raise ValueError(f"pipeline_parallel_size must be an integer in [1, {num_layers}] (the model's "
                             f"{num_layers} layers, at least one per stage), got {size!r}")
        self.size = size
        self.devices = shard_devices(device, size) if size > 1 else (device,)
        self.stages = split_layers(num_layers, size)
        self.layer_devices = [self.devices[s] for s, layers in enumerate(self.stages) for _ in layers]

    @property
    def first(self) -> str | None:
        return self.devices[0]

    @property
    def last(self) -> str | None:
        return self.devices[-1]
