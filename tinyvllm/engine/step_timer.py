"""Where the host's time goes in one engine step: an optional profiling hook
(docs/phases/06-appendix-host-stalls.md).

    engine.step_timer = StepTimer()       # LLMEngine.step and ModelRunner.execute_model call lap() only if set
    ... engine.step() ...
    engine.step_timer.per_step_ms()       # {"schedule": 0.4, "prepare_inputs": 0.3, "forward": 9.1, ...}
"""

from __future__ import annotations

import time
from collections import defaultdict

from tinygrad import Device

PHASES = ("schedule", "prepare_inputs", "forward", "bookkeeping", "detokenize")


class StepTimer:
    """Sums perf_counter time per phase over the steps it sees; `device`: the device to wait for first."""

    def __init__(self, device: str | None = None):
        self.totals: dict[str, float] = defaultdict(float)  # phase -> seconds
        self.num_steps = 0
        self.device = device
        self._last = 0.0

    def _now(self) -> float:
        if self.device is not None:
            Device[self.device].synchronize()  # queued work belongs to the phase that queued it
        return time.perf_counter()

    def start(self) -> None:
        """A step begins."""
        self.num_steps += 1
        self._last = self._now()

    def lap(self, phase: str) -> None:
        """The time since the last lap belongs to `phase`."""
        now = self._now()
        self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.totals.clear()
        self.num_steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step in each phase (PHASES order, then the others)."""
        steps = max(self.num_steps, 1)
        names = [p for p in PHASES if p in self.totals] + [p for p in self.totals if p not in PHASES]
        return {name: self.totals[name] / steps * 1e3 for name in names}
