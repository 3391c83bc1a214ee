"""Cheap per-phase wall-clock accounting of engine steps (for the overhead breakdown)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str, sync: torch.device | None = None) -> None:
        if sync is not None and sync.type == "cuda":
            torch.cuda.synchronize(sync)  # attribute GPU time to the phase that launched it
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.totals.clear()
