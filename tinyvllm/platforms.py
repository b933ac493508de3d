"""What differs between devices, in one table, `PLATFORMS`, read through `platform_for(device)`
(docs/phases/05b-gpu.md, section 1)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

DEVICE_PATHS = ("auto", "discrete")
DEVICE_PATH = os.getenv("TINYVLLM_DEVICE_PATH", "auto").strip().lower()
if DEVICE_PATH not in DEVICE_PATHS:
    raise ValueError(f"TINYVLLM_DEVICE_PATH must be one of {', '.join(DEVICE_PATHS)}, got {DEVICE_PATH!r}")


@dataclass(frozen=True)
class Platform:
    kind: str  # "CPU", "CUDA", "METAL", ...
    path: str  # "host": the host sees the device's memory; "discrete": it does not
    host_views: bool  # numpy views of device buffers
    cpu_graph: bool  # replay graphs with kernels/cpu_graph.py; else TinyJit's own
    dtype: str  # what dtype "auto" means
    gpu_memory_utilization: float | None  # default share of device memory; None: a fixed budget

    @property
    def is_gpu(self) -> bool:
        return self.gpu_memory_utilization is not None


HOST = Platform("CPU", "host", host_views=True, cpu_graph=True, dtype="float32", gpu_memory_utilization=None)
GPU = Platform("GPU", "discrete", host_views=False, cpu_graph=False, dtype="float16", gpu_memory_utilization=0.9)
PLATFORMS: dict[str, Platform] = {
    "CPU": HOST,
    "CUDA": replace(GPU, kind="CUDA"),
    "NV": replace(GPU, kind="NV"),  # tinygrad's own NVIDIA driver
    "METAL": replace(GPU, kind="METAL"),
    "AMD": replace(GPU, kind="AMD"),
    "PYTHON": replace(GPU, kind="PYTHON", dtype="float32", gpu_memory_utilization=None),  # a GPU emulated
}


def device_kind(device: str | None) -> str:
    """'CUDA:1' -> 'CUDA'; None -> tinygrad's default device."""
    if device is None:
        from tinygrad import Device
        device = Device.DEFAULT
    return device.split(":")[0].upper()


def platform_for(device: str | None, device_path: str | None = None) -> Platform:
    """The row of `device` (None: tinygrad's default); `device_path` overrides TINYVLLM_DEVICE_PATH."""
    kind = device_kind(device)
    row = PLATFORMS.get(kind, replace(GPU, kind=kind))  # not listed: a GPU
    if (device_path or DEVICE_PATH) == "discrete" and row.path == "host":
        row = replace(row, path="discrete", host_views=False, cpu_graph=False)
    return row


def resolve_dtype(dtype: str, device: str | None) -> str:
    """`dtype`, "auto" made the device's."""
    return platform_for(device).dtype if dtype == "auto" else dtype
