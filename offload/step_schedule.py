"""Pure planning of how an offloaded step runs its chunks, built once with the chunk
plan and run by `CPUOffloadOptimizer` every step. Nothing here touches a device.

A step runs its chunks in step order (`chunk_plan.OffloadPlan.chunks`). A resident
chunk only updates. A staged chunk is loaded into a staging slot (host to GPU),
updated there, and written back (GPU to host); the slot is loaded again once its
write-back is done. The schedule says:

- which slot each staged chunk takes: the chunks the backward loads an extra slot each,
  the others the ring's `ring_slots` in turn (`staging_slot_order`), so the ring is free
  for the forward's loads when the step starts;
- which leading chunks are ready when the step starts (resident, or loaded in the
  backward): their updates are enqueued first (`ready`), in as few optimizer calls as
  their params allow, so the host pays a few calls' overhead for them, not one a chunk
  (with forward overlap, a few more: `ramped_runs` cuts them so the first call is short);
- in which order the copies and updates are enqueued: the first `ring_slots - 1`
  loads up front, then per chunk the load `ring_slots - 1` staged chunks ahead, its
  update, its write-back; with forward overlap the extra slots' write-backs go last
  (nothing waits for them, while the forward waits for ring loads that wait for ring
  write-backs, and the copy engine runs copies in the order they were enqueued);
- with forward overlap, how far ahead of the forward the chunks are enqueued:
  `UP_FRONT_RINGS` rings' worth when `step()` returns, then `ring_slots` beyond the
  chunk the forward needs, counted in chunks, ready ones too (what is left of theirs
  is the ring's loads due by their turn: enqueued as the forward passes them, after the
  trainer's own small copies to the GPU, its input batch and FSDP2's, which would
  otherwise wait behind them in the copy engine: enqueued in `step()`, they held up the
  forward's start and the step was slower,
  `bench/measured/train_step_hf_b4_prologue_ab_20b41e8_h100.log`).

Example: 2 resident chunks, then 6 staged, a ring of 3, the backward loading 3:

    >>> s = plan_step([False, False] + [True] * 6, ring_slots=3, backward_loads=3, overlap=True)
    >>> s.slots
    (-1, -1, 3, 4, 5, 0, 1, 2)
    >>> s.ready
    (0, 1, 2, 3, 4)
    >>> s.per_chunk[3]  # chunk 3's ops: the load 2 staged chunks ahead (into the ring)
    (('load', 5),)
    >>> s.per_chunk[5]
    (('load', 7), ('step', 5), ('write_back', 5))
    >>> s.epilogue  # the backward's chunks write back last
    (('write_back', 2), ('write_back', 3), ('write_back', 4))
    >>> s.describe()
    '8 chunks: 2 resident, 6 staged in a ring of 3 slots and 3 extra slots; the backward loads 3'
    >>> s.forward_load_bytes([100] * 8)  # chunks 5, 6 and 7
    300
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

UP_FRONT_RINGS = 2
"""With forward overlap, chunks enqueued when `step()` returns, in rings' worth."""

Op = tuple[Literal["load", "step", "write_back"], int]
"""One enqueued operation on a chunk (its index in step order)."""


def update_runs(
    touched: Sequence[Collection[Hashable]],
    creates: Sequence[bool],
    state_bytes: Sequence[int],
    resident: Sequence[bool],
    slices_together: bool,
) -> list[list[int]]:
    """Chunks in step order (each the params it updates, whether its update creates
    state, its state bytes, whether its state is `resident`) cut into runs that may each
    update in one call, as the step runs its `ready` chunks (with forward overlap
    `ramped_runs` cuts them further). A chunk that creates state runs alone
    (a sliced param's slices each create their own, adopted after their call). A run
    holds each param once (its state entry points at that chunk's slice), but for
    resident chunks, whose slices of a param are views of its one home and join into one
    (`executor.joined_slices`).

    With `slices_together` (the subset step reads each slice's state from
    `ParamSlice.state`) a run may hold several slices of one param: runs take as many
    chunks as fit in the largest run the rule above makes, so they are no more, and no
    larger (a foreach update's temporaries grow with its call).

    >>> five = [{"a"}, {"b"}, {"b", "c"}, {"d"}, {"e"}]
    >>> update_runs(five, [0, 0, 0, 1, 0], [1] * 5, [0] * 5, False)
    [[0, 1], [2], [3], [4]]
    >>> four = [{"a"}, {"a", "b"}, {"b"}, {"b"}]
    >>> update_runs(four, [0] * 4, [2, 1, 1, 1], [1, 1, 0, 0], False)
    [[0, 1], [2], [3]]
    >>> update_runs(four, [0] * 4, [2, 1, 1, 1], [1, 1, 0, 0], True)
    [[0, 1], [2, 3]]
    >>> update_runs(five, [0, 0, 0, 1, 0], [1] * 5, [0] * 5, True)
    [[0, 1], [2], [3], [4]]
    """
    runs: list[list[int]] = []
    seen: set[Hashable] = set()
    closed = True  # the last run takes no more chunks
    at_home = False  # every chunk of the last run is resident
    for c, (params, created, home) in enumerate(zip(touched, creates, resident, strict=True)):
        repeats = any(p in seen for p in params) and not (home and at_home)
        if closed or created or repeats:
            runs.append([])
            seen, at_home = set(), True
        runs[-1].append(c)
        seen.update(params)
        closed, at_home = created, at_home and home
    if not slices_together:
        return runs
    cap = max(sum(state_bytes[c] for c in run) for run in runs) if runs else 0
    together: list[list[int]] = []
    held = 0
    for c, (created, size) in enumerate(zip(creates, state_bytes, strict=True)):
        if not together or created or creates[together[-1][-1]] or held + size > cap:
            together.append([])
            held = 0
        together[-1].append(c)
        held += size
    return together


def ramped_runs(runs: Sequence[Sequence[int]]) -> list[list[int]]:
    """`runs` (`update_runs`) cut so that the k-th holds at most 2**k chunks, for a step
    the forward overlaps: the forward waits for the chunks it needs first (its first
    unit's, and those FSDP2 all-gathers with it) until the call that updates the last of
    them is done, so short first calls let it start while the later, longer ones update,
    in a few more calls (log2 of the ready chunks).

    >>> ramped_runs([[0, 1, 2, 3, 4, 5, 6, 7, 8], [9]])
    [[0], [1, 2], [3, 4, 5, 6], [7, 8], [9]]
    """
    out: list[list[int]] = []
    for run in runs:
        at = 0
        while at < len(run):
            size = 2 ** len(out)
            out.append(list(run[at : at + size]))
            at += size
    return out


def backward_load_count(staged_bytes: Sequence[int], ring_slots: int, budget: int | None) -> int:
    """How many of the step's first staged chunks the backward loads.

    `staged_bytes` are the staged (not resident) chunks' rank-invariant state bytes in
    step order. Without a `budget`, one per ring slot; with one, the most leading chunks
    whose state fits in `budget` bytes: a byte count is the most the backward loads (each
    load holds an extra slot at the end of the backward). The same on every rank.
    """
    if budget is None:
        return min(ring_slots, len(staged_bytes))
    total = 0
    for index, size in enumerate(staged_bytes):
        total += size
        if total > budget:
            return index
    return len(staged_bytes)


def backward_load_share(loads: int, passed: int, watched: int) -> int:
    """How many of the backward's `loads` chunks are enqueued once it has passed `passed`
    of the `watched` owner modules (last first): spread evenly over the modules before
    the last, so each share starts only when the backward gets there (loads enqueued all
    at once queue the trainer's own small copies behind them)."""
    return min(loads, math.ceil(loads * passed / max(1, watched - 1)))


def first_wait_load_count(
    chunk_params: Sequence[Collection[int]],
    staged: Sequence[bool],
    first_wait: Collection[int],
    ring_slots: int,
) -> int:
    """How many of the step's first staged chunks hold what the next forward waits for
    first (the params `first_wait`, by index): the leading staged chunks through the last
    chunk touching any of them, but never fewer than the ring holds.

    Loaded in the backward, they let the forward start at once: without, it waits for
    their copies before computing anything (the root unit of a transformer wrapped per
    layer holds the embedding and the head). The same on every rank.
    """
    wanted = set(first_wait)
    last = max((c for c, params in enumerate(chunk_params) if wanted & set(params)), default=-1)
    through = sum(staged[: last + 1])
    return max(min(ring_slots, sum(staged)), through)


def loads_within_room(
    least: int, staged: int, ring_slots: int, held: Callable[[int], int], room: int
) -> int:
    """From `least` chunks loaded in the backward, the most (of the `staged` chunks) whose
    step holds no more than `room` bytes (`held(loads)`: what the plan with that many
    holds for state on the device). Each chunk loaded adds its slot while the ring keeps
    its `ring_slots`; once fewer chunks than that are left to the ring it shrinks, and
    more loaded can hold less, so those last counts are each tried."""
    loads = least
    while loads < staged - ring_slots and held(loads + 1) <= room:
        loads += 1
    shrinking = range(staged, max(loads, staged - ring_slots), -1)
    return next((count for count in shrinking if held(count) <= room), loads)


def chosen_backward_loads(
    chunk_params: Sequence[Collection[int]],
    chunk_bytes: Sequence[int],
    staged: Sequence[bool],
    ring_slots: int,
    *,
    first_wait: Collection[int] | None,
    budget: int | None,
) -> int:
    """How many of the step's first staged chunks a backward that loads chunks loads, by
    the rule its options pick: with `first_wait` (forward overlap's default: the params,
    by index, the next forward waits for first) the chunks holding them
    (`first_wait_load_count`), else `budget` bytes of them (None: the ring's;
    `backward_load_count`). Per chunk in step order: `chunk_params` (by index, slices'
    params too), `chunk_bytes` (rank-invariant), `staged` (not resident). The wrapper
    and the planner both ask here, so what one runs the other prints."""
    if first_wait is not None:
        return first_wait_load_count(chunk_params, staged, first_wait, ring_slots)
    sizes = [size for size, is_staged in zip(chunk_bytes, staged, strict=True) if is_staged]
    return backward_load_count(sizes, ring_slots, budget)


def staging_slot_order(staged: int, ring_slots: int, backward_loads: int) -> list[int]:
    """Each staged chunk's staging slot, in step order.

    The `backward_loads` chunks take one extra slot each (slot `ring_slots + k`: loaded in
    the backward, given back once written back); the chunks after them take the ring's
    slots in turn. Nothing waits for an extra slot's write-back, so it can wait for the
    forward, and the ring's first loads wait for nothing: had the backward loaded into
    the ring, its write-backs would come first, and a small copy the trainer reads back
    early in the forward (transformers' mask creation makes one) would wait in the copy
    engine behind them (`bench/measured/train_step_hf_b4_bwd_extra_h200.log`).
    """
    if ring_slots < 1:
        raise ValueError(f"ring_slots should be >= 1 but is: {ring_slots}")
    return [
        ring_slots + k if k < backward_loads else (k - backward_loads) % ring_slots
        for k in range(staged)
    ]


def ring_slots_taken(slots: Sequence[int], ring_slots: int) -> int:
    """How many of the ring's `ring_slots` slots the chunks' `slots` take (the ring holds
    no more: when the backward loads all but two staged chunks, a ring of two)."""
    return len({slot for slot in slots if 0 <= slot < ring_slots})


@dataclass(frozen=True)
class StepSchedule:
    """How one step runs its chunks (see the module's docstring)."""

    slots: tuple[int, ...]
    """Per chunk in step order: its staging slot (`ring_slots` and up: an extra slot), or -1
    when resident."""
    ring_slots: int
    backward_loads: int
    """The first staged chunks the backward of the forward after a step loads."""
    ready: tuple[int, ...]
    """The leading chunks whose state is on the GPU when the step starts: the resident
    ones and those the backward loads (the executor loads any the backward did not, e.g.
    on the first step). Updated first, in as few calls as their params allow; no op below
    loads or updates them."""
    prologue: tuple[Op, ...]
    """Enqueued before the first chunk: the first loads."""
    per_chunk: tuple[tuple[Op, ...], ...]
    """Enqueued when chunk c runs: the load ahead of it, its update, its write-back."""
    epilogue: tuple[Op, ...]
    """Enqueued after the last chunk: the write-backs held back (the extra slots')."""
    up_front: int
    """With forward overlap: the last chunk enqueued when `step()` returns (the number of
    chunks: all of them and the epilogue, which gives the ring back)."""
    ahead_of: tuple[int, ...]
    """With forward overlap: per chunk, the last chunk enqueued once the forward needs it
    (the number of chunks, as in `up_front`)."""
    overlap: bool
    """The step runs with the next forward."""

    @functools.cached_property
    def staged(self) -> tuple[int, ...]:
        """The chunks with a staging slot, in step order (read by every backward hook)."""
        return tuple(c for c, slot in enumerate(self.slots) if slot >= 0)

    @property
    def loaded_in_backward(self) -> tuple[int, ...]:
        """The chunks the backward loads: the first `backward_loads` staged ones."""
        return self.staged[: self.backward_loads]

    @property
    def ring_slots_taken(self) -> int:
        """The ring's slots the staged chunks take (`ring_slots_taken`)."""
        return ring_slots_taken(self.slots, self.ring_slots)

    @property
    def extra_slots(self) -> int:
        return sum(slot >= self.ring_slots for slot in self.slots)

    def forward_load_bytes(self, chunk_bytes: Sequence[int]) -> int:
        """The state bytes the forward after a step loads, of chunks of `chunk_bytes` (step
        order): with forward overlap the staged chunks the backward does not load (what
        the overlap must hide behind the forward, while as much writes back); without,
        none (`step()` loads them all)."""
        if not self.overlap:
            return 0
        in_backward = set(self.loaded_in_backward)
        return sum(chunk_bytes[c] for c in self.staged if c not in in_backward)

    def describe(self) -> str:
        staged = len(self.staged)
        text = f"{len(self.slots)} chunks: {len(self.slots) - staged} resident, {staged} staged"
        places = [f"a ring of {self.ring_slots_taken} slots"] if self.ring_slots_taken else []
        if self.extra_slots:
            places.append(f"{self.extra_slots} extra slots")
        if places:
            text += " in " + " and ".join(places)
        if self.backward_loads:
            text += f"; the backward loads {self.backward_loads}"
        return text


def plan_step(
    staged: Sequence[bool],
    ring_slots: int,
    backward_loads: int,
    overlap: bool,
) -> StepSchedule:
    """The schedule of a step whose chunks (step order) are `staged` or resident.

    backward_loads: how many of the first staged chunks the backward loads
    (`backward_load_count`; 0 without); overlap: the step runs with the next forward (the
    extra slots' write-backs go last, and the look-ahead is planned).
    """
    staged_chunks = [c for c, is_staged in enumerate(staged) if is_staged]
    order = staging_slot_order(len(staged_chunks), ring_slots, backward_loads)
    slot_of = dict(zip(staged_chunks, order, strict=True))
    slots = tuple(slot_of.get(c, -1) for c in range(len(staged)))
    on_gpu = set(staged_chunks[:backward_loads]) | {c for c, s in enumerate(staged) if not s}
    ready = tuple(itertools.takewhile(on_gpu.__contains__, range(len(staged))))
    ahead = ring_slots - 1  # loads in flight ahead of the update (0: load, then update)
    prologue: tuple[Op, ...] = tuple(("load", c) for c in staged_chunks[:ahead] if c not in ready)
    per_chunk: list[tuple[Op, ...]] = []
    held: list[Op] = []
    next_load = ahead
    for c in range(len(staged)):
        ops: list[Op] = []
        if slots[c] >= 0:
            if next_load < len(staged_chunks) and staged_chunks[next_load] not in ready:
                ops.append(("load", staged_chunks[next_load]))
            next_load += 1
        if c not in ready:
            ops.append(("step", c))
        if slots[c] >= 0:
            write_back: Op = ("write_back", c)
            if overlap and slots[c] >= ring_slots:
                held.append(write_back)
            else:
                ops.append(write_back)
        per_chunk.append(tuple(ops))

    # Past the last chunk is the epilogue: the extra slots' write-backs and the ring given
    # back while the forward runs, not after it.
    end = len(staged)
    ahead_of = tuple(min(c + ring_slots, end) for c in range(len(staged)))
    return StepSchedule(
        slots=slots,
        ring_slots=ring_slots,
        backward_loads=backward_loads,
        ready=ready,
        prologue=prologue,
        per_chunk=tuple(per_chunk),
        epilogue=tuple(held),
        up_front=min(UP_FRONT_RINGS * ring_slots - 1, end),
        ahead_of=ahead_of if overlap else (),
        overlap=overlap,
    )
