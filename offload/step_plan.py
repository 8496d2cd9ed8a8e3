"""The whole plan of an offloaded step, from the wrapper's options: which units stay
resident, which chunks the backward loads, the chunks (`chunk_plan`) and how the step
runs them (`step_schedule`). `CPUOffloadOptimizer` runs it, and the planner
(`muon_offload.estimate`) prints it: both build it here, so what one runs the other
prints. Pure: nothing here touches a device.

Example: five units of 1 KiB of fp32 state each, overlapped with the next forward, the
first unit resident, the backward loading the chunks the forward first waits for (param
1's: at least the ring's), a ring of 2:

    >>> import torch
    >>> from offload.chunk_plan import ParamSpec, StateSpec
    >>> specs = [ParamSpec(256, (StateSpec("m", torch.Size([256]), torch.float32),))] * 5
    >>> units = tuple((i,) for i in range(5))
    >>> def plan(room, most=None):
    ...     return plan_offloaded_step(
    ...         units, specs, chunk_bytes=1024, staging_slots=2, resident_bytes=1024,
    ...         overlap=True, backward=BackwardLoads(first_wait=(1,), room=room, most=most))
    >>> step = plan(room=None)
    >>> step.schedule.describe()
    '5 chunks: 1 resident, 4 staged in a ring of 2 slots and 2 extra slots; the backward loads 2'
    >>> step.backward_load_bytes, step.held_bytes
    (2048, 5120)

With room for that much state under the device's peak, the backward loads them all (the
ring, with nothing left to it, holds nothing):

    >>> plan(room=5120).schedule.describe()
    '5 chunks: 1 resident, 4 staged in 4 extra slots; the backward loads 4'

Within a budget of 4 KiB for state on the device (`gpu_budget_bytes`), fewer than the
forward first waits for:

    >>> plan(room=5120, most=4096).schedule.describe()
    '5 chunks: 1 resident, 4 staged in a ring of 2 slots and 1 extra slots; the backward loads 1'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload.chunk_plan import OffloadPlan, ParamSpec, plan_offload
from offload.step_schedule import (
    StepSchedule,
    chosen_backward_loads,
    loads_within_room,
    plan_step,
)


@dataclass(frozen=True)
class BackwardLoads:
    """Which of the step's first staged chunks the backward loads (forward overlap).

    With `first_wait` (the default with overlap): the chunks holding those params (by
    index; what the next forward waits for first), at least the ring's, and more while
    the step holds at most `room` bytes of state on the device (None: no more). Without:
    the leading whole chunks within `budget` state bytes (rank-invariant, at most that
    much; None: the ring's). Either way never so many that the step holds more than
    `most` bytes (the user's `gpu_budget_bytes`: fewer, down to none, where those would).
    """

    first_wait: tuple[int, ...] | None = None
    room: int | None = None
    budget: int | None = None
    most: int | None = None


@dataclass(frozen=True)
class OffloadedStep:
    """An offloaded step's chunks and schedule."""

    plan: OffloadPlan
    schedule: StepSchedule

    @property
    def held_bytes(self) -> int:
        """GPU bytes for state the step holds at most: resident state, ring, extra slots."""
        return self.plan.held_bytes(self.schedule.slots, self.schedule.ring_slots)

    @property
    def backward_load_bytes(self) -> int:
        """The rank-invariant state bytes of the chunks the backward loads."""
        chunks = self.plan.chunks
        return sum(chunks[c].invariant_bytes for c in self.schedule.loaded_in_backward)


def plan_offloaded_step(
    units: Sequence[Sequence[int]],
    specs: Sequence[ParamSpec],
    *,
    chunk_bytes: int,
    staging_slots: int,
    resident_bytes: int,
    overlap: bool,
    backward: BackwardLoads | None,
    host_room_for_all: bool = False,
) -> OffloadedStep:
    """Plan a step over `units` (param indices, in the order the step runs them: with
    overlap, the forward's) of params `specs`: up to `resident_bytes` of whole units
    resident (with `overlap` the first, else the last; `chunk_plan.plan_offload`), the
    others staged through `staging_slots` ring slots, and, with `backward`, the first
    staged chunks loaded in the backward into extra slots (full chunks from the first,
    which fill the ring; without, the first chunks ramp up)."""
    plan = plan_offload(
        units,
        specs,
        chunk_bytes,
        resident_bytes=resident_bytes,
        resident_first=overlap,
        ramp_first=backward is None,
        host_room_for_all=host_room_for_all,
    )
    staged = [not c.resident for c in plan.chunks]

    def schedule(loads: int) -> StepSchedule:
        return plan_step(staged, staging_slots, loads, overlap=overlap)

    def held(step_schedule: StepSchedule) -> int:
        return plan.held_bytes(step_schedule.slots, staging_slots)

    loads = 0
    if backward is not None and overlap:
        loads = chosen_backward_loads(
            [(*c.params, *(s.param for s in c.slices)) for c in plan.chunks],
            [c.invariant_bytes for c in plan.chunks],
            staged,
            staging_slots,
            first_wait=backward.first_wait,
            budget=backward.budget,
        )
        if backward.first_wait is not None and backward.room is not None:
            loads = loads_within_room(
                loads,
                sum(staged),
                staging_slots,
                lambda count: held(schedule(count)),
                backward.room,
            )
        if backward.most is not None:
            loads = next((n for n in range(loads, 0, -1) if held(schedule(n)) <= backward.most), 0)
    return OffloadedStep(plan, schedule(loads))
