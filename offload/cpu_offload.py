"""CPUOffloadOptimizer: optimizer state in host memory, streamed through the GPU.

Each step cuts the optimizer's units into chunks (`chunk_plan`), and runs a
three-stage pipeline over a fixed ring of GPU staging slots:

    H2D stream      load c+2       load c+3       ...
    compute stream  step c+1       step c+2       ...
    D2H stream      write back c   write back c+1 ...

ordered by events only, so the copies each way and the update math overlap
and the host never waits inside `step()`.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from offload.chunk_plan import OffloadPlan, ParamSpec, StateSpec, plan_offload
from offload.forward_overlap import (
    ForwardHooks,
    forward_prefetched,
    fsdp_all_gather_streams,
    param_owners,
    waited_params,
)
from offload.host_memory import allocate_host_slabs, check_device_memory, check_host_memory
from offload.state_estimate import dry_run_state_bytes
from offload.streams import CopyStreams
from offload.subset_step import StateLayout, SubsetStep, local_tensor, subset_step_for

DEFAULT_CHUNK_BYTES = 256 * 2**20  # bench/offload_step.py: 1.03x the copy floor with 4 slots
OVERLAP_CHUNKS_UP_FRONT = 2  # x staging slots enqueued when an overlapped step() returns
DEFAULT_STAGING_SLOTS = 4  # 4 measured 3-7% faster than 3 at every chunk size


def _shard_count(param: Tensor) -> int:
    placements = getattr(param, "placements", ())
    mesh = getattr(param, "device_mesh", None)
    return math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_shard())


def invariant_numel(param: Tensor) -> int:
    """Global numel / number of shards: a size every rank computes the same."""
    return param.numel() // _shard_count(param) if hasattr(param, "placements") else param.numel()


def _as_state(param: Tensor, local: Tensor) -> Tensor:
    """`local` shaped as the optimizer keeps it: a DTensor like `param`, or itself.

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

    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    spec = DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta)
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


@dataclass
class _View:
    """One state tensor's two homes, raw and as the optimizer keeps them, built once."""

    param: Tensor
    spec: StateSpec
    host: Tensor
    staging: Tensor
    host_state: Tensor
    staging_state: Tensor


@dataclass
class _Chunk:
    """A chunk's runtime handles, built once from its `ChunkLayout`."""

    params: list[Tensor]
    slot: int
    host: list[tuple[Tensor, Tensor]]  # per dtype: (host slab range, staging slot range)
    views: list[_View]


OVERSIZED_UNIT_WARN_BYTES = 64 << 20
"""Warn when a unit bigger than twice `chunk_bytes` makes a staging slot bigger than this."""


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """Keep `optimizer`'s state in pinned host memory; stream it through the GPU to step.

    Args:
        optimizer: the optimizer to wrap, already holding its params. If it
            implements the subset-step protocol (`offload.subset_step`) or is a
            torch optimizer with independent per-param updates, the step is
            chunked; otherwise it takes the serial path (all state in, step,
            all state out), still exact.
        chunk_bytes: target state bytes per chunk (rank-invariant count; a unit
            larger than this is a chunk of its own).
        staging_slots: GPU staging slots in the ring (>= 2 to overlap copies).
        overlap_forward: the model whose next forward the step overlaps. `step()`
            then returns once the first chunks are queued; the rest update on a
            side stream as the forward reaches the modules that read them. Needs
            a subset step. Read params or state outside a forward only after
            `wait_for_optimizer_step()`.

    GPU memory for state: `staging_slots` chunks; on the first step, while the
    optimizer creates its state chunk by chunk, one more chunk.

    Host syncs: none inside `step()`. Reading state (`state_dict`,
    `load_state_dict`) first waits for the last write-back.
    """

    # NOTE: subclasses Optimizer only so LR schedulers and isinstance checks accept
    # it; Optimizer.__init__ is not called: groups, state and defaults are the
    # wrapped optimizer's own objects, so a scheduler's lr changes reach it.

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        overlap_forward: nn.Module | None = None,
    ) -> None:
        if isinstance(optimizer, CPUOffloadOptimizer):
            raise TypeError("optimizer is already a CPUOffloadOptimizer")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes should be > 0 but is: {chunk_bytes}")
        if staging_slots < 1:
            raise ValueError(f"staging_slots should be >= 1 but is: {staging_slots}")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.chunk_bytes = chunk_bytes
        self.staging_slots = staging_slots
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._params:
            raise ValueError(
                f"{type(optimizer).__name__} has no params to optimize (its param groups are "
                "empty); give it the model's params before wrapping it"
            )
        devices = {local_tensor(p).device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all params must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._subset = subset_step_for(optimizer)
        self._check_ring_fits()
        self._streams = CopyStreams(self.device, staging_slots)
        self._plan: OffloadPlan | None = None
        self._units_key: tuple[tuple[int, ...], ...] | None = None
        self._chunks: list[_Chunk] = []
        self._host_slabs: dict[torch.dtype, Tensor] = {}
        self._staging: dict[torch.dtype, Tensor] = {}
        self._step_done: torch.Event | None = None
        self._hooks_for_lr_scheduler()
        # Forward overlap: an overlapped step's chunks not yet enqueued, how many are,
        # and whether the next forward must still wait for them.
        self._pending: Iterator[None] | None = None
        self._enqueued = 0
        self._in_flight = False
        self._owners: list[tuple[nn.Module, list[Tensor]]] = []
        self._module_chunk: list[int] = []
        self._chunk_done: list[torch.Event | None] = []
        self._side_stream: torch.Stream | None = None
        self._forward_hooks: ForwardHooks | None = None
        if overlap_forward is not None:
            if self._subset is None:
                raise ValueError(
                    f"overlap_forward needs an optimizer with a subset step; "
                    f"{type(optimizer).__name__} has none (it would take the serial path)"
                )
            self._owners = param_owners(overlap_forward)
            self._owner_index = {module: i for i, (module, _) in enumerate(self._owners)}
            self._side_stream = self._streams.new_stream()
            self._forward_hooks = ForwardHooks(
                overlap_forward, self._owners, self._before_module, self._after_forward
            )

    def _check_ring_fits(self) -> None:
        """Fail at construction if the staging ring cannot fit on the device.

        A slot holds at least the largest param's state (a chunk is whole units),
        so `staging_slots` times that is a floor on the ring the first step allocates.
        """
        if self._subset is None:  # the serial path stages state per step, no ring
            return
        largest = max(
            sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
            for layout in map(self._subset.state_layout, self._params)
        )
        check_device_memory(
            self.staging_slots * largest,
            self.device,
            f"the staging ring ({self.staging_slots} slots of at least {largest} bytes, the "
            "largest param's state)",
            "lower staging_slots (2 to 4 overlap the copies)",
        )

    def _check_step_inputs(self) -> None:
        """Refuse, before anything changes, a step the wrapper cannot take exactly."""
        current = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(current) != len(self._params) or any(
            a is not b for a, b in zip(current, self._params, strict=True)
        ):
            raise RuntimeError(
                f"the wrapped {type(self.optimizer).__name__}'s params changed after wrapping "
                f"({len(self._params)} params then, {len(current)} now): CPUOffloadOptimizer "
                "plans its host slabs once. Call add_param_group on the optimizer before "
                "wrapping it, or wrap a new optimizer (load the old one's state_dict into it)"
            )
        if type(self.optimizer) is torch.optim.SGD:
            for group in self.optimizer.param_groups:
                sparse = [p for p in group["params"] if p.grad is not None and p.grad.is_sparse]
                if group["momentum"] != 0 and sparse:
                    raise ValueError(
                        f"param {self._params.index(sparse[0])} has a sparse grad, for which "
                        f"SGD(momentum={group['momentum']}) keeps a sparse momentum_buffer; "
                        "offloaded state lives in dense host slabs. Use dense grads "
                        "(nn.Embedding(sparse=False)), momentum=0, or do not offload this optimizer"
                    )

    def _hooks_for_lr_scheduler(self) -> None:
        # What Optimizer.__init__ would have set and schedulers or hooks read.
        from collections import OrderedDict

        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # step hooks registered on the wrapper run once a step

    # -- the wrapped optimizer's surface ------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.state

    @property
    def plan(self) -> OffloadPlan | None:
        """The chunk plan, built on the first step (None before)."""
        return self._plan

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroing in place would race the overlapped step's reads
            self._wait_on_current_stream()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "CPUOffloadOptimizer plans its host slabs once; add the group to the wrapped "
            "optimizer before wrapping it"
        )

    def wait_for_optimizer_step(self) -> None:
        """Block the host until the last step is done: params updated, state written back.

        Call it before reading params or state outside a forward (checkpoint save,
        weight export); `state_dict` and `load_state_dict` call it themselves.
        """
        self._advance(len(self._chunks))
        self._in_flight = False
        if self._step_done is not None:
            self._step_done.synchronize()

    def state_dict(self) -> dict[str, Any]:
        self.wait_for_optimizer_step()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the host slabs in place; nothing is staged on the GPU."""
        self.wait_for_optimizer_step()
        # State is keyed by whatever the saved groups list as params (indices, or FQNs
        # from torch.distributed.checkpoint); match them to params by position, as torch does.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(self._params):
            raise ValueError(
                f"state_dict has {len(saved_ids)} params, this optimizer {len(self._params)}"
            )
        param_of = dict(zip(saved_ids, self._params, strict=True))
        offloaded = {
            (index, key): value
            for index, entries in state_dict["state"].items()
            for key, value in entries.items()
            if isinstance(value, Tensor) and value.ndim >= 1
        }
        views = self._host_views()
        self._check_complete_state(state_dict["state"], param_of, views)
        for (index, key), value in offloaded.items():
            view = views.get((param_of[index], key))
            if view is not None and local_tensor(value).shape != view.host.shape:
                raise ValueError(
                    f"state {key!r} of param {index} has shape {tuple(local_tensor(value).shape)}, "
                    f"expected {tuple(view.host.shape)}"
                )
        light = {
            "state": {
                index: {k: v for k, v in entries.items() if (index, k) not in offloaded}
                for index, entries in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }
        self.optimizer.load_state_dict(light)
        for (index, key), value in offloaded.items():
            param = param_of[index]
            view = views.get((param, key))
            if view is None:  # no slab yet: held on the host until the first step adopts it
                held = torch.empty_like(local_tensor(value), device="cpu")
                held.copy_(local_tensor(value))
                self.optimizer.state[param][key] = _as_state(param, held)
            else:
                view.host.copy_(local_tensor(value))
                self.optimizer.state[param][key] = view.host_state

    def _check_complete_state(
        self,
        saved: dict[Any, dict[str, Any]],
        param_of: dict[Any, Tensor],
        views: dict[tuple[Tensor, str], _View],
    ) -> None:
        """Every param with saved state has every state tensor the step will read.

        A missing one would be staged from its slab unchanged (zeros, or the last
        run's values); plain torch optimizers raise a KeyError at the next step.
        """
        homed: dict[Tensor, set[str]] = {}
        for param, key in views:
            homed.setdefault(param, set()).add(key)
        for index, entries in saved.items():
            if not entries:
                continue
            param = param_of[index]
            expected = homed.get(param, set())
            if not expected and self._subset is not None:
                expected = set(self._subset.state_layout(param))
            missing = sorted(expected - set(entries))
            if missing:
                raise KeyError(
                    f"state_dict's state of param {index} lacks {missing[0]!r} (it has "
                    f"{sorted(entries)}; {type(self.optimizer).__name__} keeps {sorted(expected)} "
                    f"for it): load a state_dict saved from the same optimizer, or drop param "
                    f"{index}'s entry to start its state afresh"
                )

    # -- stepping -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        self._check_step_inputs()
        if self._subset is None:  # the wrapped step calls the closure (LBFGS: many times)
            return self._serial_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._advance(len(self._chunks))  # the rest of an overlapped previous step
        subset = self._subset.begin_subset_step()
        self._ensure_plan(subset.units, self._subset.state_layout)
        if self._forward_hooks is None:
            for _ in self._enqueue_chunks(subset, self._streams.current()):
                pass
            return loss
        # Overlapped: the side stream starts where the trainer's stream is now (grads
        # reduced and clipped); grads the trainer drops must outlive the side stream's reads.
        streams, side = self._streams, self._side_stream
        streams.wait(side, streams.mark(streams.current()))
        if side is not None:
            for p in self._params:
                if p.grad is not None:
                    local_tensor(p.grad).record_stream(side)
        self._pending = self._enqueue_chunks(subset, side)
        self._enqueued = 0
        self._in_flight = True
        self._advance(OVERLAP_CHUNKS_UP_FRONT * self.staging_slots - 1)
        return loss

    def _advance(self, last: int) -> None:
        """Enqueue the pending overlapped step's chunks up to index `last`.

        Called from forward hooks too, so the trainer's grad mode, inference mode
        and autocast are switched off: the update must not change with where it runs.
        """
        if self._pending is None or self._enqueued > last:
            return
        with (
            torch.inference_mode(False),
            torch.no_grad(),
            torch.autocast(self.device.type, enabled=False),
        ):
            while self._pending is not None and self._enqueued <= last:
                if next(self._pending, StopIteration) is StopIteration:
                    self._pending = None
                else:
                    self._enqueued += 1

    def _before_module(self, index: int) -> None:
        if not self._in_flight or not self._module_chunk:
            return
        module = self._owners[index][0]
        # FSDP2 all-gathers the modules it prefetches from here before their own hooks run.
        prefetched = (self._owner_index.get(m) for m in forward_prefetched(module))
        indices = [index] + [i for i in prefetched if i is not None]
        chunk = max(self._module_chunk[i] for i in indices)
        if chunk < 0:
            return
        self._advance(chunk + self.staging_slots)  # keep a few chunks ahead of the forward
        done = self._chunk_done[chunk]
        self._streams.wait(self._streams.current(), done)
        if done is not None:
            for stream in fsdp_all_gather_streams(module):
                stream.wait_event(done)

    def _after_forward(self) -> None:
        if self._in_flight:
            self._wait_on_current_stream()
            self._in_flight = False

    def _wait_on_current_stream(self) -> None:
        """Enqueue every pending chunk; the trainer's stream waits for the last update."""
        self._advance(len(self._chunks))
        if self._in_flight and self._chunk_done:
            self._streams.wait(self._streams.current(), self._chunk_done[-1])

    def _enqueue_chunks(self, subset: SubsetStep, compute: torch.Stream | None) -> Iterator[None]:
        """Enqueue the step chunk by chunk, yielding after each (lazily, when overlapped)."""
        streams = self._streams
        ahead = self.staging_slots - 1  # loads in flight ahead of the update (0: load, then step)
        state = self.optimizer.state
        loaded = [False] * len(self._chunks)
        for c in range(min(ahead, len(self._chunks))):
            loaded[c] = self._load(self._chunks[c])
        for c, chunk in enumerate(self._chunks):
            if c + ahead < len(self._chunks):
                loaded[c + ahead] = self._load(self._chunks[c + ahead])
            # A loaded slot was freed before its load; an unloaded one (state not
            # created yet) must still wait for its last write-back before the step
            # creates state into it.
            ready = streams.loaded if loaded[c] else streams.freed
            streams.wait(compute, ready[chunk.slot])
            had_state = {p for p in chunk.params if state.get(p)}
            for view in chunk.views:
                if view.param in had_state:
                    state[view.param][view.spec.key] = view.staging_state
            with streams.on(compute):
                subset.step_params(chunk.params)
                self._adopt_new_state(chunk, had_state)
            streams.record(streams.stepped[chunk.slot], compute)
            if self._chunk_done:
                streams.record(self._chunk_done[c], compute)
            with streams.on(streams.d2h):
                streams.wait(streams.d2h, streams.stepped[chunk.slot])
                for host, staging in chunk.host:
                    host.copy_(staging, non_blocking=True)
                streams.record(streams.freed[chunk.slot], streams.d2h)
            for view in chunk.views:
                if state.get(view.param):
                    state[view.param][view.spec.key] = view.host_state
            if c == len(self._chunks) - 1:
                self._step_done = streams.freed[chunk.slot]
            yield

    def _load(self, chunk: _Chunk) -> bool:
        """Enqueue the H2D copy of a chunk's state, unless none of its params has state yet."""
        if not any(self.optimizer.state.get(p) for p in chunk.params):
            return False
        streams = self._streams
        with streams.on(streams.h2d):
            # The slot's previous chunk must be written back before it is overwritten.
            streams.wait(streams.h2d, streams.freed[chunk.slot])
            for host, staging in chunk.host:
                staging.copy_(host, non_blocking=True)
            streams.record(streams.loaded[chunk.slot], streams.h2d)
        return True

    def _adopt_new_state(self, chunk: _Chunk, had_state: set[Tensor]) -> None:
        """State the step just created goes into the chunk's staging slot, then home."""
        state = self.optimizer.state
        for view in chunk.views:
            param, key, spec = view.param, view.spec.key, view.spec
            if param in had_state or not state.get(param):
                continue
            created = local_tensor(state[param][key])
            if created.shape != spec.shape or created.dtype != spec.dtype:
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} created state {key!r} as "
                    f"{tuple(created.shape)} {created.dtype}, but its state_layout promised "
                    f"{tuple(spec.shape)} {spec.dtype}"
                )
            view.staging.copy_(created)
            state[param][key] = view.staging_state

    # -- planning and allocation --------------------------------------------------------

    def _ensure_plan(
        self, units: Sequence[Sequence[Tensor]], layout: Callable[[Tensor], StateLayout]
    ) -> None:
        index = {p: i for i, p in enumerate(self._params)}
        if self._owners:
            # Chunks in the order the forward needs them (stable, so the same on every rank).
            first_use = {p: i for i, (_, params) in enumerate(self._owners) for p in params}
            last = len(self._owners)
            units = sorted(units, key=lambda unit: min(first_use.get(p, last) for p in unit))
        units_key = tuple(tuple(index[p] for p in unit) for unit in units)
        if self._plan is not None:
            if units_key != self._units_key:
                raise RuntimeError("the optimizer's units changed between steps; re-wrap it")
            return
        specs = [
            ParamSpec(
                invariant_numel(p),
                tuple(StateSpec(k, torch.Size(s), d) for k, (s, d) in layout(p).items()),
            )
            for p in self._params
        ]
        self._build(plan_offload(units_key, specs, self.chunk_bytes), units_key)

    def _build(
        self, plan: OffloadPlan, units_key: tuple[tuple[int, ...], ...], ring: bool = True
    ) -> None:
        """Allocate slabs and staging once, carve views, and move any existing state home.

        The serial path stages all state per step instead of through the ring, so
        without `ring` the staging buffers live on the meta device and take no memory.
        """
        slot_bytes = plan.staging_bytes(1)
        if ring and slot_bytes > max(2 * self.chunk_bytes, OVERSIZED_UNIT_WARN_BYTES):
            mib = 2**20
            warnings.warn(
                f"a unit of the wrapped optimizer holds {slot_bytes / mib:.0f} MiB of state, "
                f"more than chunk_bytes ({self.chunk_bytes / mib:.0f} MiB), and a unit is never "
                f"split: the GPU staging ring takes {self.staging_slots} x "
                f"{slot_bytes / mib:.0f} MiB. Give the optimizer smaller units (muon.Muon: "
                f"bucket_cap_bytes; muon_offload.setup_optimizer caps it for you) or raise "
                f"chunk_bytes.",
                stacklevel=_user_stacklevel(),
            )
        self._host_slabs = allocate_host_slabs(plan.host_numel, self.device)
        ring_device = self.device if ring else torch.device("meta")
        self._staging = {
            dtype: torch.empty(self.staging_slots * n, dtype=dtype, device=ring_device)
            for dtype, n in plan.slot_numel.items()
        }
        chunks = []
        for c, layout in enumerate(plan.chunks):
            slot = c % self.staging_slots
            host, views = [], []
            for dtype, (start, stop) in layout.host_ranges.items():
                base = slot * plan.slot_numel[dtype]
                host.append(
                    (
                        self._host_slabs[dtype][start:stop],
                        self._staging[dtype][base : base + stop - start],
                    )
                )
            for view in layout.views:
                spec, param = view.spec, self._params[view.param]
                base = slot * plan.slot_numel[spec.dtype]
                h = self._host_slabs[spec.dtype][view.host_offset :][: spec.numel]
                s = self._staging[spec.dtype][base + view.staging_offset :][: spec.numel]
                h, s = h.view(spec.shape), s.view(spec.shape)
                views.append(_View(param, spec, h, s, _as_state(param, h), _as_state(param, s)))
            chunks.append(_Chunk([self._params[i] for i in layout.params], slot, host, views))
        self._plan, self._units_key, self._chunks = plan, units_key, chunks
        if self._owners:
            chunk_of = {p: c for c, chunk in enumerate(chunks) for p in chunk.params}
            self._module_chunk = [
                max((chunk_of[p] for p in waited_params(module) if p in chunk_of), default=-1)
                for module, _ in self._owners
            ]
            self._chunk_done = [self._streams.new_event() for _ in chunks]
        state = self.optimizer.state
        for chunk in chunks:
            for view in chunk.views:
                entries = state.get(view.param)
                if entries and view.spec.key in entries:
                    view.host.copy_(local_tensor(entries[view.spec.key]))
                    entries[view.spec.key] = view.host_state

    def _host_views(self) -> dict[tuple[Tensor, str], _View]:
        return {(v.param, v.spec.key): v for chunk in self._chunks for v in chunk.views}

    # -- serial path --------------------------------------------------------------------

    def _serial_step(self, closure: Callable[[], float] | None) -> float | None:
        """All state in, step (with the closure), all state out, on the current stream.

        Its layout is learned from the state the optimizer creates, so the slabs are
        (re)built after a step that created state for a param: the first step, and
        any step where a param gets its first grad. The host's memory for them is
        checked before that step, from a dry run, where the optimizer allows one.
        """
        if self._plan is None and self._unhomed_state():  # loaded before the first step
            self._build_serial_plan()
        self._check_host_memory_for_new_state()
        state = self.optimizer.state
        staged = []
        if self._plan is not None:
            (layout,) = self._plan.chunks
            staging = {
                dtype: torch.empty(n, dtype=dtype, device=self.device)
                for dtype, n in self._plan.slot_numel.items()
            }
            for view in layout.views:
                spec, param = view.spec, self._params[view.param]
                s = staging[spec.dtype][view.staging_offset :][: spec.numel].view(spec.shape)
                h = self._host_slabs[spec.dtype][view.host_offset :][: spec.numel]
                h = h.view(spec.shape)
                s.copy_(h, non_blocking=True)
                state[param][spec.key] = _as_state(param, s)
                staged.append((param, spec.key, h))
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        for param, key, h in staged:
            # The step may have replaced the tensor rather than updated it (LBFGS's "d").
            now = local_tensor(state[param][key])
            if now.shape != h.shape or now.dtype != h.dtype:
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} changed state {key!r} of param "
                    f"{self._params.index(param)} from {tuple(h.shape)} {h.dtype} to "
                    f"{tuple(now.shape)} {now.dtype}; its state cannot live in fixed host slabs"
                )
            h.copy_(now, non_blocking=True)
            state[param][key] = _as_state(param, h)
        if self._unhomed_state():  # created on the device by this step: move it home
            self._build_serial_plan()
        if self._streams.async_copies:
            self._step_done = self._streams.mark(self._streams.current())
        return loss

    def _check_host_memory_for_new_state(self) -> None:
        """If this step will create state, check the host holds all state after it."""
        state = self.optimizer.state
        fresh = [p for p in self._params if p.grad is not None and not state.get(p)]
        if not fresh:
            return
        new_bytes = dry_run_state_bytes(self.optimizer, fresh)
        if new_bytes is None:  # cannot be known in advance: checked when the slabs are built
            return
        held = sum(
            local_tensor(v).numel() * v.element_size()
            for p in self._params
            for v in state.get(p, {}).values()
            if isinstance(v, Tensor) and v.ndim >= 1
        )
        check_host_memory(held + new_bytes)

    def _unhomed_state(self) -> bool:
        homed = self._host_views()
        return any(
            (p, k) not in homed
            for p in self._params
            for k, v in self.optimizer.state.get(p, {}).items()
            if isinstance(v, Tensor) and v.ndim >= 1
        )

    def _build_serial_plan(self) -> None:
        state = self.optimizer.state
        specs = [
            ParamSpec(
                invariant_numel(p),
                tuple(
                    StateSpec(k, local_tensor(v).shape, v.dtype)
                    for k, v in state.get(p, {}).items()
                    if isinstance(v, Tensor) and v.ndim >= 1
                ),
            )
            for p in self._params
        ]
        units = tuple((i,) for i in range(len(self._params)))
        self._build(plan_offload(units, specs, chunk_bytes=2**62), units, ring=False)


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, called from a warning's site, that points at
    the first caller outside this library and torch (the user's `step()` call)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "offload",
        "muon",
        "muon_offload",
        "torch",
    ):
        level, frame = level + 1, frame.f_back
    return level
