"""`gpu_resident_bytes="auto"` run step by step: measure, choose, try, settle.

`CPUOffloadOptimizer` calls `AutoResidency.step_started` at the start of every step and,
once it has a plan, `decide`, until it has settled; a `Split` that returns is the state
to keep off the forward's path from that step on (the optimizer re-plans). The choices
are `offload.residency`'s pure functions; this object only counts steps, reads the
timer and makes the ranks agree (every rank re-plans at the same steps, so each takes
the same chunks).

Steps: the first `AUTO_WARMUP_STEPS` pin slabs and create state; the next
`AUTO_MEASURED_STEPS` run everything offloaded and are measured (stalls, the backward's
length, the load rate, each step). With forward overlap on a device that times events,
the last measured step's backward loads what the backward may carry (its measured length
at the load rate), the leading chunks: the first split the search tries keeps them off
the forward's path too, and its re-plan copies them on the device instead of loading
them again. Then the stall model's total, split between the
backward and residency; with forward overlap on a device that times events, the search
tries splits, `PROBE_STEPS` steps each (`SLOW_PROBE_STEPS` where each of its steps
so far is clearly slower than the fastest), settles (`residency.next_split`), and checks the
settled split on the next `PROBE_STEPS` steps: against the largest split tried (the most
kept off the forward's path), run again just before, where the search settled on another,
so the two runs compared are next to each other. A run's steps get faster over its first
few dozen: the largest split, tried first, measures slower than it runs, and a smaller
split tried later passes as near it, or as faster (docs/design.md, "auto").
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from offload.residency import (
    AUTO_MEASURED_STEPS,
    AUTO_WARMUP_STEPS,
    BACKWARD_LOAD_SHARE,
    PROBE_STEPS,
    SLOW_PROBE_STEPS,
    Probe,
    ResidencyChoice,
    Split,
    StepProfile,
    StepTimer,
    choose_residency,
    clearly_slower,
    largest_fitting_total,
    leading_units,
    median_error_ms,
    median_predicted_stall_ms,
    near_fastest,
    next_split,
    search_splits,
    settled_split,
    split_total,
    whole_state_split,
    with_split,
)


@dataclass(frozen=True)
class StepShape:
    """What "auto" weighs of the measured plan (everything offloaded).

    chunk_bytes, unit_bytes: rank-invariant state bytes per chunk and per unit, in step
    order (without overlap, "auto" keeps the last units: it weighs them from the end);
    overlap: the step overlaps the next forward; slices_units: the optimizer's step can
    cut units into slices (its splits keep state resident first, `split_total`).
    """

    chunk_bytes: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    overlap: bool
    slices_units: bool = False


class AutoResidency:
    """The state of one optimizer's "auto" until it settles (`choice`).

    budget_bytes: GPU memory for state the choice may hold (this device's bytes, as the
    caller's `held` counts them); None: the device's headroom at the measured peak, but
    never more than keeping the whole state on the GPU holds (offloading is for holding
    less than not offloading), except that the default's backward loads are tried too.
    backward: what the backward may load: "auto" (what its measured length carries),
    a fixed byte count, or None (nothing).
    """

    def __init__(
        self,
        timer: StepTimer,
        budget_bytes: int | None,
        backward: str | int | None,
        device: torch.device,
    ) -> None:
        self.timer = timer
        self.device = device
        self.budget_bytes = budget_bytes
        self._budget_given = budget_bytes is not None
        self.backward = backward
        self.choice: ResidencyChoice | None = None
        self._steps = 0
        self._probes: list[Probe] = []
        self._splits: list[Split] = []
        self._default: Split | None = None  # the split the optimizer runs without "auto"
        self._free: set[Split] = set()  # load-only splits held in the room under the peak
        self._probe_start = 0
        self._current = Split(0, 0)
        self._settled: Split | None = None  # what the search settled on, being checked
        self._rerunning = False  # the largest split runs again before the check
        self._reference: Probe | None = None  # that run: what the check compares with
        # the measured plan's chunks, once the last measured step re-plans (`_load_ahead`)
        self._measured_chunk_bytes: tuple[int, ...] | None = None
        # Set by the first choice:
        self._base: ResidencyChoice | None = None  # the stall model's
        self._backward_cap = 0
        self._shape: StepShape | None = None
        self._profiles: Sequence[StepProfile] = ()

    def _agree(
        self, largest: Sequence[float], least: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        return agree_across_ranks(largest, least, self.device)

    def failed_ranks(self, failed: bool) -> list[int]:
        return failed_ranks(failed, self.device)

    @property
    def measuring(self) -> bool:
        """This step is one of the measured ones (everything offloaded, timed)."""
        return AUTO_WARMUP_STEPS <= self._steps - 1 < AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS

    @property
    def profiling(self) -> bool:
        """This step's chunks and waits are timed: a measured step running everything
        offloaded, not the last one once its backward loads (`_load_ahead`), whose plan
        cuts the first chunks otherwise (the stall model reads the profiles against one
        plan's chunks)."""
        return self.measuring and self._current == Split(0, 0)

    @property
    def timing_backward(self) -> bool:
        """The backward after this step is timed: the warmup's too, so that the last
        measured step knows what the backward may load, from a backward that ended
        before it started (`StepTimer.backward_ms`)."""
        return self._steps - 1 < AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS

    def step_started(self, stream: torch.Stream | None) -> None:
        """A step starts on the trainer's stream (each step's, before its own work)."""
        self.timer.iteration_started(stream)
        self._steps += 1

    def decide(
        self,
        shape: StepShape,
        held: Callable[[Split], int],
        headroom_bytes: Callable[[], int],
        default_backward_bytes: Callable[[], int],
        room_bytes: Callable[[], int | None],
    ) -> Split | None:
        """At the step just started: the split to run from here, or None (keep the current
        one). `held(split)`: this device's bytes a split holds for state at most (the
        caller plans it); `headroom_bytes()`: the default budget; `default_backward_bytes()`:
        what the backward loads without "auto" (0: nothing), a split the search tries;
        `room_bytes()`: what a split may hold without raising the run's peak (None:
        unknown); each asked at most once."""
        step = self._steps - 1
        if step < AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS - 1:
            return None
        if step < AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS:
            return self._load_ahead(shape, held, headroom_bytes)
        if self._base is None:  # at the step after the measured ones, or the first to get
            # here (the user may have mended a step refused before it asked)
            return self._first_choice(
                step, shape, held, headroom_bytes, default_backward_bytes, room_bytes
            )
        ended = step >= self._probe_start + PROBE_STEPS
        searching = self._settled is None
        if not ended and not (searching and step == self._probe_start + SLOW_PROBE_STEPS):
            return None
        # The probe's first iteration re-planned and loaded the whole state (its backward
        # loaded for the split before): left out, as is the last (`_before_this_step`).
        probe, least = self._probe(
            self._current, self._before_this_step(self._probe_start + 1, step)
        )
        if not ended and not clearly_slower(least, self._probes):
            return None
        if self._rerunning:
            self._rerunning, self._reference = False, probe
            self._probe_start = step
            return self._run(self._settled)
        if self._settled is not None:
            return self._check(probe)
        self._probes.append(probe)
        return self._next(step)

    def _before_this_step(self, first: int, last: int) -> list[float]:
        """The iterations from step `first` to step `last` (at most), each to the next
        step's start, of those ended before this step started: this step's own start is
        still queued behind the backward on the device, and waiting for it would drain
        the device while the host re-plans."""
        return self.timer.iterations_ms(first, min(last, self._steps - 2))

    def _probe(self, split: Split, took: Sequence[float]) -> tuple[Probe, float]:
        """`split`'s steps `took`: the slowest rank's median and its error (every rank
        compares the same numbers, so every rank settles alike), and the slowest rank's
        least step (no more than its median, the probe's: ranks that run at different
        speeds compare the same rank's steps)."""
        median = statistics.median(took) if took else 0.0
        least = min(took, default=0.0)
        (iteration, error, least), _ = self._agree([median, median_error_ms(took), least], [])
        return Probe(split, iteration, tuple(took), error), least

    def _first_choice(
        self,
        step: int,
        shape: StepShape,
        held: Callable[[Split], int],
        headroom_bytes: Callable[[], int],
        default_backward_bytes: Callable[[], int],
        room_bytes: Callable[[], int | None],
    ) -> Split | None:
        # A plan takes milliseconds of host time, which only the backward still queued on
        # the device covers: plan each split once.
        held = functools.cache(held)
        profiles = self.timer.profiles()
        if self._measured_chunk_bytes is not None:  # the profiles' chunks, not the running plan's
            shape = dataclasses.replace(shape, chunk_bytes=self._measured_chunk_bytes)
        if not shape.overlap:  # the last units stay resident: the step seen from its end
            profiles = [p.from_the_end() for p in profiles]
            shape = dataclasses.replace(
                shape, chunk_bytes=shape.chunk_bytes[::-1], unit_bytes=shape.unit_bytes[::-1]
            )
        budget, backward = self._limits(shape, held, headroom_bytes, since=AUTO_WARMUP_STEPS)
        self._backward_cap = backward
        # what the backward loads without "auto" (0: nothing): a split the search tries, and
        # what the backward loads before any unit stays resident where units slice
        default_bytes = None
        if self.backward is not None and shape.overlap:
            # the least over the ranks (each fills its own room under its peak): a whole
            # chunk prefix on every rank, as the plans' chunks are rank-invariant
            _, (least,) = self._agree([], [default_backward_bytes()])
            default_bytes = int(least)
        first_loads = default_bytes if shape.slices_units else None
        # the measured steps' iterations (each to the next step's start)
        measured_end = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS
        measured, _ = self._probe(
            Split(0, 0), self._before_this_step(AUTO_WARMUP_STEPS, measured_end)
        )
        # Ranks agree (each holds its own shards): the slowest step; the least of their
        # largest totals that fit; then which splits fit every rank (what a split holds
        # need not grow with its total), the largest model choice, and whether its split
        # fits everywhere.

        def fits(split: Split) -> bool:
            return held(split) <= budget

        largest = largest_fitting_total(shape.unit_bytes, backward, fits, first_loads)
        _, (limit,) = self._agree([], [largest])
        limit = int(limit)
        model = choose_residency(profiles, shape.chunk_bytes, shape.unit_bytes, limit)
        splits = search_splits(shape.unit_bytes, backward, limit, first_loads)
        (total,), fitting = self._agree([model.resident_bytes], [fits(s) for s in splits])
        splits = [split for split, ok in zip(splits, fitting, strict=True) if ok]
        # Where the whole state's split leaves the forward a gap whose ring slot takes it
        # past the budget, the whole state with the gap kept resident.
        # (the whole state splits loads first, whatever the optimizer: `split_total`)
        whole = whole_state_split(shape.unit_bytes, backward)
        gapped = split_total(sum(shape.unit_bytes), shape.unit_bytes, backward)
        if whole is not None and gapped not in splits:
            _, (whole_fits,) = self._agree([], [fits(whole)])
            if whole_fits:
                splits = with_split(splits, whole)
        default = None
        if default_bytes is not None:
            # Tried past the default budget too: without "auto" it would run anyway, and
            # its loads fill the room under the peak (the same on every rank). Not past a
            # byte count the user gave the backward's loads: the most they may be.
            default = Split(0, default_bytes)
            _, (default_fits,) = self._agree([], [fits(default)])
            capped = isinstance(self.backward, int) and default.backward_load_bytes > backward
            if default.total > 0 and not capped and (default_fits or not self._budget_given):
                splits = with_split(splits, default)
        first = split_total(int(total), shape.unit_bytes, backward, first_loads)
        _, (first_fits,) = self._agree([], [fits(first)])
        if not first_fits:
            smaller = [s for s in splits if s.total <= first.total]
            first = max(smaller, key=_total, default=Split(0, 0))
        self._base = model
        self._shape, self._profiles = shape, profiles
        if not (shape.overlap and self.timer.timed):
            # Nothing to search with: the model's choice.
            self._settle(first, shape, profiles)
            return self._run(first)
        room = room_bytes()
        # Resident state is held through the forward, at the peak: only loads are free.
        candidates = [measured.split, *splits]
        within = [
            room is not None and s.resident_bytes == 0 and held(s) <= room for s in candidates
        ]
        _, within = self._agree([], [float(w) for w in within])  # free on every rank
        self._free = {s for s, w in zip(candidates, within, strict=True) if w}
        self._probes = [measured]
        self._splits = splits
        self._default = default
        return self._next(step)

    def _limits(
        self,
        shape: StepShape,
        held: Callable[[Split], int],
        headroom_bytes: Callable[[], int],
        since: int,
    ) -> tuple[int, int]:
        """The budget (`budget_bytes` resolved, at the first step that asks: the peak as
        measured before any split ran) and what the backward may load, from the
        backwards of steps `since` on (`StepTimer.backward_ms`); each the least over the
        ranks (each holds its own shards)."""
        budget = self.budget_bytes
        if budget is None:
            budget = min(headroom_bytes(), held(Split(sum(shape.unit_bytes), 0)))
        backward = 0
        if self.backward == "auto":
            backward = int(
                BACKWARD_LOAD_SHARE * self.timer.backward_ms(since) * self.timer.load_bytes_per_ms()
            )
        elif isinstance(self.backward, int):
            backward = self.backward
        _, (budget, backward) = self._agree([], [budget, backward])
        self.budget_bytes = int(budget)
        return self.budget_bytes, int(backward)

    def _load_ahead(
        self,
        shape: StepShape,
        held: Callable[[Split], int],
        headroom_bytes: Callable[[], int],
    ) -> Split | None:
        """At the last measured step, with forward overlap on a timed device: the split
        whose backward loads the leading chunks within what the backward may load, where
        it fits every rank's budget. Its forward still loads everything (the backward
        before it loaded nothing), so the step measures as the others; the first split
        the search tries then copies those chunks on the device."""
        if not (shape.overlap and self.timer.timed):
            return None
        # the warmup's backward too: a measured step's ends as this step starts
        budget, backward = self._limits(shape, held, headroom_bytes, since=0)
        split = Split(0, backward)
        _, (fits,) = self._agree([], [float(backward > 0 and held(split) <= budget)])
        if not fits:
            return None
        self._measured_chunk_bytes = shape.chunk_bytes  # its plan cuts the first chunks anew
        return self._run(split)

    def _next(self, step: int) -> Split | None:
        split = next_split(self._probes, self._splits, self._default, self._free)
        if split is None:
            # Settled: the next PROBE_STEPS steps check what it measured for that split
            # (also when it was the fastest: steps of one run vary, and the check says so);
            # the largest split tried, if another, runs again first, to be checked against.
            split = self._settled = settled_split(self._probes, self._free)
            largest = max((p.split for p in self._probes), key=_total)
            if largest != split:
                split, self._rerunning = largest, True
        self._probe_start = step
        return self._run(split)

    def _check(self, after: Probe) -> Split | None:
        """The settled split's steps against the largest split's, run just before
        (`_reference`), or, where it is the largest, against the fastest split the search
        measured: not as fast (`near_fastest`), that split instead (once; itself when it
        was the fastest)."""
        reference = self._reference or min(self._probes, key=lambda p: p.iteration_ms)
        split = self._settled
        against = [reference, after] if self._reference else [*self._probes, after]
        if not near_fastest(after, against):
            split = reference.split
        self._settle(split, self._shape, self._profiles, after)
        return self._run(split)

    def _run(self, split: Split) -> Split | None:
        """`split` from this step on: returned if it is not the one running."""
        if split == self._current:
            return None
        self._current = split
        return split

    def settle_on(self, split: Split) -> None:
        """The split returned is not run (its re-plan failed, e.g. out of memory, or at the
        last measured step it would load nothing in the backward): settle on `split`, the
        one that ran before (at the last measured step, run it: the first choice comes at
        the next step)."""
        self._current = split
        if self._base is not None:  # else still measuring: the first choice comes next
            self._settle(split, self._shape, self._profiles)

    def _settle(
        self,
        split: Split,
        shape: StepShape,
        profiles: Sequence[StepProfile],
        checked: Probe | None = None,
    ) -> None:
        """What "auto" chose: `choice`, which the optimizer reports once it is set."""
        base = self._base
        self.choice = ResidencyChoice(
            resident_bytes=split.resident_bytes,
            resident_units=leading_units(shape.unit_bytes, split.resident_bytes),
            cap_bytes=base.cap_bytes,
            state_bytes=base.state_bytes,
            measured_stall_ms=base.measured_stall_ms,
            predicted_stall_ms=median_predicted_stall_ms(profiles, shape.chunk_bytes, split.total),
            backward_load_bytes=split.backward_load_bytes,
            backward_cap_bytes=self._backward_cap,
            budget_bytes=self.budget_bytes,
            probes=tuple(self._probes),
            checked=checked,
            reference=self._reference if checked is not None else None,
        )


def _total(split: Split) -> int:
    return split.total


def has_peers() -> bool:
    """A default process group of more than one rank is up: the ranks must agree (alone,
    a collective and reading its result back would only wait for the device)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_across_ranks(
    largest: Sequence[float], least: Sequence[float], device: torch.device
) -> tuple[list[float], list[float]]:
    """Across ranks: the largest of each of `largest`, the least of each of `least` (as
    given without a process group). One collective, at the same step on every rank, on
    `device` (NCCL's rank r on its own GPU)."""
    if not has_peers():
        return list(largest), list(least)
    values = torch.tensor(
        [*largest, *(-float(v) for v in least)], dtype=torch.float64, device=device
    )
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    out = values.tolist()
    return out[: len(largest)], [-v for v in out[len(largest) :]]


def failed_ranks(failed: bool, device: torch.device) -> list[int]:
    """The ranks where `failed` is true (given on every rank at the same step; [0] or []
    without a process group). One collective, like `agree_across_ranks`."""
    if not has_peers():
        return [0] if failed else []
    flags = torch.zeros(torch.distributed.get_world_size(), device=device)
    flags[torch.distributed.get_rank()] = float(failed)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]
