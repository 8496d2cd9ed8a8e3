"""Pure planning for the chunked offloaded step: which units (or slices of them)
go in which chunk, which chunks keep their state on the GPU, and where each
state tensor lives in the host slabs, the GPU-resident slabs and the staging slots.

Built once from shapes, executed every step. Nothing here touches a device.

Example, two ranks, three units of one fp32 state tensor each, 4 KiB chunks:
unit sizes are counted as global numel / shards, so a 255-row matrix sharded
128 + 127 counts 255 * cols / 2 elements on both ranks and both cut the same
chunks, even though their local shards differ. A splittable unit (one param
whose update is elementwise) is cut at the same rank-invariant element offsets
on every rank; each rank maps them onto its own shard (`_local_range`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from offload.step_schedule import ring_slots_taken

# Offsets inside slabs and staging slots are rounded up to this many bytes so
# every view starts on a boundary the vectorized copy and update kernels like.
ALIGN_BYTES = 256
# Chunks at each end of a step ramp their size up by halves over this many steps.
RAMP_STEPS = 3
# A splittable unit is cut at multiples of this many (rank-invariant) elements from its
# start. torch's CPU fused kernels (`fused=True` Adam, AdamW, SGD, Adagrad) cut a tensor
# into 64-byte task units from its start, and each thread's run of units into a vectorized
# body and a scalar tail that round differently; 64 elements are whole 64-byte units for
# every dtype of 1 to 8 bytes, so a slice is cut there as the whole tensor is.
SLICE_ELEMENTS = 64


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one param, as the step keeps it (local shard shape)."""

    key: str
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSpec:
    """What planning needs of a param: its rank-invariant size and its state."""

    invariant_numel: int  # global numel / number of shards: the same on every rank
    state: tuple[StateSpec, ...]
    splittable: bool = False
    """The step may update any contiguous slice of the flattened local shard on its own
    (elementwise update, every state tensor shaped like the param)."""

    @property
    def invariant_bytes(self) -> int:
        return sum(self.invariant_numel * s.dtype.itemsize for s in self.state)


@dataclass(frozen=True)
class UnitSize:
    """What packing needs of a unit: its rank-invariant state bytes, and for a
    splittable one its rank-invariant element count."""

    bytes: int
    numel: int = 0  # elements, when splittable
    splittable: bool = False


@dataclass(frozen=True)
class Span:
    """A packed piece: unit `unit` (whole), or its invariant elements [start, stop)."""

    unit: int
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class SliceLayout:
    """Elements [start, stop) of param `param`'s flattened local shard (may be empty)."""

    param: int
    start: int
    stop: int


@dataclass(frozen=True)
class StateView:
    """The part of one state tensor a chunk holds, and where it lives.

    The whole state tensor has one home (`home_offset` into its dtype's host or
    GPU-resident slab); the chunk holds its local elements [start, stop) (all of
    them unless `sliced`), at `staging_offset` in a staging slot.
    """

    param: int  # index into the flat param list the plan was built over
    spec: StateSpec
    home_offset: int
    start: int
    stop: int
    sliced: bool
    staging_offset: int  # unused (0) in a resident chunk: it steps in its home

    @property
    def shape(self) -> torch.Size:
        """The shape the step sees: the state's, or a flat slice."""
        return torch.Size([self.stop - self.start]) if self.sliced else self.spec.shape


@dataclass(frozen=True)
class Copy:
    """One contiguous copy between a home slab and a staging slot, in elements."""

    home_start: int
    staging_start: int
    numel: int


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk: whole params and param slices, their state views, and the few
    contiguous copies per dtype that load or write back its state."""

    params: tuple[int, ...]
    slices: tuple[SliceLayout, ...]
    views: tuple[StateView, ...]
    copies: Mapping[torch.dtype, tuple[Copy, ...]]  # empty when resident
    resident: bool  # state stays on the GPU: no copies, no staging slot
    invariant_bytes: int  # rank-invariant state bytes it steps ("auto" weighs chunks by it)

    @property
    def staging_numel(self) -> dict[torch.dtype, int]:
        """Elements of each dtype this chunk takes of a staging slot (its copies' extent)."""
        return {
            dtype: max(run.staging_start + run.numel for run in runs)
            for dtype, runs in self.copies.items()
            if runs
        }

    @property
    def staging_bytes(self) -> int:
        """Bytes this chunk takes of a staging slot (`staging_numel`): an extra slot's size."""
        return _bytes(self.staging_numel)


@dataclass(frozen=True)
class OffloadPlan:
    chunks: tuple[ChunkLayout, ...]
    host_numel: Mapping[torch.dtype, int]  # elements of each dtype's host slab
    resident_numel: Mapping[torch.dtype, int]  # elements of each dtype's GPU-resident slab
    slot_numel: Mapping[torch.dtype, int]  # elements of each dtype's staging slot

    @property
    def host_bytes(self) -> int:
        return _bytes(self.host_numel)

    @property
    def resident_bytes(self) -> int:
        return _bytes(self.resident_numel)

    def staging_bytes(self, slots: int) -> int:
        return slots * _bytes(self.slot_numel)

    def ring_slot_numel(self, slots: Sequence[int], ring_slots: int) -> dict[torch.dtype, int]:
        """Elements of each dtype a ring slot holds, given each chunk's staging slot
        (`step_schedule.StepSchedule.slots`): the most any chunk taking a ring slot needs
        (the backward's chunks have slots of their own, sized for them)."""
        numel: dict[torch.dtype, int] = {}
        for chunk, slot in zip(self.chunks, slots, strict=True):
            if 0 <= slot < ring_slots:
                for dtype, n in chunk.staging_numel.items():
                    numel[dtype] = max(numel.get(dtype, 0), n)
        return numel

    def ring_bytes(self, slots: Sequence[int], ring_slots: int) -> int:
        """GPU bytes of the ring, given each chunk's staging slot: the slots the chunks
        take, each of `ring_slot_numel`."""
        taken = ring_slots_taken(slots, ring_slots)
        return taken * _bytes(self.ring_slot_numel(slots, ring_slots))

    def held_bytes(self, slots: Sequence[int], ring_slots: int) -> int:
        """GPU bytes for state a step of this plan holds at most, given each chunk's staging
        slot (`step_schedule.StepSchedule.slots`): the resident state, the ring
        (`ring_bytes`) and an extra slot, sized for its chunk, per chunk with a slot beyond
        the ring (the backward's, held with the ring from the step on)."""
        ring = self.ring_bytes(slots, ring_slots)
        extra = sum(
            chunk.staging_bytes
            for chunk, slot in zip(self.chunks, slots, strict=True)
            if slot >= ring_slots
        )
        return self.resident_bytes + ring + extra


def _bytes(numel: Mapping[torch.dtype, int]) -> int:
    """Bytes of `numel` elements per dtype."""
    return sum(n * dtype.itemsize for dtype, n in numel.items())


def _greedy(
    units: Sequence[UnitSize], cap: Callable[[int], int], reverse: bool
) -> list[list[Span]]:
    """Chunks, in order; chunk k takes units (cutting splittable ones) while under cap(k).

    With `reverse` the units are packed from the last, each splittable one from its
    end; the result is still in forward order. Either way a cut falls on a multiple of
    SLICE_ELEMENTS from the unit's start.
    """
    chunks: list[list[Span]] = []
    current: list[Span] = []
    filled = 0

    def close() -> None:
        nonlocal current, filled
        chunks.append(current)
        current, filled = [], 0

    order = range(len(units) - 1, -1, -1) if reverse else range(len(units))
    for index in order:
        unit = units[index]
        if not unit.splittable or unit.bytes == 0:
            if current and filled + unit.bytes > cap(len(chunks)):
                close()
            current.append(Span(index, 0, unit.numel))
            filled += unit.bytes
            continue
        per_element = unit.bytes // unit.numel
        lo, hi = 0, unit.numel  # its elements not packed yet
        while lo < hi:
            room = max(0, cap(len(chunks)) - filled) // per_element
            if hi - lo <= room:
                start, stop = lo, hi
            elif reverse:
                start, stop = min(hi, _round_up(hi - room)), hi
            else:
                start, stop = lo, _round_down(lo + room)
            if start == stop:
                if current:
                    close()
                    continue
                # a cap under one slice still takes one
                start, stop = (
                    (_round_down(hi - 1), hi) if reverse else (lo, min(hi, lo + SLICE_ELEMENTS))
                )
            current.append(Span(index, start, stop))
            filled += (stop - start) * per_element
            lo, hi = (lo, start) if reverse else (stop, hi)
            if lo < hi:
                close()
    if current:
        close()
    if reverse:
        return [chunk[::-1] for chunk in chunks[::-1]]
    return chunks


def pack_units(
    units: Sequence[UnitSize], chunk_bytes: int, ramp_first: bool = True
) -> tuple[tuple[Span, ...], ...]:
    """Cut units, in order, into chunks of at most `chunk_bytes`.

    A splittable unit is cut into slices where a chunk fills up, so its chunks
    stay under the cap; a unit that cannot split and is larger than the cap is
    a chunk of its own. The first and last RAMP_STEPS chunks hold 1/2, 1/4, ...
    of the cap: nothing overlaps the first load or the last write-back, so small
    end chunks shorten the pipeline's fill and drain. Without `ramp_first` the first
    chunks are full: their loads are overlapped by something else (the backward).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes should be > 0 but is: {chunk_bytes}")

    def cap(k: int) -> int:
        return chunk_bytes >> max(0, RAMP_STEPS - k)

    def full(k: int) -> int:
        return chunk_bytes

    total, half = sum(u.bytes for u in units), 0
    if total <= chunk_bytes:
        return (tuple(Span(i, 0, u.numel) for i, u in enumerate(units)),) if units else ()
    middle = len(units)  # units [0, middle) pack forward, the rest backward
    for index, unit in enumerate(units):
        if 2 * half >= total:
            middle = index
            break
        half += unit.bytes
    head = _greedy(units[:middle], cap if ramp_first else full, reverse=False)
    tail = _greedy(units[middle:], cap, reverse=True)
    tail = [[Span(s.unit + middle, s.start, s.stop) for s in chunk] for chunk in tail]
    return tuple(tuple(chunk) for chunk in head + tail)


def _round_down(offset: int) -> int:
    return offset // SLICE_ELEMENTS * SLICE_ELEMENTS


def _round_up(offset: int) -> int:
    return -(-offset // SLICE_ELEMENTS) * SLICE_ELEMENTS


def _aligned(offset: int, dtype: torch.dtype) -> int:
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-offset // step) * step


def _local_range(span: Span, spec: ParamSpec) -> tuple[int, int]:
    """A span's invariant element range on this rank's shard.

    Offsets past the local shard clip to its end (a shorter shard has empty
    slices at the end); the last slice runs to the end of the shard (a longer
    one, up to a row more than the invariant size, puts the rest there).
    """
    local = spec.state[0].numel
    stop = local if span.stop == spec.invariant_numel else min(span.stop, local)
    return min(span.start, local), stop


def _resident_units(unit_bytes: Sequence[int], budget: int, first: bool) -> list[bool]:
    """Which whole units keep their state on the GPU: from the front (`first`) or the
    back, the units that fit in `budget` bytes up to the first that does not.

    One run: units resident past a skipped one would cut the staged units into runs that
    each pack (and ramp) on their own (HF Llama 0.85B at 3 GiB: the layers' small norms
    kept past a skipped matrix made 30 staged chunks of 3.3 GiB, 16 as one run)."""
    resident = [False] * len(unit_bytes)
    used = 0
    order = range(len(unit_bytes)) if first else range(len(unit_bytes) - 1, -1, -1)
    for index in order:
        size = unit_bytes[index]
        if used + size > budget:
            break
        resident[index] = size > 0 or used > 0  # leading stateless units need no GPU slab
        used += size
    return resident


def unit_sizes(units: Sequence[Sequence[int]], params: Sequence[ParamSpec]) -> list[UnitSize]:
    """Each unit's rank-invariant state bytes; a one-param splittable unit's element count."""
    sizes = []
    for unit in units:
        spec = params[unit[0]]
        if len(unit) == 1 and spec.splittable and spec.invariant_numel > 0:
            sizes.append(UnitSize(spec.invariant_bytes, spec.invariant_numel, True))
        else:
            sizes.append(UnitSize(sum(params[i].invariant_bytes for i in unit)))
    return sizes


def plan_offload(
    units: Sequence[Sequence[int]],
    params: Sequence[ParamSpec],
    chunk_bytes: int,
    resident_bytes: int = 0,
    resident_first: bool = False,
    ramp_first: bool = True,
    host_room_for_all: bool = False,
) -> OffloadPlan:
    """Cut `units` (lists of param indices) into chunks and lay out their state.

    Chunks hold up to `chunk_bytes` of state, or up to the largest staged unit that
    cannot be cut where that is larger (the staging slots are that large anyway).

    Whole units holding up to `resident_bytes` (rank-invariant) of state keep it
    on the GPU: the first units that fit with `resident_first` (the forward needs
    them first and cannot overlap them), else the last (nothing overlaps their
    copies). A unit's state has one home, so residency never cuts a unit. Every other
    chunk's state tensors have homes in the host slabs, laid out in chunk order,
    so loading or writing back a chunk is a few contiguous copies per dtype.

    With `host_room_for_all`, the host slabs keep room for resident state too, and every
    state tensor's host home is where it is with nothing resident: plans of any
    `resident_bytes` (and `ramp_first`) share one host layout, so moving between them
    moves only the resident state (what "auto" does while it searches).
    """
    sizes = unit_sizes(units, params)
    resident = _resident_units([s.bytes for s in sizes], resident_bytes, resident_first)
    # A staging slot is as large as the largest staged unit that cannot be cut, so chunks
    # fill up to that too: the same ring, fewer and larger launches (Muon beside HF Llama's
    # two 500 MiB AdamW units: chunks of 256 MiB left the overlapped forward host-bound
    # enqueuing them, in `bench/train_step.py`).
    fill = max(
        [chunk_bytes]
        + [s.bytes for s, kept in zip(sizes, resident, strict=True) if not (kept or s.splittable)]
    )
    packed = []  # (spans, resident): each run of units alike in residency packed on its own
    start = 0
    for stop in range(1, len(units) + 1):
        if stop == len(units) or resident[stop] != resident[start]:
            packed += [
                (tuple(Span(s.unit + start, s.start, s.stop) for s in spans), resident[start])
                for spans in pack_units(sizes[start:stop], fill, ramp_first or resident[start])
            ]
            start = stop
    homes: dict[bool, dict[torch.dtype, int]] = {False: {}, True: {}}
    home_offset: dict[tuple[int, str], int] = {}
    if host_room_for_all:  # the host homes in step order, resident or not
        for unit in units:
            for i in unit:
                for spec in params[i].state:
                    offset = _aligned(homes[False].get(spec.dtype, 0), spec.dtype)
                    home_offset[i, spec.key] = offset
                    homes[False][spec.dtype] = offset + spec.numel
    resident_offset: dict[tuple[int, str], int] = {}
    slot_numel: dict[torch.dtype, int] = {}
    chunks = []
    for spans, in_gpu in packed:
        whole: list[int] = []
        slices: list[SliceLayout] = []
        pieces = []  # (param, spec, start, stop, sliced)
        invariant_bytes = 0
        for span in spans:
            param_specs = [(i, params[i]) for i in units[span.unit]]
            i, spec = param_specs[0]
            size = sizes[span.unit]
            if size.splittable and (span.start, span.stop) != (0, spec.invariant_numel):
                invariant_bytes += (span.stop - span.start) * (size.bytes // size.numel)
                start, stop = _local_range(span, spec)
                slices.append(SliceLayout(i, start, stop))
                pieces += [(i, s, start, stop, True) for s in spec.state]
            else:
                invariant_bytes += size.bytes
                whole += [i for i, _ in param_specs]
                pieces += [(i, s, 0, s.numel, False) for i, p in param_specs for s in p.state]
        numel = homes[in_gpu]
        offsets = resident_offset if in_gpu else home_offset
        for i, spec, *_ in pieces:
            if (i, spec.key) not in offsets:
                offset = _aligned(numel.get(spec.dtype, 0), spec.dtype)
                offsets[i, spec.key] = offset
                numel[spec.dtype] = offset + spec.numel
        views, copies, used = [], {}, {}
        ends_tensor: dict[torch.dtype, bool] = {}  # the dtype's last run ends a state tensor
        for i, spec, start, stop, sliced in pieces:
            home = offsets[i, spec.key] + start
            staging = 0
            if not in_gpu and stop > start:
                runs = copies.setdefault(spec.dtype, [])
                last = runs[-1] if runs else None
                gap = home - (last.home_start + last.numel) if last else -1
                # Merge across alignment padding only, never across another slice's state.
                padding = ends_tensor.get(spec.dtype) and start == 0
                if last is not None and padding and 0 <= gap < _aligned(1, spec.dtype):
                    staging = last.staging_start + home - last.home_start
                    merged = home + stop - start - last.home_start
                    runs[-1] = Copy(last.home_start, last.staging_start, merged)
                else:
                    staging = _aligned(used.get(spec.dtype, 0), spec.dtype)
                    runs.append(Copy(home, staging, stop - start))
                used[spec.dtype] = staging + stop - start
                ends_tensor[spec.dtype] = stop == spec.numel
            views.append(StateView(i, spec, offsets[i, spec.key], start, stop, sliced, staging))
        for dtype, n in used.items():
            slot_numel[dtype] = max(slot_numel.get(dtype, 0), n)
        chunks.append(
            ChunkLayout(
                tuple(whole),
                tuple(slices),
                tuple(views),
                {dtype: tuple(runs) for dtype, runs in copies.items()},
                in_gpu,
                invariant_bytes,
            )
        )
    return OffloadPlan(tuple(chunks), homes[False], homes[True], slot_numel)


def resident_in_both(old: OffloadPlan, new: OffloadPlan) -> frozenset[tuple[int, str]]:
    """The state (param index, state key) both plans keep GPU-resident."""
    resident = [
        {(v.param, v.spec.key) for c in plan.chunks if c.resident for v in c.views}
        for plan in (old, new)
    ]
    return frozenset(resident[0] & resident[1])
