"""A `StepTimer` with made-up times, for testing what "auto" chooses without a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from offload.residency import StepProfile, StepTimer


class FakeStepTimer(StepTimer):
    """The CPU's timer (real chunk and wait records, all times zero) with made-up times:
    each chunk takes 10 ms; with `stall_first`, the trainer's first wait stalls until its
    chunk is done (it got there at once); with `stall_last`, the forward's last wait
    stalls for the rest of the step too; no other wait stalls."""

    def __init__(self, stall_first: bool, stall_last: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        self.stall_first, self.stall_last = stall_first, stall_last
        self.recorded: list[StepProfile] = []

    def profiles(self) -> list[StepProfile]:
        self.recorded = super().profiles()
        made_up = []
        for profile in self.recorded:
            done = tuple(10.0 * (c + 1) for c in range(len(profile.chunk_done_ms)))
            waits = [dataclasses.replace(w, stall_ms=0.0) for w in profile.waits]
            if self.stall_first:
                waits[0] = dataclasses.replace(waits[0], stall_ms=done[waits[0].chunk])
            if self.stall_last:
                stalled = done[-1] - waits[0].stall_ms
                waits[-1] = dataclasses.replace(waits[-1], stall_ms=stalled)
            made_up.append(StepProfile(done, tuple(waits)))
        return made_up


class FakeSearchTimer(FakeStepTimer):
    """A `FakeStepTimer` that also times steps, for "auto"'s search: each iteration takes
    `iteration_ms()` (asked as the next step starts, so of the split the last step ran),
    the backward `backward` ms and loads copy `bytes_per_ms`."""

    def __init__(
        self, iteration_ms: Callable[[], float], backward: float, bytes_per_ms: float
    ) -> None:
        super().__init__(stall_first=False)
        self.iteration_ms, self.backward, self.bytes_per_ms = iteration_ms, backward, bytes_per_ms
        self.clock = [0.0]

    @property
    def timed(self) -> bool:
        return True

    def iteration_started(self, stream: torch.Stream | None) -> int:
        if len(self.clock) < len(self._iterations) + 1:
            self.clock.append(self.clock[-1] + self.iteration_ms())
        return super().iteration_started(stream)

    def iterations_ms(self, first: int, last: int) -> list[float]:
        # On a GPU the step now starting has its mark queued behind the backward: waiting
        # for it drains the device while the host re-plans.
        assert last < len(self._iterations) - 1, "read the start of the step now starting"
        times = self.clock[first : last + 1]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def backward_ms(self, since: int = 0) -> float:
        return self.backward

    def load_bytes_per_ms(self) -> float:
        return self.bytes_per_ms


class FakeTuningTimer(StepTimer):
    """A timed `StepTimer` for the default's backward tuning: each timed forward stalls
    `stall_ms()` (asked once the round is read, so of the plan its steps ran) in its first
    wait, each step takes 100 ms (or `iteration()`, asked as the next step starts, so of
    the plan the step ran), the backward `backward` ms (or `backward()`), and loads copy
    `bytes_per_ms`."""

    def __init__(
        self,
        stall_ms: Callable[[], float],
        backward: float | Callable[[], float],
        bytes_per_ms: float,
        iteration: Callable[[], float] = lambda: 100.0,
    ):
        super().__init__(torch.device("cpu"))
        self.stall_ms, self.backward, self.bytes_per_ms = stall_ms, backward, bytes_per_ms
        self.iteration = iteration
        self.clock: list[float] = []  # each mark's time

    @property
    def timed(self) -> bool:
        return True

    def iteration_started(self, stream: torch.Stream | None) -> int:
        self.clock.append(self.clock[-1] + self.iteration() if self.clock else 0.0)
        return super().iteration_started(stream)

    def profiles(self) -> list[StepProfile]:
        stall = self.stall_ms()
        return [
            StepProfile(p.chunk_done_ms, (dataclasses.replace(p.waits[0], stall_ms=stall),))
            for p in super().profiles()
        ]

    def iterations_ms(self, first: int, last: int) -> list[float]:
        assert last < len(self._iterations) - 1, "read the start of the step now starting"
        times = self.clock[first : last + 1]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def backward_ms(self, since: int = 0) -> float:
        return self.backward() if callable(self.backward) else self.backward

    def load_bytes_per_ms(self) -> float:
        return self.bytes_per_ms
