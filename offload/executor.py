"""StepExecutor: runs an offloaded step's plan (`step_plan.OffloadedStep`), moving the bytes.

It owns what the plan lays out: the host slabs (pinned), the GPU-resident slabs, the
staging ring and the backward's extra slots, and each chunk's views into them. Each
step it enqueues the schedule's copies and updates as a three-stage pipeline:

    H2D stream      load c+2       load c+3       ...
    compute stream  step c+1       step c+2       ...
    D2H stream      write back c   write back c+1 ...

ordered by events only (`streams.CopyStreams`), so the copies each way and the update
math overlap and the host never waits. Chunks whose state is GPU-resident step in place,
with no copies. What to plan, when to step and what the user sees are
`cpu_offload.CPUOffloadOptimizer`'s.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from offload.chunk_plan import OffloadPlan
from offload.host_memory import allocate_host_slabs
from offload.residency import StepTimer
from offload.step_plan import OffloadedStep
from offload.step_schedule import StepSchedule, backward_load_share, ramped_runs, update_runs
from offload.streams import CopyStreams
from offload.subset_step import ParamSlice, SubsetStep, local_tensor, version


def as_state(
    param: Tensor, local: Tensor, specs: dict[tuple[Tensor, torch.dtype], Any] | None = None
) -> Tensor:
    """`local` shaped as the optimizer keeps it: a DTensor like `param`, or itself.

    `specs` caches the DTensor spec per param and dtype across the calls of one build:
    a plan carves hundreds of state views on the host while the device still runs the
    backward, and building the spec took most of each call. A spec is shared by the
    DTensors of one param and dtype: torch's ops never edit a spec's fields (an in-place
    op that changes placements assigns a new spec; checked on torch 2.13).

    The DTensor wraps `local` where it lies: `DTensor.from_local` would copy a
    host view to the mesh's device, leaving a stale GPU copy in the state.

    Its wrapper is built with storage offset 0, as `DTensor.from_local` of an
    unsliced tensor gives. torch 2.13's `DTensor.__new__` copies the local
    tensor's offset onto the storage-less wrapper, so a slab view's DTensor has
    a nonzero `data_ptr()`, and DCP's async stager then copies the wrapper's
    null storage ("copy_() on an invalid python storage"). Private API (the
    wrapper `DTensor.__new__` builds), checked on torch 2.13; the GPU tests run
    it on 2.11.
    """
    if not hasattr(param, "placements") or local.shape != local_tensor(param).shape:
        return local
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = specs.get((param, local.dtype)) if specs is not None else None
    if spec is None:
        meta = TensorMeta(param.shape, param.stride(), local.dtype)
        spec = DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta)
        if specs is not None:
            specs[param, local.dtype] = spec
    meta = spec.tensor_meta
    state = torch.Tensor._make_wrapper_subclass(
        DTensor,
        meta.shape,
        strides=meta.stride,
        storage_offset=0,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=False,
    )
    state._spec, state._local_tensor = spec, local
    return state


def _carve(flat: Tensor, shape: torch.Size, param: Tensor) -> Tensor:
    """`flat` (contiguous, `shape`'s numel) as a state tensor of `shape` for `param`.

    State shaped like the param's local shard takes the param's memory layout, as torch
    optimizers create it (`zeros_like(p, memory_format=torch.preserve_format)`): fused
    kernels pair a param's elements with its state's by memory, not by index, so a
    contiguous state for a transposed or channels_last param would be updated wrongly.
    """
    local = local_tensor(param)
    if shape != local.shape:
        return flat.view(shape)
    return flat.as_strided(shape, torch.empty_like(local, device="meta").stride())


def _flat(carved: Tensor) -> Tensor:
    """A tensor `_carve` made, as the flat range it was carved from (its elements in
    memory order)."""
    return carved.as_strided((carved.numel(),), (1,))


@contextlib.contextmanager
def attributes_set(obj: object, values: Mapping[str, Any]) -> Iterator[None]:
    """`values` set as attributes of `obj` inside the block; after it, removed (or what
    `obj` held before restored)."""
    held = {name: vars(obj)[name] for name in values if name in vars(obj)}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in values:
            if name in held:
                setattr(obj, name, held[name])
            else:
                delattr(obj, name)


@dataclass
class Home:
    """Where one state tensor lives between steps: a host slab view, or a GPU-resident one."""

    home: Tensor  # local shape
    home_state: Tensor  # as the optimizer keeps it (a DTensor like the param, or `home`)


@dataclass
class _View:
    """The part of one state tensor a chunk steps, built once. Views of the staging ring
    are left out of its repr: between steps the ring holds no memory, and printing them
    read freed memory (a debugger's or a test report's repr crashed the process)."""

    param: Tensor
    key: str
    home: Home
    # a view of the staging ring (of the home, in a resident chunk)
    staging: Tensor = field(repr=False)
    # as the step reads it (a flat tensor for a slice)
    staging_state: Tensor = field(repr=False)


@dataclass
class _Chunk:
    """A chunk's runtime handles, built once from its `ChunkLayout`."""

    params: list[Tensor]  # updated whole
    slices: list[ParamSlice]  # updated in slices
    slot: int  # staging slot; -1 when resident
    invariant_bytes: int  # rank-invariant state bytes ("auto" times its loads by them)
    # (home slab range, staging slot range); not in the repr, as `_View`'s staging
    copies: list[tuple[Tensor, Tensor]] = field(repr=False)
    views: list[_View]

    @property
    def touched(self) -> list[Tensor]:
        return self.params + [s.param for s in self.slices]


class _StagingRing:
    """The staging slots, one buffer per dtype, holding memory only during a step.

    The views into it are built once; between steps the buffers' storage is
    resized to zero, so the caching allocator can hand the memory to the forward
    and backward (FSDP2 frees its unsharded params the same way).
    """

    def __init__(self, numel: dict[torch.dtype, int], device: torch.device) -> None:
        self.buffers = {d: torch.empty(n, dtype=d, device=device) for d, n in numel.items()}
        self._nbytes = {d: t.untyped_storage().nbytes() for d, t in self.buffers.items()}

    def acquire(self) -> None:
        """Allocate on the current stream (streams that use it must wait on it after)."""
        for dtype, buffer in self.buffers.items():
            storage = buffer.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self._nbytes[dtype])

    def release(self, users: Sequence[torch.Stream | None]) -> None:
        """Give the memory back once the work queued on `users` is done with it."""
        for buffer in self.buffers.values():
            if buffer.untyped_storage().nbytes() == 0:  # given back already
                continue
            for stream in users:
                if stream is not None:
                    buffer.record_stream(stream)
            buffer.untyped_storage().resize_(0)


COPY_PIECE_BYTES = 32 << 20
"""Largest single copy between a host slab and the ring, in bytes. A copy the trainer
enqueues (FSDP2's in each post-backward; `.item()` reads one back) queues in the copy
engine behind ours, in the order they were enqueued, pieces or not, so what bounds its
wait is how much is enqueued ahead of it (`load_ahead` spreads the backward's loads).
Chosen with `bench/train_step.py --trace` and `bench/trace_summary.py`, which show the
trainer's copies waiting behind whole chunks."""


def _copy_pieces(home: Tensor, staging: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(home, staging) cut into aligned pieces of at most `COPY_PIECE_BYTES`."""
    step = max(1, COPY_PIECE_BYTES // home.element_size())
    return [(home[i : i + step], staging[i : i + step]) for i in range(0, home.numel(), step)]


def joined_slices(slices: Sequence[ParamSlice]) -> list[ParamSlice]:
    """`slices` with each param's adjacent ones joined (a slice ending where another of its
    param starts), in the order each param first appears.

    >>> a, b = torch.zeros(4), torch.zeros(6)
    >>> [(s.param is a, s.start, s.stop) for s in joined_slices(
    ...     [ParamSlice(a, 2, 4), ParamSlice(b, 0, 3), ParamSlice(b, 3, 6), ParamSlice(a, 0, 1)]
    ... )]
    [(True, 0, 1), (True, 2, 4), (False, 0, 6)]
    """
    by_param: dict[Tensor, list[ParamSlice]] = {}
    for piece in slices:
        by_param.setdefault(piece.param, []).append(piece)
    joined: list[ParamSlice] = []
    for param, pieces in by_param.items():
        pieces = sorted(pieces, key=lambda s: s.start)
        start, stop = pieces[0].start, pieces[0].stop
        for piece in pieces[1:]:
            if piece.start == stop:
                stop = piece.stop
            else:
                joined.append(ParamSlice(param, start, stop))
                start, stop = piece.start, piece.stop
        joined.append(ParamSlice(param, start, stop))
    return joined


def _state_versions(chunk: _Chunk) -> list[int]:
    """The version counters of `chunk`'s state at home. An in-place torch op on a home bumps
    its slab's (shared by the slab's views); one on a DTensor state only the wrapper's (its
    local op runs below the counting)."""
    return [version(t) for view in chunk.views for t in (view.home.home, view.home.home_state)]


class _OnDevice:
    """Ranges of the host slabs whose values are on the device too, per dtype (state the
    backward loaded, and resident state a re-plan moves home), and the memory holding them
    until a re-plan has copied from it device to device what it would load from the host
    (`StepExecutor.build`). Ranges do not overlap: each is one chunk's or one tensor's."""

    def __init__(self) -> None:
        self._ranges: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
        self._starts: dict[torch.dtype, list[int]] = {}
        self.held: list[_StagingRing] = []  # the old backward's slots, given back after

    def add(self, dtype: torch.dtype, start: int, device: Tensor) -> None:
        """Host slab elements [start, start + numel) of `dtype` are `device` (flat)."""
        if device.numel():  # an empty one would start a scan that finds nothing
            self._ranges.setdefault(dtype, []).append((start, device))
            self._starts.pop(dtype, None)

    def pieces(self, dtype: torch.dtype, start: int, numel: int) -> list[tuple[int, Tensor]] | None:
        """Device pieces covering host elements [start, start + numel), each with its offset
        in that range; None where some of it is not on the device."""
        found, gaps = self.cover(dtype, start, numel)
        return None if gaps else found

    def cover(
        self, dtype: torch.dtype, start: int, numel: int
    ) -> tuple[list[tuple[int, Tensor]], list[tuple[int, int]]]:
        """Of host elements [start, start + numel): the device pieces holding some of them,
        each with its offset in that range, and the (offset, length) runs none holds."""
        ranges = self._ranges.get(dtype, [])
        if dtype not in self._starts:
            ranges.sort(key=lambda r: r[0])
            self._starts[dtype] = [begin for begin, _ in ranges]
        first = max(0, bisect.bisect_right(self._starts[dtype], start) - 1)
        at, stop, found, gaps = start, start + numel, [], []
        for begin, device in ranges[first:]:
            if begin >= stop:
                break
            end = begin + device.numel()
            if end <= at:
                continue
            if begin > at:
                gaps.append((at - start, begin - at))
                at = begin
            found.append((at - start, device[at - begin : min(end, stop) - begin]))
            at = min(end, stop)
        if at < stop:
            gaps.append((at - start, stop - at))
        return found, gaps


def _copy_from(into: Tensor, pieces: Sequence[tuple[int, Tensor]]) -> None:
    """Copy `_OnDevice.pieces` into `into` (flat), each at its offset."""
    for offset, piece in pieces:
        into[offset : offset + piece.numel()].copy_(piece)


class StepExecutor:
    """Holds an offloaded step's memory and enqueues its copies and updates.

    `optimizer` is the wrapped optimizer (its `state` entries point at the homes between
    steps, at the staging slots while a chunk updates); `params` its params in group
    order, as the plan indexes them.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[Tensor],
        streams: CopyStreams,
        staging_slots: int,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.streams = streams
        self.staging_slots = staging_slots
        self.device = streams.device
        self.plan: OffloadPlan | None = None
        self.schedule: StepSchedule | None = None
        self.chunks: list[_Chunk] = []
        self.homes: dict[tuple[Tensor, str], Home] = {}
        self.host_slabs: dict[torch.dtype, Tensor] = {}
        self.resident_slabs: dict[torch.dtype, Tensor] = {}
        self.left_slabs: list[Tensor] = []  # old resident slabs holding state a re-plan left
        self.ring: _StagingRing | None = None
        self.extra_slots: list[_StagingRing] = []  # the backward's, slots staging_slots + i
        self.step_done: torch.Event | None = None
        self.loaded_ahead: dict[int, bool] = {}  # staged chunk index -> state copied in
        self.loaded_ahead_done: torch.Event | None = None
        self.loaded_ahead_versions: list[int] = []  # of their state, once the backward loaded
        self.on_device: _OnDevice | None = None  # a re-plan's device copies of host state
        self.chunks_loaded_in_backward = 0
        self.slice_counts: collections.Counter[Tensor] = collections.Counter()  # per param

    # -- memory -------------------------------------------------------------------------

    # Normal tensors whatever mode `step()` runs in: the backward, outside it, loads them.
    @torch.inference_mode(False)
    def build(self, step: OffloadedStep, ring: bool = True, keep_host_slabs: bool = False) -> None:
        """Allocate slabs and the ring, carve views, and move any existing state home.

        The serial path stages all state per step instead of through the ring, so
        without `ring` the staging buffers live on the meta device and take no memory.
        With `keep_host_slabs`, host slabs of the plan's sizes are kept (every plan of
        one host layout homes each state tensor in the same place). State
        `give_back_gpu_state` left on the device is copied device to device into its home
        first (`_move_left_state`).
        """
        plan, schedule = step.plan, step.schedule
        kept = {dtype: slab.numel() for dtype, slab in self.host_slabs.items()}
        kept_host_slabs = keep_host_slabs and kept == dict(plan.host_numel)
        if not kept_host_slabs:
            self.drop_on_device()  # its ranges are of the old slabs
            self.host_slabs = allocate_host_slabs(plan.host_numel, self.device)
        self.resident_slabs = {
            dtype: torch.zeros(n, dtype=dtype, device=self.device)
            for dtype, n in plan.resident_numel.items()
        }
        specs: dict[tuple[Tensor, torch.dtype], Any] = {}  # `as_state`'s
        # State left on the device goes home first: its old slabs free before the staging.
        homes = self._move_left_state(plan, specs) if self.left_slabs else {}
        ring_numel = plan.ring_slot_numel(schedule.slots, self.staging_slots)
        staging_numel = {dtype: schedule.ring_slots_taken * n for dtype, n in ring_numel.items()}
        self.streams.ensure_slots(self.staging_slots + schedule.extra_slots)
        if ring:
            self.ring = _StagingRing(staging_numel, self.device)
            # An extra slot holds one chunk: sized for it, not for the largest.
            self.extra_slots = [
                _StagingRing(chunk.staging_numel, self.device)
                for chunk, slot in zip(plan.chunks, schedule.slots, strict=True)
                if slot >= self.staging_slots
            ]
            staging_buffers = self.ring.buffers
        else:
            staging_buffers = {
                dtype: torch.empty(n, dtype=dtype, device="meta")
                for dtype, n in staging_numel.items()
            }

        def slot_buffer(dtype: torch.dtype, slot: int) -> Tensor:
            """A slot's staging memory for `dtype` (a slice of the ring, or an extra slot)."""
            if slot >= self.staging_slots:
                return self.extra_slots[slot - self.staging_slots].buffers[dtype]
            return staging_buffers[dtype][slot * ring_numel[dtype] :][: ring_numel[dtype]]

        chunks = []
        for layout, slot in zip(plan.chunks, schedule.slots, strict=True):
            slabs = self.resident_slabs if layout.resident else self.host_slabs
            copies = [
                piece
                for dtype, runs in layout.copies.items()
                for run in runs
                for piece in _copy_pieces(
                    slabs[dtype][run.home_start :][: run.numel],
                    slot_buffer(dtype, slot)[run.staging_start :][: run.numel],
                )
            ]
            views = []
            for view in layout.views:
                spec, param = view.spec, self.params[view.param]
                home = homes.get((param, spec.key))
                if home is None:
                    h = _carve(
                        slabs[spec.dtype][view.home_offset :][: spec.numel], spec.shape, param
                    )
                    home = homes[param, spec.key] = Home(h, as_state(param, h, specs))
                if layout.resident:
                    staging = home.home if not view.sliced else home.home.view(-1)
                    staging = staging[view.start : view.stop] if view.sliced else staging
                elif view.stop == view.start:  # nothing of it on this rank: no slot space
                    staging = torch.empty(view.shape, dtype=spec.dtype, device=self.device)
                else:
                    staging = slot_buffer(spec.dtype, slot)[view.staging_offset :]
                    staging = _carve(staging[: view.stop - view.start], view.shape, param)
                if view.sliced:
                    staging_state = staging
                elif staging is home.home:
                    staging_state = home.home_state
                else:
                    staging_state = as_state(param, staging, specs)
                views.append(_View(param, spec.key, home, staging, staging_state))
            # a chunk holds one slice of a param at most
            slice_state: dict[Tensor, dict[str, Tensor]] = {}
            for view, built in zip(layout.views, views, strict=True):
                if view.sliced:
                    slice_state.setdefault(built.param, {})[built.key] = built.staging_state
            slices = []
            for s in layout.slices:
                param = self.params[s.param]
                slices.append(ParamSlice(param, s.start, s.stop, slice_state.get(param, {})))
            chunks.append(
                _Chunk(
                    [self.params[i] for i in layout.params],
                    slices,
                    slot,
                    layout.invariant_bytes,
                    copies,
                    views,
                )
            )
        self.plan, self.schedule, self.chunks, self.homes = plan, schedule, chunks, homes
        self.slice_counts = collections.Counter(s.param for c in chunks for s in c.slices)
        if ring and not plan.slot_numel:
            self.ring, self.extra_slots = None, []  # no state staged: no staging memory
        streams = self.streams
        if self.step_done is not None:
            if not kept_host_slabs:  # the old homes are read on the host: what moves into
                self.wait()  # them lands first
            streams.wait(streams.current(), self.step_done)
        state = self.optimizer.state
        for (param, key), home in homes.items():
            entries = state.get(param)
            if entries and key in entries:
                current = local_tensor(entries[key])
                if current.data_ptr() != home.home.data_ptr() or current.device != home.home.device:
                    # From a kept host slab to a resident home (a re-plan), on the
                    # trainer's stream: the host does not wait (the homes' readers wait for
                    # `step_done`). Not from old host slabs, freed once this returns, nor
                    # from a device tensor, which could be freed before its copy ran.
                    non_blocking = kept_host_slabs and current.device.type == "cpu"
                    gaps = self._copy_on_device(_flat(home.home), current)
                    if gaps is None:
                        home.home.copy_(current, non_blocking=non_blocking)
                    for offset, length in gaps or ():  # what the device did not hold
                        run = slice(offset, offset + length)
                        _flat(home.home)[run].copy_(_flat(current)[run], non_blocking=non_blocking)
                entries[key] = home.home_state
        self.step_done = streams.mark(streams.current())
        self.release_staging()  # acquired again at the start of each step
        if ring and self.on_device is not None:
            self._load_on_device()
        self.drop_on_device()

    def _copy_on_device(self, into: Tensor, home: Tensor) -> list[tuple[int, int]] | None:
        """Copy into `into` (flat) what `on_device` holds of the state at `home`, a host
        home, on the trainer's stream; the (offset, length) runs of `into` left to copy
        from the host, or None where none of it is on the device (or it is not in the host
        slabs)."""
        on_device = self.on_device
        slab = self.host_slabs.get(home.dtype)
        if on_device is None or slab is None:
            return None
        if home.untyped_storage().data_ptr() != slab.untyped_storage().data_ptr():
            return None  # not in the host slabs (a tensor given by hand)
        pieces, gaps = on_device.cover(home.dtype, self._host_offset(home), home.numel())
        if not pieces:
            return None
        _copy_from(into, pieces)
        return gaps

    def _load_on_device(self) -> None:
        """After a re-plan: the schedule's first chunks loaded in the backward whose state
        `on_device` holds (the last plan's backward loaded it, or held it resident) are
        copied into their slots device to device, on the trainer's stream, and count as
        loaded in the backward: the first step of the plan does not load them from the
        host again (all of them through the next forward's copies otherwise)."""
        if not self.extra_slots:  # nothing staged here (a 0-d param's state, empty shards)
            return
        streams, state = self.streams, self.optimizer.state
        staged = self.schedule.loaded_in_backward
        on_device = self.on_device
        for index, c in enumerate(staged):
            chunk = self.chunks[c]
            if not any(state.get(p) for p in chunk.touched):
                break
            sources = [
                on_device.pieces(home.dtype, self._host_offset(home), home.numel())
                for home, _ in chunk.copies
            ]
            if any(pieces is None for pieces in sources):
                break  # loaded ahead: a leading run of the chunks (`load_ahead`)
            self.extra_slots[chunk.slot - self.staging_slots].acquire()
            for (_, staging), pieces in zip(chunk.copies, sources, strict=True):
                _copy_from(staging, pieces)
            streams.record(streams.loaded[chunk.slot], streams.current())
            self.loaded_ahead[index] = True
        if self.loaded_ahead:
            self.loaded_ahead_versions = [
                v for i in self.loaded_ahead for v in _state_versions(self.chunks[staged[i]])
            ]
            self.loaded_ahead_done = streams.mark(streams.current())

    def _move_left_state(
        self, plan: OffloadPlan, specs: dict[tuple[Tensor, torch.dtype], Any]
    ) -> dict[tuple[Tensor, str], Home]:
        """State `give_back_gpu_state` left in the old resident slabs into its resident
        home in `plan` (returned, for `build` to carve no other), device to device on the
        trainer's stream, which `give_back_gpu_state` made wait for the last step; the old
        slabs are freed once the copies are queued (recorded on that stream)."""
        state = self.optimizer.state
        left = {slab.untyped_storage().data_ptr() for slab in self.left_slabs}
        homes: dict[tuple[Tensor, str], Home] = {}
        for layout in plan.chunks:
            for view in layout.views if layout.resident else ():
                param, spec = self.params[view.param], view.spec
                entries = state.get(param)
                if (param, spec.key) in homes or not entries or spec.key not in entries:
                    continue  # a sliced tensor has a view per chunk
                current = local_tensor(entries[spec.key])
                if current.untyped_storage().data_ptr() not in left:
                    continue
                slab = self.resident_slabs[spec.dtype][view.home_offset :][: spec.numel]
                h = _carve(slab, spec.shape, param)
                home = homes[param, spec.key] = Home(h, as_state(param, h, specs))
                home.home.copy_(current)
                entries[spec.key] = home.home_state
        self.left_slabs = []
        return homes

    def give_back_gpu_state(
        self,
        everything_home: OffloadPlan,
        stays: Collection[tuple[Tensor, str]] = (),
        keep_on_device: bool = False,
    ) -> None:
        """Before a re-plan within one host layout: state in the resident slabs to its room
        in the host slabs (where `everything_home`, the plan of that layout with nothing
        resident, homes it), and the ring and the backward's slots dropped, so the new
        plan's GPU memory is not allocated beside the old's (the budget holds one plan, not
        two). State in `stays` (param, key), resident in the next plan too, stays where it
        is until `build` copies it device to device into its new home (its old slab,
        `left_slabs` until then, is freed then). Other state (a tensor the user put in
        the state, not yet homed) is the next plan's to home.

        The host does not wait: the state moves on the trainer's stream after the last
        step's write-backs, `step_done` marks it, and the slots go back once the copy
        streams are past them. With `keep_on_device`, the backward's loads and the
        resident state moving home stay on the device (`on_device`) until `build` has
        copied from them what the next plan would load from the host; else they are
        dropped."""
        state, streams = self.optimizer.state, self.streams
        current = streams.current()
        self.drop_on_device()
        if self.step_done is not None:
            streams.wait(current, self.step_done)
        on_device = _OnDevice() if keep_on_device else None
        if on_device is not None and self.loaded_ahead:
            staged = self.schedule.loaded_in_backward
            for index, copied in self.loaded_ahead.items():
                for home, staging in self.chunks[staged[index]].copies if copied else ():
                    on_device.add(home.dtype, self._host_offset(home), staging)
            if self.loaded_ahead_done is not None:
                streams.wait(current, self.loaded_ahead_done)
        slabs = [*self.resident_slabs.values(), *self.left_slabs]
        resident = {slab.untyped_storage().data_ptr() for slab in slabs}
        seen = set(stays)  # a sliced tensor has a view per chunk
        specs: dict[tuple[Tensor, torch.dtype], Any] = {}  # `as_state`'s
        for layout in everything_home.chunks:
            for view in layout.views:
                param, spec = self.params[view.param], view.spec
                entries = state.get(param)
                if (param, spec.key) in seen or not entries or spec.key not in entries:
                    continue
                seen.add((param, spec.key))
                current_state = local_tensor(entries[spec.key])
                if current_state.untyped_storage().data_ptr() not in resident:
                    continue
                slab = self.host_slabs[spec.dtype][view.home_offset :][: spec.numel]
                host = _carve(slab, spec.shape, param)
                host.copy_(current_state, non_blocking=True)
                entries[spec.key] = as_state(param, host, specs)
                if on_device is not None:
                    on_device.add(spec.dtype, view.home_offset, _flat(current_state))
        self.step_done = streams.mark(current)
        if current is not None:
            for slab in slabs:  # freed once the copies are done
                slab.record_stream(current)
        left = {
            local_tensor(state[p][k]).untyped_storage().data_ptr()
            for p, k in stays
            if k in state.get(p, {})
        }
        self.left_slabs = [slab for slab in slabs if slab.untyped_storage().data_ptr() in left]
        self.loaded_ahead, self.loaded_ahead_done = {}, None
        if on_device is not None:
            on_device.held, self.on_device = self.extra_slots, on_device
        for slots in (self.ring, *(self.extra_slots if on_device is None else ())):
            if slots is not None:
                slots.release([streams.h2d, streams.d2h])
        self.chunks, self.homes, self.resident_slabs = [], {}, {}
        self.ring, self.extra_slots = None, []

    def drop_on_device(self) -> None:
        """Give back what `give_back_gpu_state` kept on the device (once the streams that
        read it are past it)."""
        if self.on_device is None:
            return
        streams = self.streams
        for slots in self.on_device.held:
            slots.release([streams.h2d, streams.d2h, streams.current()])
        self.on_device = None

    def _host_offset(self, home: Tensor) -> int:
        """Where `home`, a view of a host slab, starts in it (elements)."""
        return home.storage_offset() - self.host_slabs[home.dtype].storage_offset()

    def forget(self) -> None:
        """Drop the plan and its GPU memory (after a failed re-plan, with the state in its
        host homes; the next step plans anew)."""
        self.drop_on_device()
        self.plan, self.resident_slabs = None, {}
        self.ring, self.extra_slots = None, []

    def acquire_slots(self) -> None:
        """Allocate the ring and the backward's extra slots (those not held yet)."""
        self.ring.acquire()
        for slot in self.extra_slots:
            slot.acquire()

    def release_staging(self) -> None:
        """Give the ring and the extra slots back now (nothing in flight reads them)."""
        for slots in (self.ring, *self.extra_slots):
            if slots is not None:
                slots.release([])

    def wait(self) -> None:
        """Block the host until the last step's write-backs are done."""
        if self.step_done is not None:
            self.step_done.synchronize()

    # -- the chunked step ---------------------------------------------------------------

    def enqueue(
        self,
        subset: SubsetStep,
        compute: torch.Stream | None,
        scaling: Mapping[str, Any],
        timer: StepTimer | None,
        chunk_done: Sequence[torch.Event | None] | None,
    ) -> Iterator[None]:
        """Enqueue the step as its schedule says (`step_schedule`) on `compute`, yielding
        after each chunk's operations (lazily, when overlapped); each update sees
        `scaling` (GradScaler's) set on the wrapped optimizer. With a `timer`, the loads
        and updates are timed; `chunk_done[c]` is recorded once chunk c is updated."""
        streams, schedule = self.streams, self.schedule
        state = self.optimizer.state
        had_state = {p for p in self.params if state.get(p)}
        # Per state tensor, not per param: a param may lack some of what its plan homes (a
        # Muon group switched to AdamW keeps a momentum buffer and has no moments yet),
        # which the step creates as for a param without state, and is adopted.
        had = {(p, key) for p, key in self.homes if key in state.get(p, ())}
        position = {c: k for k, c in enumerate(schedule.staged)}
        loaded: dict[int, bool] = {}  # chunk -> its state was copied in
        loaded_ahead, self.loaded_ahead = self.loaded_ahead, {}
        self.loaded_ahead_done = None
        self.chunks_loaded_in_backward = len(loaded_ahead)

        def step_chunks(cs: Sequence[int]) -> None:
            self._step_chunks(subset, cs, compute, loaded, had, scaling, timer, chunk_done)

        def run(op: str, c: int) -> None:
            chunk = self.chunks[c]
            if op == "load":
                done = loaded_ahead.get(position[c])
                loaded[c] = self._load(chunk, had_state, timer) if done is None else done
            elif op == "write_back":
                self._write_back(chunk, compute)
            else:
                step_chunks([c])

        # The chunks ready at the start (resident, or loaded in the backward; loaded here
        # if it did not, e.g. on the first step) update first, a few calls for all of them
        # (with overlap, short ones first: the forward waits for its first chunks' calls).
        for c in schedule.ready:
            if self.chunks[c].slot >= 0:
                run("load", c)
        runs = self._update_groups(subset, schedule.ready, had_state, had)
        for cs in ramped_runs(runs) if chunk_done is not None else runs:
            step_chunks(cs)
        for op in schedule.prologue:
            run(*op)
        for ops in schedule.per_chunk:
            for op in ops:
                run(*op)
            yield
        for op in schedule.epilogue:
            run(*op)
        # Done: every update and write-back. The ring goes back to the allocator once
        # the streams that used it are past it.
        streams.wait(streams.d2h, streams.mark(compute))
        self.step_done = streams.mark(streams.d2h)
        if self.ring is not None:
            self.ring.release([streams.h2d, streams.d2h, compute])

    def _update_groups(
        self,
        subset: SubsetStep,
        cs: Sequence[int],
        had_state: set[Tensor],
        had: set[tuple[Tensor, str]],
    ) -> list[list[int]]:
        """Chunks `cs` (in order) cut into runs that may each update in one call
        (`update_runs`)."""
        chunks = [self.chunks[c] for c in cs]
        creates = [
            not all(p in had_state for p in chunk.touched)
            or any((v.param, v.key) not in had for v in chunk.views)
            for chunk in chunks
        ]
        runs = update_runs(
            [chunk.touched for chunk in chunks],
            creates,
            [chunk.invariant_bytes for chunk in chunks],
            [chunk.slot < 0 for chunk in chunks],
            getattr(subset, "reads_slice_state", False),
        )
        return [[cs[i] for i in run] for run in runs]

    def _step_chunks(
        self,
        subset: SubsetStep,
        cs: Sequence[int],
        compute: torch.Stream | None,
        loaded: Mapping[int, bool],
        had: set[tuple[Tensor, str]],
        scaling: Mapping[str, Any],
        timer: StepTimer | None,
        chunk_done: Sequence[torch.Event | None] | None,
    ) -> None:
        """Enqueue chunks `cs`'s update on `compute` in one call of the subset step (it
        updates each unit on its own: the same bits as one call a chunk), from their
        staging slots (or resident homes), with GradScaler's `scaling` set on the wrapped
        optimizer for the call, as `GradScaler.step` sets it for an unwrapped one's."""
        streams, state = self.streams, self.optimizer.state
        chunks = [self.chunks[c] for c in cs]
        for chunk, c in zip(chunks, cs, strict=True):
            if chunk.slot >= 0:
                # A loaded slot was freed before its load; an unloaded one (state not
                # created yet) must still wait for its last write-back before the step
                # creates state into it.
                ready = streams.loaded if loaded.get(c, False) else streams.freed
                streams.wait(compute, ready[chunk.slot])
        # Resident chunks' slices of a param are views of its one home: stepped as one
        # (several chunks in a call create no state, `update_runs`: a slice of a param
        # covered whole steps as the param, and would create its state whole-shaped).
        resident = [chunk for chunk in chunks if chunk.slot < 0]
        joined = len(resident) > 1
        params, slices, entries = self._joined(resident) if joined else ([], [], {})
        for chunk in chunks:
            if not (joined and chunk.slot < 0):
                params += chunk.params
                slices += chunk.slices
                # a slice's state is swapped in too, for a subset step that reads it there
                # (where a run holds several slices of a param, it reads `ParamSlice.state`)
                entries.update({(v.param, v.key): v.staging_state for v in chunk.views})
        for (param, key), entry in entries.items():
            if (param, key) in had:
                state[param][key] = entry
        with streams.on(compute), attributes_set(self.optimizer, scaling):
            if slices:
                subset.step_slices(params, slices)
            else:
                subset.step_params(params)
            for chunk in chunks:
                self._adopt_new_state(chunk, had)
        for chunk, c in zip(chunks, cs, strict=True):
            if chunk_done is not None:
                streams.record(chunk_done[c], compute)
            if timer is not None:
                timer.chunk_done(compute)
            if chunk.slot >= 0:
                streams.record(streams.stepped[chunk.slot], compute)
            for view in chunk.views:
                if view.key in state.get(view.param, ()):
                    state[view.param][view.key] = view.home.home_state

    def _joined(
        self, chunks: Sequence[_Chunk]
    ) -> tuple[list[Tensor], list[ParamSlice], dict[tuple[Tensor, str], Tensor]]:
        """Resident `chunks`' update as one: their params, each param's adjacent slices
        joined (`joined_slices`; a param whose every slice they hold steps whole), and the
        state entries the update reads (views of the homes)."""
        params = [p for chunk in chunks for p in chunk.params]
        views = [v for chunk in chunks for v in chunk.views]
        keys: dict[Tensor, list[str]] = {}
        for view in views:
            keys.setdefault(view.param, []).append(view.key)
        slices: list[ParamSlice] = []
        entries: dict[tuple[Tensor, str], Tensor] = {}
        pieces = [s for chunk in chunks for s in chunk.slices]
        held = collections.Counter(s.param for s in pieces)
        for piece in joined_slices(pieces):
            param = piece.param
            # Not where they only cover its local elements: a shorter shard's trailing
            # slices are empty, and step in a later run (a chunk creating state cuts runs).
            if held[param] == self.slice_counts[param]:
                params.append(param)
                entries.update(
                    {(param, key): self.homes[param, key].home_state for key in keys[param]}
                )
            else:
                flat = {key: self.homes[param, key].home.view(-1) for key in keys[param]}
                piece_state = {key: home[piece.start : piece.stop] for key, home in flat.items()}
                slices.append(ParamSlice(param, piece.start, piece.stop, piece_state))
                entries.update({(param, key): t for key, t in piece_state.items()})
        entries.update({(v.param, v.key): v.staging_state for v in views if v.param not in held})
        return params, slices, entries

    def _load(self, chunk: _Chunk, had_state: set[Tensor], timer: StepTimer | None = None) -> bool:
        """Enqueue the H2D copy of a chunk's state, unless none of its params has state yet."""
        if not any(p in had_state for p in chunk.touched):
            return False
        streams = self.streams
        with streams.on(streams.h2d):
            # The slot's previous chunk must be written back before it is overwritten.
            streams.wait(streams.h2d, streams.freed[chunk.slot])
            before = timer.mark(streams.h2d) if timer is not None else None
            for home, staging in chunk.copies:
                staging.copy_(home, non_blocking=True)
            if timer is not None:
                timer.loaded(chunk.invariant_bytes, before, timer.mark(streams.h2d))
            streams.record(streams.loaded[chunk.slot], streams.h2d)
        return True

    def _write_back(self, chunk: _Chunk, compute: torch.Stream | None) -> None:
        """Enqueue the D2H copy of a stepped chunk's state; an extra slot goes back to the
        allocator once it is done."""
        streams = self.streams
        with streams.on(streams.d2h):
            streams.wait(streams.d2h, streams.stepped[chunk.slot])
            for home, staging in chunk.copies:
                home.copy_(staging, non_blocking=True)
            streams.record(streams.freed[chunk.slot], streams.d2h)
        if chunk.slot >= self.staging_slots and self.ring is not None:
            # the backward's: not needed again this step (none held when nothing is staged)
            self.extra_slots[chunk.slot - self.staging_slots].release(
                [streams.h2d, streams.d2h, compute]
            )

    def _adopt_new_state(self, chunk: _Chunk, had: set[tuple[Tensor, str]]) -> None:
        """State the step just created goes into the chunk's staging slot, then home."""
        state = self.optimizer.state
        for view in chunk.views:
            param, key = view.param, view.key
            if (param, key) in had or key not in state.get(param, ()):
                continue
            created = local_tensor(state[param][key])
            if created.shape != view.staging.shape or created.dtype != view.staging.dtype:
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} created state {key!r} as "
                    f"{tuple(created.shape)} {created.dtype}, but its state_layout promised "
                    f"{tuple(view.staging.shape)} {view.staging.dtype}"
                )
            view.staging.copy_(created)
            state[param][key] = view.staging_state

    def abandon(self, compute: torch.Stream | None) -> None:
        """After a chunk raised: every state entry back in its home (the chunk's point into
        the staging ring), and what reads the homes waits for what was enqueued. The ring
        keeps its memory until a step ends or the optimizer goes: the error's traceback
        holds views of it, which a debugger or a test report reads (given back, they
        pointed at freed memory)."""
        state, streams = self.optimizer.state, self.streams
        for (param, key), home in self.homes.items():
            if key in state.get(param, ()):
                state[param][key] = home.home_state
        compute = compute if compute is not None else streams.current()
        streams.wait(streams.d2h, streams.mark(compute))
        self.step_done = streams.mark(streams.d2h)

    # -- loads in the backward ----------------------------------------------------------

    def load_ahead(self, passed: int, watched: int) -> None:
        """From the backward, as it passes the `passed`-th of the `watched` owner modules:
        load the state of the schedule's chunks loaded in the backward, in step order,
        spread evenly over the modules before the last; the step then skips those loads.

        Spread, and each share started only once the device's backward gets there: copies
        the trainer makes (FSDP2 copies a small tensor to the GPU in each module's
        post-backward) queue in the copy engine behind ours, and loads enqueued all at once
        stalled the backward for as long as they took (`bench/trace_summary.py` shows it).
        Not before state exists.
        """
        if self.ring is None:
            return
        staged = [self.chunks[c] for c in self.schedule.loaded_in_backward]
        loaded = len(self.loaded_ahead)
        share = backward_load_share(len(staged), passed, watched)
        if share <= loaded:
            return
        # Only this share's params: called once per module the backward passes, a look-up
        # of every param here made the backward's host time grow with params x modules.
        state = self.optimizer.state
        had_state = {p for c in staged[loaded:share] for p in c.touched if state.get(p)}
        if not had_state and not self.loaded_ahead:  # no state yet (the first step)
            return
        streams = self.streams
        with torch.no_grad():
            # Each chunk's own slot, allocated on the backward's stream (the loads start
            # after its work so far) as its share comes; the ring waits for `step()`.
            for chunk in staged[loaded:share]:
                self.extra_slots[chunk.slot - self.staging_slots].acquire()
            streams.wait(streams.h2d, streams.mark(streams.current()))
            if not loaded:
                self.loaded_ahead_versions = []
            for index in range(loaded, share):
                self.loaded_ahead[index] = self._load(staged[index], had_state)
                self.loaded_ahead_versions += _state_versions(staged[index])
        self.loaded_ahead_done = streams.mark(streams.h2d)

    def edited_since_loaded_ahead(self) -> bool:
        """Whether state the backward loaded was edited in place since (by torch ops)."""
        staged = self.schedule.loaded_in_backward
        now = [v for i in self.loaded_ahead for v in _state_versions(self.chunks[staged[i]])]
        return now != self.loaded_ahead_versions

    def drop_loaded_ahead(self) -> None:
        """Forget chunks loaded in the backward (their homes are about to change)."""
        if self.loaded_ahead_done is not None:
            self.loaded_ahead_done.synchronize()
        self.loaded_ahead, self.loaded_ahead_done = {}, None

    # -- the serial path ----------------------------------------------------------------

    def stage_all(self) -> list[tuple[Tensor, str, Home]]:
        """Copy every state tensor with a home to the device, on the current stream, and
        point its entry there; what was staged, for `write_back_staged`."""
        if self.plan is None:
            return []
        state = self.optimizer.state
        (layout,) = self.plan.chunks
        # A dtype whose state tensors are all empty has no staging numel in the plan.
        staging = {
            dtype: torch.empty(self.plan.slot_numel.get(dtype, 0), dtype=dtype, device=self.device)
            for dtype in {view.spec.dtype for view in layout.views}
        }
        staged = []
        for view in layout.views:
            spec, param = view.spec, self.params[view.param]
            if not state.get(param):  # its state started afresh (`del opt.state[p]`)
                continue
            s = staging[spec.dtype][view.staging_offset :][: spec.numel]
            s = _carve(s, spec.shape, param)
            home = self.homes[param, spec.key]
            s.copy_(home.home, non_blocking=True)
            state[param][spec.key] = as_state(param, s)
            staged.append((param, spec.key, home))
        return staged

    def write_back_staged(self, staged: list[tuple[Tensor, str, Home]]) -> None:
        """Copy `stage_all`'s state home (on the current stream)."""
        state = self.optimizer.state
        for param, key, home in staged:
            # The step may have replaced the tensor rather than updated it (LBFGS's "d").
            h = home.home
            now = local_tensor(state[param][key])
            if now.shape != h.shape or now.dtype != h.dtype:
                index = next(i for i, p in enumerate(self.params) if p is param)
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} changed state {key!r} of param "
                    f"{index} from {tuple(h.shape)} {h.dtype} to "
                    f"{tuple(now.shape)} {now.dtype}; its state cannot live in fixed host slabs"
                )
            h.copy_(now, non_blocking=True)
            state[param][key] = home.home_state
        if self.streams.async_copies:
            self.step_done = self.streams.mark(self.streams.current())
