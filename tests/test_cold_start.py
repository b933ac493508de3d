"""What a new process reuses from earlier ones (tinyvllm/kernels/program_cache.py, graph_cache.py): the default
device tinygrad chose, the CPU device's helper programs, and captured graphs. Each must be reused only where it
still holds, and give exactly what rebuilding it gives."""

from __future__ import annotations

import json

from tinyvllm import tinygrad_adapter
from tinyvllm.kernels import program_cache


def test_the_default_device_is_remembered_and_probed_again_when_the_machine_changes(tmp_path, monkeypatch):
    path = tmp_path / "default_device.json"
    probes = []

    def probe():
        probes.append(1)
        return "CPU"

    settled = []
    monkeypatch.setattr(program_cache, "chosen_default_device", lambda: None)
    monkeypatch.setattr(program_cache, "choose_default_device", probe)
    monkeypatch.setattr(program_cache, "set_default_device", settled.append)
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 1  # nothing remembered: probe
    assert json.loads(path.read_text())["device"] == "CPU"
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 1  # remembered: no probe
    assert settled == ["CPU"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the machine looks different: probe again
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 2
    path.write_text("{not json")  # a corrupt file: probe again
    assert program_cache.settle_default_device(path) == "CPU" and len(probes) == 3


def test_the_remembered_device_is_what_tinygrad_probes():
    from tinygrad import Device

    fingerprint = program_cache.machine_fingerprint()
    assert fingerprint["tinygrad"] == tinygrad_adapter.INSTALLED_VERSION
    assert tinygrad_adapter.chosen_default_device() in (None, Device.DEFAULT)
