"""`gpu_resident_bytes="auto"`: measure what the offloaded step exposes over the first
steps, then keep on the GPU, or load in the backward, the least state that makes the
step fast, within a memory budget.

What the step exposes is where the trainer's stream stalls for it. With forward
overlap that is each forward pre-hook's wait for the chunks its module reads (and
the wait for the last chunk as the forward returns); without it, the whole chunked
step. `StepTimer` puts CUDA events around those waits and after each chunk's update
on the step's stream, and reads them once, at a step fixed in advance (the same on
every rank, which then agree on one choice), where the host waits for the last
measured step anyway to rebuild the slabs. `choose_residency` is pure.

The stall model sees only the device's waits, not a forward the host paces or the
trainer's own small copies queued behind the step's, so with forward overlap on a GPU
"auto" searches instead (`next_split`): it runs the most state the budget keeps off the
forward's path for a few steps (the fastest step it can get), then walks down from it
for the least total whose step is within `NEAR_FASTEST` of the fastest measured
(`settled_split`). Of a total, the backward loads what its measured length carries
(`split_total`); the rest stays resident.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

AUTO_WARMUP_STEPS = 1  # the first step pins slabs and creates state: not measured
AUTO_MEASURED_STEPS = 2
STALL_TOLERANCE_MS = 1.0
""""auto" keeps the least state whose predicted stall is within this of the least the
cap allows: a millisecond a step is not worth more GPU memory."""
NEAR_FASTEST = 0.01
"""A step this much slower than the fastest measured is as fast, or more when the steps
vary more (`NOISE_SIGMAS`)."""
NOISE_SIGMAS = 2.0
"""A step slower than the fastest by less than this many standard errors of the two
medians' difference is as fast: what the search cannot tell apart is not worth GPU
memory. Steps of one run can vary by several percent, more than the splits differ, and
a fixed tolerance then lets that noise choose (the winner's next steps come in slower
than the probe that chose it)."""
NOISE_CAP = 0.05
"""But a step this much slower than the fastest is never as fast, however its steps
vary: steps that drift within a probe give an error that covers any gap, and the search
would settle on its slowest split."""
PROBE_STEPS = 6
"""Steps each split of the search runs: the median of the iterations between the first
(its re-plan loads the whole state: the backward before it loaded for the split before)
and the last (read as the next step starts, before the device gets there) counts (steps
of one run vary by several percent)."""
SLOW_PROBE_STEPS = 4
"""A split of the search whose every timed step so far (two by then) is slower than the
fastest by more than `NOISE_CAP` ends its probe after this many steps (`clearly_slower`):
only steps much faster than those could bring its median near the fastest, and each step
costs what it runs slower."""
MAX_PROBES = 4
AUTO_STEPS_AT_MOST = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS + (MAX_PROBES + 2) * PROBE_STEPS + 1
"""Steps until "auto" has settled and checked, at most (it says what it chose then)."""
SEARCH_STEPS = 8
"""The search's totals are the state over this many, and multiples."""
BACKWARD_LOAD_SHARE = 0.65
"""Of what the host link carries in the backward's time (from the last module on, at
the measured load rate), the share "auto" loads there: FSDP2's and the trainer's own
small copies share the copy engine and must not wait long behind ours."""
BUDGET_MARGIN_FRACTION = 0.05
"""Of the device's memory, what the default budget leaves free past the measured peak."""


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

    resident_bytes: int  # the state of the first `resident_units` units, kept on the GPU
    resident_units: int
    cap_bytes: int  # the most state the stall model could choose to keep off the forward
    state_bytes: int
    measured_stall_ms: float  # median over the measured steps, everything offloaded
    predicted_stall_ms: float  # what the model predicts is left with `resident_bytes`
    backward_load_bytes: int = 0  # state the backward loads (whole chunks), as planned
    backward_cap_bytes: int = 0  # what the backward could load, as measured
    budget_bytes: int = 0  # GPU memory "auto" could hold: resident state and staging
    held_bytes: int = 0  # GPU memory the chosen plan holds: resident state and staging
    probes: tuple[Probe, ...] = ()  # the search's splits and their steps, in the order tried
    checked: Probe | None = None  # the settled split's steps after the search
    reference: Probe | None = None  # the largest split's, run again before it, if another


@dataclass(frozen=True)
class Split:
    """State the forward does not load: kept on the GPU (whole leading units) or loaded
    in the backward (whole chunks, at most `backward_load_bytes`)."""

    resident_bytes: int
    backward_load_bytes: int

    @property
    def total(self) -> int:
        return self.resident_bytes + self.backward_load_bytes


@dataclass(frozen=True)
class Probe:
    """A split the search ran, and its step (median iteration and that median's standard
    error, `median_error_ms`; the slowest rank's)."""

    split: Split
    iteration_ms: float
    iterations_ms: tuple[float, ...] = ()  # each timed step (this rank's)
    error_ms: float = 0.0


def median_error_ms(steps: Sequence[float]) -> float:
    """The standard error of the median of `steps`, estimated robustly: the spread from
    the median absolute deviation (x 1.4826, a normal's sigma), times sqrt(pi / 2) over
    sqrt(n) (a median's standard error in a normal sample). 0 for fewer than 2 steps."""
    if len(steps) < 2:
        return 0.0
    middle = statistics.median(steps)
    sigma = 1.4826 * statistics.median(abs(t - middle) for t in steps)
    return sigma * math.sqrt(math.pi / 2 / len(steps))


def split_total(
    total: int, unit_bytes: Sequence[int], backward_cap: int, backward_first: int | None = None
) -> Split:
    """Of the first `total` bytes of the step, the backward loads `backward_first` (None,
    or the whole state: all it can carry, `backward_cap`), the leading units that fit in
    the rest stay resident, and the backward loads what is left beside them, up to
    `backward_cap`. The whole state's split may leave a gap (its total is less than the
    state's): any total from its total on splits as it does, so a split's own total
    splits the same way again.

    Loads first where the optimizer steps units whole; where it slices them, resident
    first behind the default's loads below the whole state: each the faster by
    measurement (docs/design.md, "auto").

    >>> split_total(350, [100] * 4, 200)
    Split(resident_bytes=100, backward_load_bytes=200)
    >>> split_total(350, [100] * 4, 200, backward_first=50)
    Split(resident_bytes=300, backward_load_bytes=50)
    """
    loads_first = (
        backward_first is None
        or total >= split_total(sum(unit_bytes), unit_bytes, backward_cap).total
    )
    first = backward_cap if loads_first else min(backward_first, backward_cap)
    kept = total - min(total, first)
    resident = max(r for r in itertools.accumulate(unit_bytes, initial=0) if r <= kept)
    return Split(resident, min(backward_cap, total - resident))


def whole_state_split(unit_bytes: Sequence[int], backward_cap: int) -> Split | None:
    """The whole state kept off the forward's path, where `split_total` leaves a gap: the
    least leading units that leave the backward no more than `backward_cap` stay resident,
    the backward loads the rest. None where there is no gap.

    With a gap the forward loads it through a ring slot, and the split can hold more than
    the whole state resident (the default budget), so the largest split that fits keeps
    less. The gap goes to the resident units, not the backward: loads past its cap slow
    the backward (docs/design.md, "auto")."""
    state = sum(unit_bytes)
    if split_total(state, unit_bytes, backward_cap).total == state:
        return None
    resident = min(r for r in itertools.accumulate(unit_bytes) if r >= state - backward_cap)
    return Split(resident, state - resident)


FINE_TOTALS = 16
"""`largest_fitting_total` tries at most this many whole-unit totals between two grid totals."""


def largest_fitting_total(
    unit_bytes: Sequence[int],
    backward_cap: int,
    fits: Callable[[Split], bool],
    backward_first: int | None = None,
) -> int:
    """The largest total whose split (`split_total`) `fits`, as the search's grid (each
    `SEARCH_STEPS`-th of the state) finds it scanned down from the whole state, then
    refined between that grid total and the next with whole-unit totals (at most
    `FINE_TOTALS`, evenly picked). Scanned, not bisected: what a split holds need not
    grow with its total (a unit left staged sizes the ring)."""
    state = sum(unit_bytes)
    step = max(1, -(-state // SEARCH_STEPS))
    grid = sorted({*range(step, state, step), state}, reverse=True)
    found, above = 0, state + 1
    for total in grid:
        split = split_total(total, unit_bytes, backward_cap, backward_first)
        if split.total > 0 and fits(split):
            found = split.total
            break
        above = total
    between = [t for t in itertools.accumulate(unit_bytes) if found < t < above and t <= state]
    pick = max(1, -(-len(between) // FINE_TOTALS))
    for total in sorted(between[::-1][::pick], reverse=True):
        split = split_total(total, unit_bytes, backward_cap, backward_first)
        if split.total > found and fits(split):
            return split.total
    return found


def search_splits(
    unit_bytes: Sequence[int], backward_cap: int, limit: int, backward_first: int | None = None
) -> list[Split]:
    """The splits the search may try, by growing total: multiples of a `SEARCH_STEPS`-th
    of the state, and `limit`; each total split by `split_total` (totals that split
    alike are one)."""
    step = max(1, -(-sum(unit_bytes) // SEARCH_STEPS))
    splits: list[Split] = []
    for total in [*range(step, limit, step), limit]:
        split = split_total(total, unit_bytes, backward_cap, backward_first)
        if split.total > (splits[-1].total if splits else 0):
            splits.append(split)
    return splits


def near_fastest(probe: Probe, probes: Sequence[Probe]) -> bool:
    """`probe`'s step is as fast as the fastest of `probes`: within `NEAR_FASTEST`, or
    within `NOISE_SIGMAS` standard errors of the difference of their medians, but never
    beyond `NOISE_CAP`."""
    fastest = min(probes, key=lambda p: p.iteration_ms)
    noise = NOISE_SIGMAS * math.hypot(probe.error_ms, fastest.error_ms)
    allowed = max(NEAR_FASTEST, min(noise / fastest.iteration_ms, NOISE_CAP))
    return probe.iteration_ms - fastest.iteration_ms <= allowed * fastest.iteration_ms


def clearly_slower(least_ms: float, probes: Sequence[Probe]) -> bool:
    """A split whose fastest step was `least_ms` (on the rank whose median is the probe's,
    the slowest) is slower than the fastest of `probes` by more than `NOISE_CAP`, the most
    `near_fastest` allows."""
    fastest = min(p.iteration_ms for p in probes)
    return least_ms > (1 + NOISE_CAP) * fastest


def with_split(splits: Sequence[Split], split: Split) -> list[Split]:
    """`splits` with `split` among them in total order (it replaces a split of its total)."""
    return sorted({s.total: s for s in (*splits, split)}.values(), key=lambda s: s.total)


def next_split(
    probes: Sequence[Probe],
    splits: Sequence[Split],
    default: Split | None = None,
    free: Collection[Split] = (),
) -> Split | None:
    """The split to try next, or None when the search is done.

    probes[0] is the measured steps (nothing kept off the forward's path). First the
    largest split (the fastest step the budget allows). A probe costs what its steps run
    slower than the fastest, so the search walks down from the largest: it tries one
    split further below the least near the fastest than that lies below the largest (1,
    3, 7 splits below the largest), and bisects once a slower split bounds it,
    `MAX_PROBES` at most; where a little state is as fast, it settles coarser than a
    bisection from the middle would, on more state. It stops once a split near the
    fastest costs no memory (in `free`): `settled_split` takes one of those, and a lower
    total can only match it.

    The walk takes a step not to get slower with more kept off the forward's path, which
    does not always hold: loading the whole state in the backward can run no faster than
    keeping nothing while the default's loads run faster (measured with Muon), so where
    keeping nothing is as fast as the largest, `default` (one of `splits`: what the
    optimizer runs without "auto") is tried.
    """
    if not splits or len(probes) > MAX_PROBES:
        return None
    if len(probes) == 1:
        return splits[-1]
    tried_default = any(p.split == default for p in probes)
    if default in splits and not tried_default and near_fastest(probes[0], probes):
        return default
    is_near = [near_fastest(p, probes) for p in probes]
    if any(ok and p.split in free for p, ok in zip(probes, is_near, strict=True)):
        return None
    index = {split: i for i, split in enumerate(splits)}
    tried = [(index.get(p.split, -1), ok) for p, ok in zip(probes, is_near, strict=True)]
    near = min(i for i, ok in tried if ok)
    slow = max((i for i, ok in tried if not ok and i < near), default=-1)
    if near - slow <= 1:
        return None
    below = near - (len(splits) - near)
    return splits[max(below, (slow + near) // 2)]


def settled_split(probes: Sequence[Probe], free: Collection[Split] = ()) -> Split:
    """Of the splits whose step was near the fastest (`near_fastest`): the fastest of
    those `free` (held within memory the run has used anyway, the room under its peak:
    they cost no memory, so only their steps tell them apart), else the least total."""
    near = [p for p in probes if near_fastest(p, probes)]
    costless = [p for p in near if p.split in free]
    if costless:
        return min(costless, key=lambda p: p.iteration_ms).split
    return min(near, key=lambda p: p.split.total).split


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
        self._backwards: dict[int, torch.Event | None] = {}  # step -> its backward's mark
        self._loads: list[tuple[int, torch.Event | None, torch.Event | None]] = []
        self._iterations: list[torch.Event | None] = []  # each step's start, while "auto" runs

    @property
    def timed(self) -> bool:
        """Whether the device times events (not the CPU)."""
        return self._timed

    def iteration_started(self, stream: torch.Stream | None) -> int:
        """A step starts on the trainer's stream; returns its index among those marked."""
        self._iterations.append(self.mark(stream))
        return len(self._iterations) - 1

    def iterations_ms(self, first: int, last: int) -> list[float]:
        """The iterations between marks `first` and `last` (each step's start to the
        next's), waiting for the last mark."""
        marks = self._iterations[first : last + 1]
        if not self._timed:
            return [0.0] * (len(marks) - 1)
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]

    def backward_started(self, stream: torch.Stream | None) -> None:
        """The backward after the step last started passed the forward's last module (the
        first such mark after a step counts)."""
        step = len(self._iterations) - 1
        if step not in self._backwards:
            self._backwards[step] = self.mark(stream)

    def loaded(self, nbytes: int, before: torch.Event | None, after: torch.Event | None) -> None:
        """A chunk of `nbytes` rank-invariant state bytes was copied in between the marks."""
        self._loads.append((nbytes, before, after))

    def backward_ms(self, since: int = 0) -> float:
        """Median time from a backward's mark to the next step's start, of the steps from
        `since` on started before the last (whose start the device may not have reached:
        waiting for it drains the device); 0 where not measured."""
        marks = self._iterations
        ends = {s: marks[s + 1] for s in self._backwards if since <= s and s + 2 < len(marks)}
        if not self._timed or not ends:
            return 0.0
        for end in ends.values():
            end.synchronize()
        return statistics.median(self._backwards[s].elapsed_time(e) for s, e in ends.items())

    def load_bytes_per_ms(self) -> float:
        """Rank-invariant state bytes the measured loads copied in per ms (0 if none)."""
        if not self._timed or not self._loads:
            return 0.0
        self._loads[-1][2].synchronize()
        took = sum(before.elapsed_time(after) for _, before, after in self._loads)
        return sum(n for n, *_ in self._loads) / took if took > 0 else 0.0

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
