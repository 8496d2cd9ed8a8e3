"""`gpu_resident_bytes="auto"`: measure the first steps, then keep on the GPU the
least state that lets the forward overlap hide the rest.

The measurement is CUDA events on the trainer's and the copy streams. They are
read once, at a step fixed in advance (the same on every rank, which then agree
on one budget), where the host waits for the last measured step anyway to
rebuild the slabs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

AUTO_WARMUP_STEPS = 1  # the first step pins slabs and creates state: not measured
AUTO_MEASURED_STEPS = 3
DEFAULT_RESIDENT_CAP_FRACTION = 0.5  # "auto" keeps at most half the state on the GPU


@dataclass(frozen=True)
class StepTiming:
    """One offloaded step, from `step()` on the trainer's stream."""

    window_ms: float  # until the next forward returns (0 without forward overlap)
    offloaded_ms: float  # until the last chunk is written back


def choose_resident_bytes(timings: Sequence[StepTiming], state_bytes: int, cap_bytes: int) -> int:
    """The smallest residency whose remaining copies fit the overlap window, at most the cap.

    The chunked copies take time in proportion to the bytes that cross PCIe, so
    keeping a fraction 1 - window / busy of the state on the GPU hides the rest.
    """
    window = statistics.median(t.window_ms for t in timings)
    busy = statistics.median(t.offloaded_ms for t in timings)
    if busy <= window:
        return 0
    return min(cap_bytes, math.ceil(state_bytes * (1 - window / busy)))


class StepTimer:
    """Events per measured step; `timings()` waits for them and returns the times.

    On a device without timing events (the CPU) every step measures as zero, so
    "auto" resolves to no residency through the same code path.
    """

    def __init__(self, device: torch.device) -> None:
        self._timed = device.type != "cpu"
        self._device = device
        self._steps: list[list[torch.Event | None]] = []  # [start, forward end, written back]

    def _event(self, stream: torch.Stream | None) -> torch.Event | None:
        if not self._timed:
            return None
        event = torch.Event(device=self._device, enable_timing=True)
        event.record(stream)
        return event

    def step_started(self, stream: torch.Stream | None) -> None:
        self._steps.append([self._event(stream), None, None])

    def forward_ended(self, stream: torch.Stream | None) -> None:
        if self._steps and self._steps[-1][1] is None:
            self._steps[-1][1] = self._event(stream)

    def step_written_back(self, stream: torch.Stream | None) -> None:
        if self._steps:
            self._steps[-1][2] = self._event(stream)

    def timings(self) -> list[StepTiming]:
        done = []
        for start, forward_end, end in self._steps:
            if not self._timed:
                done.append(StepTiming(0.0, 0.0))
                continue
            end.synchronize()
            window = 0.0
            if forward_end is not None:
                forward_end.synchronize()
                window = start.elapsed_time(forward_end)
            done.append(StepTiming(window, start.elapsed_time(end)))
        return done
