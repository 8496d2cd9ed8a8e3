"""`gpu_resident_bytes="auto"`: measure what the offloaded step exposes over the first
steps, then keep on the GPU the least state that removes what the cap can remove of it.

What the step exposes is where the trainer's stream stalls for it. With forward
overlap that is each forward pre-hook's wait for the chunks its module reads (and
the wait for the last chunk as the forward returns); without it, the whole chunked
step. `StepTimer` puts CUDA events around those waits and after each chunk's update
on the step's stream, and reads them once, at a step fixed in advance (the same on
every rank, which then agree on one choice), where the host waits for the last
measured step anyway to rebuild the slabs. `choose_residency` is pure.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

AUTO_WARMUP_STEPS = 1  # the first step pins slabs and creates state: not measured
AUTO_MEASURED_STEPS = 3
DEFAULT_RESIDENT_CAP_FRACTION = 0.5  # "auto" keeps at most half the state on the GPU
STALL_TOLERANCE_MS = 1.0
""""auto" keeps the least state whose predicted stall is within this of the least the
cap allows: a millisecond a step is not worth more GPU memory."""


@dataclass(frozen=True)
class ChunkWait:
    """The trainer's stream waited `stall_ms` for chunk `chunk`, the last holding the state
    it needs; that state ends `needs` rank-invariant bytes into the step (its units and all
    before them in step order)."""

    chunk: int
    needs: int
    stall_ms: float


@dataclass(frozen=True)
class StepProfile:
    """One measured offloaded step (everything offloaded), from `step()` on.

    chunk_done_ms[c]: when chunk c's update was done, on the step's stream;
    waits: the trainer's stream's waits for chunks, in the order it reached them.
    """

    chunk_done_ms: tuple[float, ...]
    waits: tuple[ChunkWait, ...]

    @property
    def stall_ms(self) -> float:
        return sum(w.stall_ms for w in self.waits)

    def from_the_end(self) -> StepProfile:
        """A step without forward overlap, whose last units stay resident, as
        `choose_residency` sees it: chunks from the last, and one stall (the whole step,
        run on the trainer's stream) that keeping the last R bytes shortens by what the
        last chunks took."""
        took = [b - a for a, b in zip((0.0, *self.chunk_done_ms), self.chunk_done_ms, strict=False)]
        done = tuple(itertools.accumulate(took[::-1]))
        needs = max((w.needs for w in self.waits), default=0)
        return StepProfile(done, (ChunkWait(len(done) - 1, needs, self.stall_ms),))


@dataclass(frozen=True)
class ResidencyChoice:
    """What "auto" chose and why (`CPUOffloadOptimizer.residency`)."""

    resident_bytes: int  # the budget chosen: the state of the first `resident_units` units
    resident_units: int
    cap_bytes: int
    state_bytes: int
    measured_stall_ms: float  # median over the measured steps, everything offloaded
    predicted_stall_ms: float  # what the model predicts is left with `resident_bytes`

    def with_budget(
        self,
        resident_bytes: int,
        profiles: Sequence[StepProfile],
        chunk_bytes: Sequence[int],
        unit_bytes: Sequence[int],
    ) -> ResidencyChoice:
        """The same measurement with another rank's (larger) choice, a prefix of the same units."""
        return dataclasses.replace(
            self,
            resident_bytes=resident_bytes,
            resident_units=leading_units(unit_bytes, resident_bytes),
            predicted_stall_ms=median_predicted_stall_ms(profiles, chunk_bytes, resident_bytes),
        )


def leading_units(unit_bytes: Sequence[int], budget: int) -> int:
    """How many leading units fit in `budget` bytes (what `plan_offload` keeps of a budget
    that is a prefix sum; zero-byte units hold no state and are counted)."""
    used = units = 0
    for size in unit_bytes:
        if used + size > budget:
            break
        used, units = used + size, units + 1
    return units


def _done_ms(profile: StepProfile, chunk_end_bytes: Sequence[int], resident: int) -> float:
    """When the step, everything offloaded, was done with its first `resident` bytes
    (interpolated inside a chunk): the time a resident prefix of that size saves every
    later chunk, since the copies run in step order at the rate of the PCIe link."""
    c = bisect.bisect_left(chunk_end_bytes, resident)
    if c >= len(chunk_end_bytes):
        return profile.chunk_done_ms[-1] if profile.chunk_done_ms else 0.0
    start_bytes = chunk_end_bytes[c - 1] if c > 0 else 0
    start_ms = profile.chunk_done_ms[c - 1] if c > 0 else 0.0
    span = chunk_end_bytes[c] - start_bytes
    fraction = (resident - start_bytes) / span if span > 0 else 1.0
    return start_ms + fraction * (profile.chunk_done_ms[c] - start_ms)


def predicted_stall_ms(
    profile: StepProfile, chunk_end_bytes: Sequence[int], resident: int
) -> float:
    """The trainer's stall left if the first `resident` bytes of the step stay on the GPU.

    The trainer's stream is late at a wait by all its stalls so far (it stalled there, so
    the chunk was the last thing it waited for). Keeping the first R bytes resident makes
    every chunk holding bytes past R done `_done_ms(R)` earlier, and a wait that needs
    only bytes within R finds them resident, stepped first; so a wait is late by
    `stalls so far - _done_ms(R)` if it needs more than R, else not at all, and the
    step's stall is the largest lateness. Waits that did not stall are never later than
    an earlier one that did (they need no less), so they never set it.
    """
    late, worst = 0.0, 0.0
    for wait in profile.waits:
        late += wait.stall_ms
        if wait.stall_ms > 0 and wait.needs > resident:
            worst = max(worst, late - _done_ms(profile, chunk_end_bytes, resident))
    return worst


def median_predicted_stall_ms(
    profiles: Sequence[StepProfile], chunk_bytes: Sequence[int], resident: int
) -> float:
    """`predicted_stall_ms`, median over the measured steps."""
    if not profiles:
        return 0.0
    ends = list(itertools.accumulate(chunk_bytes))
    return statistics.median(predicted_stall_ms(p, ends, resident) for p in profiles)


def choose_residency(
    profiles: Sequence[StepProfile],
    chunk_bytes: Sequence[int],
    unit_bytes: Sequence[int],
    cap_bytes: int,
) -> ResidencyChoice:
    """The fewest leading units (in step order) whose residency removes all the stall the
    cap can remove, give or take `STALL_TOLERANCE_MS`.

    chunk_bytes: each measured chunk's rank-invariant state bytes, in step order;
    unit_bytes: each unit's, in step order. Leading units are the ones to keep: the
    copies run in step order, so a resident byte early in the step makes every later
    chunk (and every later wait) earlier, and the first chunks are the ones the
    forward waits for before anything can overlap them. Each profile's prediction is a
    non-increasing function of the bytes kept; their median is too.
    """
    candidates = sorted(set(itertools.accumulate(unit_bytes, initial=0)))  # prefix sums
    candidates = [r for r in candidates if r <= cap_bytes]

    def predicted(resident: int) -> float:
        return median_predicted_stall_ms(profiles, chunk_bytes, resident)

    least = predicted(candidates[-1])
    chosen = next(r for r in candidates if predicted(r) <= least + STALL_TOLERANCE_MS)
    measured = statistics.median(p.stall_ms for p in profiles) if profiles else 0.0
    return ResidencyChoice(
        resident_bytes=chosen,
        resident_units=leading_units(unit_bytes, chosen),
        cap_bytes=cap_bytes,
        state_bytes=sum(unit_bytes),
        measured_stall_ms=measured,
        predicted_stall_ms=predicted(chosen),
    )


class StepTimer:
    """Events per measured step; `profiles()` waits for them and returns the times.

    On a device without timing events (the CPU) every step measures as zero, so
    "auto" resolves to no residency through the same code path.
    """

    def __init__(self, device: torch.device) -> None:
        self._timed = device.type != "cpu"
        self._device = device
        self._starts: list[torch.Event | None] = []
        self._chunks: list[list[torch.Event | None]] = []
        self._waits: list[list[tuple[int, int, torch.Event | None, torch.Event | None]]] = []

    def mark(self, stream: torch.Stream | None) -> torch.Event | None:
        if not self._timed:
            return None
        event = torch.Event(device=self._device, enable_timing=True)
        event.record(stream)
        return event

    def step_started(self, stream: torch.Stream | None) -> None:
        self._starts.append(self.mark(stream))
        self._chunks.append([])
        self._waits.append([])

    def chunk_done(self, stream: torch.Stream | None) -> None:
        """The step's next chunk is updated (recorded on the stream that updates it)."""
        self._chunks[-1].append(self.mark(stream))

    def waited(
        self, chunk: int, needs: int, before: torch.Event | None, after: torch.Event | None
    ) -> None:
        """The trainer's stream waited for `chunk` (see `ChunkWait`) between `before` and
        `after` (its marks); waits before the first measured step are not counted.

        A step's first wait counts from the step's start instead: the forward can do
        nothing before its first module's params are updated, so whatever held the
        trainer back until then is the step's. (A trainer that reaches the first module's
        wait after its chunk is done measures a wait of 0 and "auto" keeps nothing; seen in
        `bench/train_step.py`'s resident "auto" arms.)
        """
        if self._waits:
            if not self._waits[-1]:
                before = self._starts[-1]
            self._waits[-1].append((chunk, needs, before, after))

    def profiles(self) -> list[StepProfile]:
        done = []
        for start, chunks, waits in zip(self._starts, self._chunks, self._waits, strict=True):
            if not self._timed:
                done.append(
                    StepProfile(
                        (0.0,) * len(chunks), tuple(ChunkWait(c, n, 0.0) for c, n, *_ in waits)
                    )
                )
                continue
            for event in chunks:
                event.synchronize()
            for *_, after in waits:
                after.synchronize()
            done.append(
                StepProfile(
                    tuple(start.elapsed_time(e) for e in chunks),
                    tuple(ChunkWait(c, n, max(0.0, b.elapsed_time(a))) for c, n, b, a in waits),
                )
            )
        return done
