"""Phase timers for `DecodeStats.draft_time` / `verify_time` that hold on any device."""

from __future__ import annotations

import time

import torch

from .results import DecodeStats


class PhaseClock:
    """Sums the time between pairs of marks per phase. On the CPU a mark is the wall clock. On CUDA the
    host runs ahead of the device (kernels are queued, not run, when the Python call returns), so a
    mark is an event recorded on the current stream and the sums are read once, in `into`, after the
    decode has synchronised anyway: no extra synchronisation inside the loop."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = {"draft": 0.0, "verify": 0.0}

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, phase: str, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> None:
        """Count the time from mark `start` to mark `end` as `phase` ('draft' or 'verify')."""
        if self.cuda:
            self._pending.append((phase, start, end))
        else:
            self._seconds[phase] += end - start

    def into(self, stats: DecodeStats) -> None:
        """Add the summed phase times to `stats` (and start over)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for phase, start, end in self._pending:
                self._seconds[phase] += start.elapsed_time(end) / 1000
            self._pending.clear()
        stats.draft_time += self._seconds["draft"]
        stats.verify_time += self._seconds["verify"]
        self._seconds = {"draft": 0.0, "verify": 0.0}
