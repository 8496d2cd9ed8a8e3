"""Pure planning for the chunked offloaded step: which units go in which chunk,
and where each state tensor lives in the host slabs and the staging slots.

Built once from shapes, executed every step. Nothing here touches a device.

Example, two ranks, three units of one fp32 state tensor each, 4 KiB chunks:
unit sizes are counted as global numel / shards, so a 255-row matrix sharded
128 + 127 counts 255 * cols / 2 elements on both ranks and both cut the same
chunks, even though their local shards differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

# Offsets inside slabs and staging slots are rounded up to this many bytes so
# every view starts on a boundary the vectorized copy and update kernels like.
ALIGN_BYTES = 256
# Chunks at each end of a step ramp their size up by halves over this many steps.
RAMP_STEPS = 3


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

    @property
    def invariant_bytes(self) -> int:
        return sum(self.invariant_numel * s.dtype.itemsize for s in self.state)


@dataclass(frozen=True)
class StateView:
    """Where one state tensor lives: element offsets into its dtype's slab and slot."""

    param: int  # index into the flat param list the plan was built over
    spec: StateSpec
    host_offset: int
    staging_offset: int


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk: whole units, and per dtype one contiguous range of the host slab."""

    units: range
    params: tuple[int, ...]
    views: tuple[StateView, ...]
    host_ranges: Mapping[torch.dtype, tuple[int, int]]  # dtype -> [start, stop) elements


@dataclass(frozen=True)
class OffloadPlan:
    chunks: tuple[ChunkLayout, ...]
    host_numel: Mapping[torch.dtype, int]  # elements of each dtype's host slab
    slot_numel: Mapping[torch.dtype, int]  # elements of each dtype's staging slot

    @property
    def host_bytes(self) -> int:
        return sum(n * dtype.itemsize for dtype, n in self.host_numel.items())

    def staging_bytes(self, slots: int) -> int:
        return slots * sum(n * dtype.itemsize for dtype, n in self.slot_numel.items())


def _greedy(unit_bytes: Sequence[int], cap: Callable[[int], int]) -> list[int]:
    """Chunk lengths (in units), in order; chunk k takes units while under cap(k)."""
    lengths: list[int] = []
    count, filled = 0, 0
    for size in unit_bytes:
        if count and filled + size > cap(len(lengths)):
            lengths.append(count)
            count, filled = 0, 0
        count += 1
        filled += size
    if count:
        lengths.append(count)
    return lengths


def pack_units(unit_bytes: Sequence[int], chunk_bytes: int) -> tuple[range, ...]:
    """Cut units, in order, into chunks of at most `chunk_bytes` (a larger unit is alone).

    The first and last RAMP_STEPS chunks at each end hold 1/2, 1/4, ... of the
    cap: nothing overlaps the first load or the last write-back, so small end
    chunks shorten the pipeline's fill and drain. Chunks never split a unit.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes should be > 0 but is: {chunk_bytes}")

    def cap(k: int) -> int:
        return chunk_bytes >> max(0, RAMP_STEPS - k)

    total, half = sum(unit_bytes), 0
    if total <= chunk_bytes:
        return (range(len(unit_bytes)),) if unit_bytes else ()
    middle = len(unit_bytes)  # units [0, middle) pack forward, the rest backward
    for index, size in enumerate(unit_bytes):
        if 2 * half >= total:
            middle = index
            break
        half += size
    head = _greedy(unit_bytes[:middle], cap)
    tail = _greedy(unit_bytes[middle:][::-1], cap)[::-1]
    chunks, start = [], 0
    for length in head + tail:
        chunks.append(range(start, start + length))
        start += length
    return tuple(chunks)


def _aligned(offset: int, dtype: torch.dtype) -> int:
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-offset // step) * step


def plan_offload(
    units: Sequence[Sequence[int]], params: Sequence[ParamSpec], chunk_bytes: int
) -> OffloadPlan:
    """Cut `units` (lists of param indices) into chunks and lay out their state.

    The host slab of each dtype is laid out in chunk order, so loading or
    writing back one chunk is one contiguous copy per dtype; a chunk's slot
    offsets are its host offsets shifted to start at zero.
    """
    unit_bytes = [sum(params[i].invariant_bytes for i in unit) for unit in units]
    host_numel: dict[torch.dtype, int] = {}
    slot_numel: dict[torch.dtype, int] = {}
    chunks = []
    for unit_range in pack_units(unit_bytes, chunk_bytes):
        chunk_params = tuple(i for u in unit_range for i in units[u])
        placed = []  # (param, spec, host offset)
        ranges: dict[torch.dtype, tuple[int, int]] = {}
        for i in chunk_params:
            for spec in params[i].state:
                offset = _aligned(host_numel.get(spec.dtype, 0), spec.dtype)
                host_numel[spec.dtype] = offset + spec.numel
                start = ranges.get(spec.dtype, (offset, 0))[0]
                ranges[spec.dtype] = (start, offset + spec.numel)
                placed.append((i, spec, offset))
        views = tuple(
            StateView(i, spec, offset, offset - ranges[spec.dtype][0]) for i, spec, offset in placed
        )
        for dtype, (start, stop) in ranges.items():
            slot_numel[dtype] = max(slot_numel.get(dtype, 0), stop - start)
        chunks.append(ChunkLayout(unit_range, chunk_params, views, ranges))
    return OffloadPlan(tuple(chunks), host_numel, slot_numel)
