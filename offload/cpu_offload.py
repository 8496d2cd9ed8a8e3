"""CPUOffloadOptimizer: optimizer state in host memory, streamed through the GPU.

Each step cuts the optimizer's units into chunks (`chunk_plan`), and runs a
three-stage pipeline over a ring of GPU staging slots (allocated for the step
from the caching allocator and given back when the step is done):

    H2D stream      load c+2       load c+3       ...
    compute stream  step c+1       step c+2       ...
    D2H stream      write back c   write back c+1 ...

ordered by events only, so the copies each way and the update math overlap
and the host never waits inside `step()`. Chunks whose state is GPU-resident
(`gpu_resident_bytes`) step in place, with no copies. Forward overlap (running
the chunks as the next forward reaches them) is `forward_overlap.ForwardOverlap`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from offload.auto_residency import AutoResidency, StepShape
from offload.chunk_plan import OffloadPlan, ParamSpec, StateSpec, plan_offload, unit_sizes
from offload.forward_overlap import ForwardOverlap
from offload.host_memory import (
    allocate_host_slabs,
    check_device_memory,
    check_host_memory,
    device_headroom_bytes,
    room_under_peak_bytes,
)
from offload.options import check_offload_options
from offload.residency import ResidencyChoice, Split, StepTimer
from offload.state_estimate import dry_run_state_bytes
from offload.step_schedule import (
    StepSchedule,
    backward_load_share,
    chosen_backward_loads,
    loads_within_room,
    plan_step,
)
from offload.streams import CopyStreams
from offload.subset_step import (
    ParamSlice,
    SlicingSubsetStep,
    StateLayout,
    SubsetStep,
    local_tensor,
    patched_step,
    record_step_for_lr_schedulers,
    step_without_hooks,
    subset_step_for,
)

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * 2**20  # bench/offload_step.py: 1.03x the copy floor with 4 slots
DEFAULT_STAGING_SLOTS = 4  # 4 measured 3-7% faster than 3 at every chunk size
BACKWARD_ROOM_SHARE = 0.9
"""By default, with overlap, the backward loads more than the chunks the forward first
waits for while the plan holds at most this share of the room under the device's peak
(`room_under_peak_bytes`): the activations are not given back evenly over the backward."""


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


def _check_state_shape(param: Any, key: str, value: Tensor, expected: torch.Size, fix: str) -> None:
    """Refuse a state tensor (loaded, or assigned by hand) not shaped as the step keeps it:
    copied into its home, a broadcastable one would fill it silently."""
    shape = local_tensor(value).shape
    if shape != expected:
        raise ValueError(
            f"state {key!r} of param {param} has shape {tuple(shape)}, expected "
            f"{tuple(expected)} ({fix})"
        )


def _position(params: Sequence[Tensor], param: Tensor) -> int:
    """`param`'s index in `params`, by identity: `list.index` compares with `==`, which a
    tensor answers elementwise (and raises on for another param's shape)."""
    return next(i for i, p in enumerate(params) if p is param)


def _check_each_param_once(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a param listed twice: torch's step updates it once per listing, the
    chunked step once (its state has one home)."""
    seen: dict[Tensor, tuple[int, int]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for k, param in enumerate(group["params"]):
            if param in seen:
                first_g, first_k = seen[param]
                raise ValueError(
                    f"the param at group {g}, position {k} (shape {tuple(param.shape)}) is "
                    f"listed twice: also at group {first_g}, position {first_k}. "
                    f"{type(optimizer).__name__} steps it once per listing, "
                    "CPUOffloadOptimizer once: list each param once"
                )
            seen[param] = (g, k)


@dataclass
class _Home:
    """Where one state tensor lives between steps: a host slab view, or a GPU-resident one."""

    home: Tensor  # local shape
    home_state: Tensor  # as the optimizer keeps it (a DTensor like the param, or `home`)


@dataclass
class _View:
    """The part of one state tensor a chunk steps, built once."""

    param: Tensor
    key: str
    home: _Home
    staging: Tensor  # a view of the staging ring (of the home, in a resident chunk)
    staging_state: Tensor  # as the step reads it (a flat tensor for a slice)


@dataclass
class _Chunk:
    """A chunk's runtime handles, built once from its `ChunkLayout`."""

    params: list[Tensor]  # updated whole
    slices: list[ParamSlice]  # updated in slices
    slot: int  # staging slot; -1 when resident
    invariant_bytes: int  # rank-invariant state bytes ("auto" times its loads by them)
    copies: list[tuple[Tensor, Tensor]]  # (home slab range, staging slot range)
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
wait is how much is enqueued ahead of it (`_load_ahead` spreads the backward's loads).
Chosen with `bench/train_step.py --trace` and `bench/trace_summary.py`, which show the
trainer's copies waiting behind whole chunks."""


def _copy_pieces(home: Tensor, staging: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(home, staging) cut into aligned pieces of at most `COPY_PIECE_BYTES`."""
    step = max(1, COPY_PIECE_BYTES // home.element_size())
    return [(home[i : i + step], staging[i : i + step]) for i in range(0, home.numel(), step)]


AMP_SCALING_ATTRIBUTES = ("grad_scale", "found_inf")
"""What `torch.amp.GradScaler.step` sets on an optimizer with `_step_supports_amp_scaling`
(fused Adam, AdamW, SGD, Adagrad) for its `step()` call and deletes after: its step reads
them (`getattr(self, "grad_scale", None)`), unscales the grads in its kernel and skips the
update on inf (torch 2.11, 2.13)."""


@contextlib.contextmanager
def _attributes_set(obj: object, values: Mapping[str, Any]) -> Iterator[None]:
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


OVERSIZED_UNIT_WARN_BYTES = 64 << 20
"""Warn when a unit bigger than twice `chunk_bytes` makes a staging slot bigger than this."""


_WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = (
    weakref.WeakKeyDictionary()
)
"""The open wrapper of each wrapped optimizer: a second would keep the state in its own
slabs, and the two would step from different copies of it."""


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """Keep `optimizer`'s state in pinned host memory; stream it through the GPU to step.

    Args:
        optimizer: the optimizer to wrap, already holding its params. If it
            implements the subset-step protocol (`offload.subset_step`) or is a
            torch optimizer with independent per-param updates, the step is
            chunked; otherwise it takes the serial path (all state in, step,
            all state out), still exact.
        chunk_bytes: target state bytes per chunk (rank-invariant count). An
            elementwise optimizer's param (AdamW, Adam, SGD, ...) larger than this
            is cut into slices; a unit that cannot be cut (a Muon bucket) and is
            larger than this is a chunk of its own, and then chunks fill up to its
            size (a staging slot holds it anyway).
        staging_slots: GPU staging slots in the ring (>= 2 to overlap copies).
        overlap_forward: the model whose next forward the step overlaps. `step()`
            then returns once the first chunks are queued; the rest update on a
            side stream as the forward reaches the modules that read them. Needs
            a subset step. Read params or state outside a forward only after
            `wait_for_optimizer_step()`.
        gpu_resident_bytes: state bytes (rank-invariant count, whole units) kept
            on the GPU, never copied: the units the forward needs first with
            `overlap_forward` (overlap cannot hide them), else the last ones
            (nothing overlaps their copies), up to the first unit that does not fit.
            "auto": measure the first steps with everything offloaded (the trainer's
            stalls for chunks, the backward's length, the load rate, each step), then
            choose how much state the forward does not load: with `overlap_forward`,
            the backward loads what its length carries and the leading units of the
            rest stay resident; then, on a GPU, run the most the budget allows a few
            steps, then the default's backward loads (as without "auto"), and
            bisect for the least amount (of those held within the room under the peak,
            the fastest) whose step is as fast as the fastest, within
            `residency.NEAR_FASTEST` or the steps' own spread
            (`residency.NOISE_SIGMAS`, at most `residency.NOISE_CAP`;
            `offload.auto_residency`); the steps after it settles are checked, and if
            they are not as fast as the fastest split measured it takes that one instead. Without
            overlap the last units stay resident. `residency` says what it chose, and
            one log line. It keeps room in the host slabs for the whole state, so
            re-choosing never allocates pinned memory.
        gpu_budget_bytes: with "auto", the GPU memory the optimizer may hold for state
            (resident state, the staging ring and the backward's extra slots); default:
            what the device had free at the measured steps' peak, less
            `residency.BUDGET_MARGIN_FRACTION` of its memory, and never more than
            keeping the whole state on the GPU would hold; the default's backward loads
            (what runs without "auto", within the room under the peak) are tried too.
        load_in_backward: with `overlap_forward`, load the next step's first chunks in
            the backward of the first forward after a step, spread over the modules it
            passes from the last module that forward ran on (by then the loss and head's
            activations, the backward's usual peak, are freed) to the first: the step
            finds them loaded. Default (None): the chunks holding what the forward first
            waits for (the first module that reads params: under FSDP2 the root's unit, in
            a transformer wrapped per layer its embedding and head), at least the ring's,
            so the forward starts without waiting for copies; with "auto", "auto" chooses
            how much. False: never (the least GPU memory); True: the ring's
            `staging_slots` chunks (with "auto": at least those); a byte count: that much
            state (rank-invariant bytes, whole chunks, at least the ring's; with "auto": at
            most that much). Each chunk loaded takes a staging slot of its own (sized for
            it), allocated in the backward and given back as soon as its chunk is written
            back (late in the next forward: the ring's write-backs go first, so the
            trainer's small copies early in the forward do not wait behind these); the
            ring holds only the slots the other chunks take. The backward's idle copy
            engine then carries what the forward is too short to hide. These slots are
            GPU memory from the backward to the next forward, after
            the backward's peak (under gradient accumulation, from the first micro-batch's
            backward on). Nothing of the update starts before `step()` (grads may still
            change, e.g. clipping), and state edited in place after the backward (through
            `state`, or a state tensor held from an earlier step, by torch ops: their
            version counters tell `step()` to load again) is what it steps. Each module's
            backward should outlast loading its share (about `chunk_bytes` per module at
            the host link's copy rate, with the defaults and a 16-layer model), or the
            trainer's own small copies wait behind the loads.

    GPU memory for state: the resident state, and during a step `staging_slots`
    chunks (the ring is given back to the caching allocator when the step is
    done; fewer when fewer chunks are left to it) plus a slot per chunk the backward
    loads (with overlap, by default the chunks the forward first waits for;
    `load_in_backward`); on the first
    step, while the optimizer creates its state chunk by chunk, one more chunk.

    Host syncs: none inside `step()` (but the first step pins the host slabs and
    the step where "auto" decides rebuilds them). Reading state (`state_dict`,
    `load_state_dict`) first waits for the last write-back.

    `close()` finishes the last step, removes the forward hooks and gives back
    the staging ring; state stays readable. A dropped optimizer is collected even
    without `close()`: the model's hooks do not keep it alive. An optimizer has
    one open wrapper at a time.

    State tensors shaped like a param are laid out like it (as torch optimizers
    create them). One assigned by hand (`opt.state[p][key] = t`) is copied home
    at the next step. A step interrupted inside a chunk (KeyboardInterrupt, an
    error) leaves the state at home, partly updated, and the next `step()`
    refuses until `load_state_dict` restores a checkpoint.
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
        gpu_resident_bytes: int | Literal["auto"] = 0,
        gpu_budget_bytes: int | None = None,
        load_in_backward: bool | int | None = None,
    ) -> None:
        if isinstance(optimizer, CPUOffloadOptimizer):
            raise TypeError("optimizer is already a CPUOffloadOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "CPUOffloadOptimizer wraps an optimizer, e.g. "
                "CPUOffloadOptimizer(torch.optim.AdamW(model.parameters())), but got: "
                f"{type(optimizer).__name__}"
            )
        if overlap_forward is not None and not isinstance(overlap_forward, nn.Module):
            raise TypeError(
                "overlap_forward should be the model whose forward reads these params (the "
                "root module you fully_shard, or the plain module) or None, but is: "
                f"{overlap_forward!r} ({type(overlap_forward).__name__})"
            )
        check_offload_options(
            chunk_bytes=chunk_bytes,
            staging_slots=staging_slots,
            gpu_resident_bytes=gpu_resident_bytes,
            gpu_budget_bytes=gpu_budget_bytes,
            overlap_forward=overlap_forward is not None,
            load_in_backward=load_in_backward,
        )
        holder = _WRAPPERS.get(optimizer)
        if holder is not None and (wrapper := holder()) is not None and not wrapper._closed:
            raise ValueError(
                f"this {type(optimizer).__name__} is already wrapped by a CPUOffloadOptimizer, "
                "which keeps its state in its own host slabs: step through that one, or "
                "close() that one first"
            )
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.chunk_bytes = chunk_bytes
        self.staging_slots = staging_slots
        self.gpu_resident_bytes: int | Literal["auto"] = gpu_resident_bytes
        """The resident state's bytes; "auto" until it has settled, then what it chose."""
        self.gpu_budget_bytes = gpu_budget_bytes
        self._resident_budget = 0 if gpu_resident_bytes == "auto" else gpu_resident_bytes
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._params:
            raise ValueError(
                f"{type(optimizer).__name__} has no params to optimize (its param groups are "
                "empty); give it the model's params before wrapping it"
            )
        _check_each_param_once(optimizer)
        lazy = next((i for i, p in enumerate(self._params) if nn.parameter.is_lazy(p)), None)
        if lazy is not None:
            raise ValueError(
                f"param {lazy} is uninitialized (a lazy module's, e.g. nn.LazyLinear): its "
                "shape, and so its state's, is not known yet. Run the model's forward once "
                "first, then wrap the optimizer"
            )
        devices = {local_tensor(p).device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all params must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        if self.device.type == "meta":
            raise ValueError(
                "the params are on the meta device (a model not materialized yet): build and "
                "wrap the optimizer after model.to_empty(device=...) and the weights' init"
            )
        self._subset = subset_step_for(optimizer)
        self._refuse_a_patched_step()
        if self._subset is None and (gpu_resident_bytes != 0 or gpu_budget_bytes is not None):
            raise ValueError(
                f"gpu_resident_bytes and gpu_budget_bytes need an optimizer with a subset "
                f"step; {type(optimizer).__name__} has none (it takes the serial path, which "
                "keeps no state on the GPU between steps): leave them unset"
            )
        self._check_ring_fits()
        self._streams = CopyStreams(self.device, staging_slots)
        self._plan: OffloadPlan | None = None
        self._specs: list[ParamSpec] = []
        self._units_key: tuple[tuple[int, ...], ...] | None = None
        self._stepped_whole: set[Tensor] = set()  # params never sliced (sparse grads)
        self._state_loaded = False  # since the last plan: its options may keep other state
        self._chunks: list[_Chunk] = []
        self._homes: dict[tuple[Tensor, str], _Home] = {}
        self._host_slabs: dict[torch.dtype, Tensor] = {}
        self._resident_slabs: dict[torch.dtype, Tensor] = {}
        self._ring: _StagingRing | None = None
        self._extra_slots: list[_StagingRing] = []  # the backward's, slots staging_slots + i
        self._schedule: StepSchedule | None = None  # how the step runs its chunks
        self._step_done: torch.Event | None = None
        self._steps = 0
        self._auto: AutoResidency | None = None
        self._host_room_for_all = gpu_resident_bytes == "auto"
        # A byte count for the backward's loads, or None (the ring's chunks, or "auto"'s).
        backward_bytes = None
        if load_in_backward is not None and not isinstance(load_in_backward, bool):
            backward_bytes = int(load_in_backward)
        if gpu_resident_bytes == "auto":
            backward = None
            if overlap_forward is not None and load_in_backward is not False:
                backward = "auto" if backward_bytes is None else backward_bytes
            self._auto = AutoResidency(
                StepTimer(self.device), gpu_budget_bytes, backward, self.device
            )
        self.residency: ResidencyChoice | None = None
        """What "auto" chose, once it has settled (None before, and for a byte budget)."""
        self._closed = False
        self._interrupted: str | None = None  # why step() is refused after an interrupted step
        self._hooks_for_lr_scheduler()
        self._overlap: ForwardOverlap | None = None
        if overlap_forward is not None:
            if self._subset is None:
                raise ValueError(
                    f"overlap_forward needs an optimizer with a subset step; "
                    f"{type(optimizer).__name__} has none (it would take the serial path)"
                )
            self._overlap = ForwardOverlap(overlap_forward, self._params, self._streams)
        self._insist_on_backward_loads = load_in_backward is True
        # Default with overlap (not "auto"): the backward loads what the forward first waits for.
        self._load_first_wait = (
            load_in_backward is None and self._overlap is not None and self._auto is None
        )
        self._load_in_backward = self._load_first_wait or (
            bool(load_in_backward) and self._auto is None
        )
        if self._overlap is not None and (
            self._load_in_backward or (self._auto is not None and self._auto.backward is not None)
        ):
            reached = weakref.WeakMethod(self._backward_reached)  # the model must not keep self
            self._overlap.backward_reached = lambda *at: (reached() or _nothing)(*at)
        waited = weakref.WeakMethod(self.wait_for_optimizer_step)
        if self._overlap is not None:
            self._overlap.written_back = lambda: (waited() or _nothing)()
        # The wrapped optimizer's own state_dict() and load_state_dict() (a trainer that
        # checkpoints `.optimizer`) see the last step whole, as the wrapper's do.
        # Removed by close(), or once this wrapper is collected (the optimizer may outlive it).
        self._remove_inner_hooks = weakref.finalize(
            self,
            _remove_handles,
            [
                optimizer.register_state_dict_pre_hook(lambda _: (waited() or _nothing)()),
                optimizer.register_load_state_dict_pre_hook(lambda *_: (waited() or _nothing)()),
            ],
        )
        self._remove_inner_hooks.atexit = False
        self.backward_load_bytes = backward_bytes
        """With loads in the backward: the state bytes it loads (None: the ring's chunks;
        by default, once planned, those the forward first waits for); under "auto", once
        settled, what it chose."""
        self._loaded_ahead: dict[int, bool] = {}  # staged chunk index -> state copied in
        self._loaded_ahead_done: torch.Event | None = None
        self._loaded_ahead_versions: list[int] = []  # of their state, once the backward loaded
        self.chunks_loaded_in_backward = 0
        """How many chunks the last step found loaded in the backward (`load_in_backward`)."""
        _WRAPPERS[optimizer] = weakref.ref(self)

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

    def _refuse_a_patched_step(self) -> None:
        """A subset step never calls a `step` set on the wrapped optimizer itself (Muon's)
        or calls it once per chunk, on that chunk's params (torch optimizers'): a patch that
        clips by the global grad norm would clip each chunk on its own."""
        if self._subset is None or patched_step(self.optimizer) is None:
            return
        name = type(self.optimizer).__name__
        raise TypeError(
            f"the wrapped {name}'s step is set on the instance (opt.step = ..., a patch or a "
            f"compiled step): CPUOffloadOptimizer steps {name} a chunk of params at a time "
            f"through its own step, so that patch would not run once a step on all params. "
            "Patch, compile or wrap the CPUOffloadOptimizer's step instead (it runs once a "
            "step), or remove the patch (del opt.step)"
        )

    def _check_step_inputs(self) -> None:
        """Refuse, before anything changes, a step the wrapper cannot take exactly."""
        self._refuse_a_patched_step()
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
        moved = next((i for i, p in enumerate(self._params) if p.device != self.device), None)
        if moved is not None:
            raise RuntimeError(
                f"param {moved} is on {self._params[moved].device} but was on {self.device} "
                "when its optimizer was wrapped: move the model first, then build and wrap the "
                "optimizer (CPUOffloadOptimizer plans its staging for one device)"
            )
        if type(self.optimizer) is torch.optim.SGD:
            for group in self.optimizer.param_groups:
                sparse = [p for p in group["params"] if p.grad is not None and p.grad.is_sparse]
                if group["momentum"] != 0 and sparse:
                    raise ValueError(
                        f"param {_position(self._params, sparse[0])} has a sparse grad, for which "
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

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        # As torch's optimizers take it (accelerate's wrapper forwards a set); groups
        # holding other params are refused at the next step (`_check_step_inputs`).
        self.optimizer.param_groups = groups

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's state, once the last step has written it back (an
        overlapped step's pending chunks run first, as for `state_dict`). Chunks the
        backward loaded for the next step are loaded again by it: the caller may edit
        their state in place (so may one holding a state tensor from an earlier step,
        through torch ops: `load_in_backward`)."""
        self.wait_for_optimizer_step()
        self._drop_loaded_ahead()
        return self.optimizer.state

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """The wrapped optimizer's (True for fused Adam, AdamW, SGD): `GradScaler.step` then
        hands `step()` its scale and inf flag (`AMP_SCALING_ATTRIBUTES`) rather than
        unscaling the grads itself and skipping `step()` on inf, as it would for the wrapped
        optimizer: the same bits, and the same state after a skipped step."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @property
    def plan(self) -> OffloadPlan | None:
        """The chunk plan, built on the first step (None before)."""
        return self._plan

    @property
    def schedule(self) -> StepSchedule | None:
        """How the step runs the plan's chunks (`offload.step_schedule`), built with it."""
        return self._schedule

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none and self._overlap is not None:
            self._overlap.finish()  # zeroing in place would race the overlapped step's reads
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
        if self._overlap is not None:
            self._overlap.finish()
        if self._step_done is not None:
            self._step_done.synchronize()

    def close(self) -> None:
        """Finish the last step, remove the forward hooks and give back the staging ring.

        State and params stay readable (`state_dict` works); `step()` is refused.
        """
        if self._closed:
            return
        self.wait_for_optimizer_step()
        self._drop_loaded_ahead()
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None
        self._remove_inner_hooks()
        # Given back, not only dropped: the chunks' views keep the slots' storage (the
        # backward's loads may hold it between a backward and its step), and nothing in
        # flight reads it (the step and those loads are done).
        for slots in (self._ring, *self._extra_slots):
            if slots is not None:
                slots.release([])
        self._ring, self._extra_slots = None, []
        self._closed = True
        _WRAPPERS.pop(self.optimizer, None)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.copy, copy.deepcopy and pickle all come here. torch's Optimizer.__getstate__
        # keeps only defaults, state and groups: the copy had no slabs, ring or hooks.
        raise TypeError(
            "a CPUOffloadOptimizer cannot be copied or pickled (its state lives in pinned "
            "host slabs and it drives the model's forward hooks): save its state_dict() "
            "and load it into a new CPUOffloadOptimizer wrapping a new optimizer"
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's `state_dict`, with the hooks registered on the wrapper
        called around it as `torch.optim.Optimizer.state_dict` calls them."""
        self.wait_for_optimizer_step()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self.optimizer.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hook_result = post_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the state's homes (host slabs, resident slabs) in place; nothing is staged.

        The hooks registered on the wrapper are called as `torch.optim.Optimizer` calls
        them: the pre hooks get a shallow copy of `state_dict` and may return a new one.
        """
        self.wait_for_optimizer_step()
        self._drop_loaded_ahead()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        self._load_state_dict(state_dict)
        self._interrupted = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # State is keyed by whatever the saved groups list as params (indices, or FQNs
        # from torch.distributed.checkpoint); match them to params by position, as torch does.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(self._params):
            raise ValueError(
                f"state_dict has {len(saved_ids)} params, this optimizer {len(self._params)}"
            )
        param_of = dict(zip(saved_ids, self._params, strict=True))
        unlisted = [index for index in state_dict["state"] if index not in param_of]
        if unlisted:
            raise ValueError(
                f"state_dict has state for {unlisted[0]!r}, which none of its param_groups "
                "lists: drop that entry (a param removed from the groups keeps no state)"
            )
        offloaded = {
            (index, key): value
            for index, entries in state_dict["state"].items()
            for key, value in entries.items()
            if isinstance(value, Tensor) and value.ndim >= 1
        }
        light = {
            "state": {
                index: {k: v for k, v in entries.items() if (index, k) not in offloaded}
                for index, entries in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }
        # The saved groups' options choose the state (amsgrad, momentum): checked once
        # they are loaded, and a refused load puts the old groups and state back.
        before = {"state": self.optimizer.state, "param_groups": self.optimizer.param_groups}
        self.optimizer.load_state_dict(light)
        try:
            kept = self._kept_shapes()
            self._check_complete_state(state_dict["state"], param_of, kept)
            for (index, key), value in offloaded.items():
                expected = kept.get(param_of[index], {}).get(key)
                if expected is not None:
                    _check_state_shape(
                        index, key, value, expected, "load a state_dict saved for these params"
                    )
        except BaseException:
            self.optimizer.__setstate__(before)
            raise
        self._state_loaded = True
        views = self._host_views()
        for (index, key), value in offloaded.items():
            param = param_of[index]
            view = views.get((param, key))
            if view is None:  # no slab yet: held on the host until the first step adopts it
                # in the dtype the step keeps it in (Muon: fp32 momentum for bf16 params),
                # else as torch's load gives it: floating state takes the param's
                layout = self._layout(param)
                if layout is not None and key in layout:
                    dtype = layout[key][1]
                else:
                    cast = key != "step" and param.is_floating_point()
                    dtype = param.dtype if cast else value.dtype
                held = torch.empty_like(local_tensor(value), device="cpu", dtype=dtype)
                held.copy_(local_tensor(value))
                self.optimizer.state[param][key] = _as_state(param, held)
            else:
                view.home.copy_(local_tensor(value))
                self.optimizer.state[param][key] = view.home_state

    def _check_complete_state(
        self,
        saved: dict[Any, dict[str, Any]],
        param_of: dict[Any, Tensor],
        kept: dict[Tensor, dict[str, torch.Size]],
    ) -> None:
        """Every param with saved state has every state tensor the step will read.

        A missing one would be staged from its slab unchanged (zeros, or the last
        run's values); plain torch optimizers raise a KeyError at the next step.
        """
        for index, entries in saved.items():
            if not entries:
                continue
            expected = set(kept.get(param_of[index], {}))
            missing = sorted(expected - set(entries))
            if missing:
                raise KeyError(
                    f"state_dict's state of param {index} lacks {missing[0]!r} (it has "
                    f"{sorted(entries)}; {type(self.optimizer).__name__} keeps {sorted(expected)} "
                    f"for it): load a state_dict saved from the same optimizer, or drop param "
                    f"{index}'s entry to start its state afresh"
                )

    def _layout(self, param: Tensor) -> StateLayout | None:
        """The state the step keeps for `param` with the groups' options as they are now
        (None on the serial path, which keeps what its step creates)."""
        return None if self._subset is None else self._subset.state_layout(param)

    def _kept_shapes(self) -> dict[Tensor, dict[str, torch.Size]]:
        """The local shape of each state tensor the step keeps, per param, with the groups'
        options as they are now: the subset step's layout; on the serial path, the homes of
        those a step has created."""
        kept: dict[Tensor, dict[str, torch.Size]] = {}
        if self._subset is not None:
            for param in self._params:
                layout = self._layout(param).items()
                kept[param] = {key: torch.Size(shape) for key, (shape, _) in layout}
            return kept
        for (param, key), home in self._homes.items():
            kept.setdefault(param, {})[key] = home.home.shape
        return kept

    def _take_replaced_state(self) -> None:
        """Copy state tensors assigned by hand since the last step (`opt.state[p][key] = t`)
        into their homes: a step stages the homes, and would silently use the old values.

        Done before anything reads the homes: waits for the last write-back, and forgets
        the backward's loads (they staged the old values).
        """
        state = self.optimizer.state
        for param, key in self._homes:
            if not state.get(param) or key in state[param]:
                continue
            # Staged from its home, a deleted state tensor would come back with old values
            # (unless the step no longer keeps it: a state_dict loaded with amsgrad off).
            layout = self._layout(param)
            if layout is None or key in layout:
                raise KeyError(
                    f"state {key!r} of param {_position(self._params, param)} was deleted, and the "
                    f"step reads it (the param's state has {sorted(state[param])}): assign it a "
                    "tensor, or start the param's state afresh (del opt.state[param])"
                )
        replaced = [
            (param, key, home)
            for (param, key), home in self._homes.items()
            if key in state.get(param, ()) and state[param][key] is not home.home_state
        ]
        if not replaced:
            return
        self.wait_for_optimizer_step()
        self._drop_loaded_ahead()
        for param, key, home in replaced:
            value, index = state[param][key], _position(self._params, param)
            fix = "assign a tensor like the one it replaces, or edit that one in place"
            _check_state_shape(index, key, value, home.home.shape, fix)
            if value.dtype != home.home.dtype:
                raise ValueError(
                    f"state {key!r} of param {index} was replaced by a {value.dtype} tensor, "
                    f"expected {home.home.dtype} ({fix})"
                )
            home.home.copy_(local_tensor(value))
            state[param][key] = home.home_state

    # -- stepping -----------------------------------------------------------------------

    # Host bookkeeping, pinned slabs and streams: compiled (torch.compile(opt.step)), it
    # runs eagerly rather than as a trace that cannot allocate or copy as it must.
    @torch.no_grad()
    @torch.compiler.disable
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._closed:
            raise RuntimeError("this CPUOffloadOptimizer is closed; build a new one to step")
        if self._interrupted is not None:
            raise RuntimeError(self._interrupted)
        self._run_wrapped_step_hooks(pre=True)
        self._check_step_inputs()
        # Copied, so nothing changed in place after step() reaches chunks that run later
        # (a precaution: torch 2.11's and 2.13's GradScaler computes both afresh each step).
        scaling = {
            name: value.clone() if isinstance(value, Tensor) else value
            for name, value in vars(self).items()
            if name in AMP_SCALING_ATTRIBUTES
        }
        if self._subset is None:  # the wrapped step calls the closure (LBFGS: many times)
            loss = self._serial_step(closure, scaling)
        else:
            loss = self._offloaded_step(closure, scaling)
        record_step_for_lr_schedulers(self.optimizer)
        self._run_wrapped_step_hooks(pre=False)
        return loss

    def _run_wrapped_step_hooks(self, pre: bool) -> None:
        """The wrapped optimizer's own step hooks, once a step, as its `step()` would run
        them (its step runs per chunk without them: `step_without_hooks`); with overlap
        the post-hooks run as `step()` returns, and what they read waits for the update.
        Private API (torch 2.11, 2.13): an optimizer keeps them in
        `_optimizer_step_pre_hooks` and `_optimizer_step_post_hooks`."""
        inner = self.optimizer
        hooks = inner._optimizer_step_pre_hooks if pre else inner._optimizer_step_post_hooks
        for hook in list(hooks.values()):
            if hook(inner, (inner,), {}) is not None and pre:
                raise RuntimeError(
                    f"a step pre-hook of the wrapped {type(inner).__name__} returned new step() "
                    "arguments, which CPUOffloadOptimizer cannot pass on to the steps it runs "
                    "per chunk; register it on the wrapper (register_step_pre_hook)"
                )

    def _offloaded_step(
        self, closure: Callable[[], float] | None, scaling: Mapping[str, Any]
    ) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        streams = self._streams
        auto = self._auto
        if auto is not None:
            auto.step_started(streams.current())
        if self._overlap is not None:
            self._overlap.finish()  # the rest of an overlapped previous step
        self._take_replaced_state()
        if self._loaded_ahead and self._edited_since_loaded_ahead():
            # A state tensor held from an earlier step was edited in place after the
            # backward's loads (an edit through `state` has dropped them already).
            self._drop_loaded_ahead()
        if auto is not None and self._plan is not None:
            self._run_auto(auto)
        subset = self._subset.begin_subset_step()
        self._ensure_plan(subset, self._subset.state_layout)
        timed = self._auto is not None and self._auto.measuring
        if timed:
            self._auto.timer.step_started(streams.current())
        if self._overlap is not None:  # the next forward's waits: timed in measured steps only
            self._overlap.timer = self._auto.timer if timed else None
        self._steps += 1
        if self._ring is not None:
            # Allocated on the trainer's stream: the copy streams start after its work so far.
            self._acquire_slots()
            ready = streams.mark(streams.current())
            streams.wait(streams.h2d, ready)
            streams.wait(streams.d2h, ready)
        if self._overlap is None:
            # The trainer's stream runs the whole step: all of it is exposed.
            timer = self._auto.timer if timed else None
            before = timer.mark(streams.current()) if timed else None
            chunks = self._enqueue_chunks(subset, streams.current(), timed, scaling)
            for _ in self._interruptible(chunks):
                pass
            if timed:
                everything = sum(c.invariant_bytes for c in self._plan.chunks)
                after = timer.mark(streams.current())
                timer.waited(len(self._chunks) - 1, everything, before, after)
            return loss
        grads = [local_tensor(p.grad) for p in self._params if p.grad is not None]
        grads += [v for v in scaling.values() if isinstance(v, Tensor)]  # read as grads are
        state = self.optimizer.state
        # what the step updates in place besides the offloaded state (`step` counters)
        scalars = {
            p: [
                v
                for k, v in state[p].items()
                if isinstance(v, Tensor) and (p, k) not in self._homes
            ]
            for p in self._params
            if state.get(p)
        }
        # The pending chunks hold this optimizer weakly: its overlap holds them, and a
        # cycle through them would keep a dropped optimizer (its pending-read mode on the
        # trainer's stack, its pinned slabs) alive until the cycle collector ran.
        this = weakref.proxy(self)
        side = self._overlap.side_stream
        chunks = CPUOffloadOptimizer._enqueue_chunks(this, subset, side, timed, scaling)
        homes = [home.home_state for home in self._homes.values()]
        pending = CPUOffloadOptimizer._interruptible(this, chunks, side)
        self._overlap.start(pending, grads, scalars, homes)
        return loss

    def _enqueue_chunks(
        self,
        subset: SubsetStep,
        compute: torch.Stream | None,
        timed: bool,
        scaling: Mapping[str, Any],
    ) -> Iterator[None]:
        """Enqueue the step as its schedule says (`step_schedule`), yielding after each
        chunk's operations (lazily, when overlapped); each update sees `scaling`
        (`AMP_SCALING_ATTRIBUTES`) set on the wrapped optimizer."""
        streams, schedule = self._streams, self._schedule
        state = self.optimizer.state
        had_state = {p for p in self._params if state.get(p)}
        position = {c: k for k, c in enumerate(schedule.staged)}
        loaded: dict[int, bool] = {}  # chunk -> its state was copied in
        loaded_ahead, self._loaded_ahead = self._loaded_ahead, {}
        self._loaded_ahead_done = None
        self.chunks_loaded_in_backward = len(loaded_ahead)

        def run(op: str, c: int) -> None:
            chunk = self._chunks[c]
            if op == "load":
                done = loaded_ahead.get(position[c])
                loaded[c] = self._load(chunk, had_state, timed) if done is None else done
            elif op == "write_back":
                self._write_back(chunk, compute)
            else:
                self._step_chunks(subset, [c], compute, loaded, had_state, timed, scaling)

        # The chunks ready at the start (resident, or loaded in the backward; loaded here
        # if it did not, e.g. on the first step) update first, a few calls for all of them.
        for c in schedule.ready:
            if self._chunks[c].slot >= 0:
                run("load", c)
        for cs in self._update_groups(schedule.ready, had_state):
            self._step_chunks(subset, cs, compute, loaded, had_state, timed, scaling)
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
        self._step_done = streams.mark(streams.d2h)
        if self._ring is not None:
            self._ring.release([streams.h2d, streams.d2h, compute])

    def _update_groups(self, cs: Sequence[int], had_state: set[Tensor]) -> list[list[int]]:
        """Chunks `cs` (in order) cut into runs that can update in one call: a param's
        state is staged one chunk at a time (its entry points at that chunk's slice), so a
        run holds each param once; and while the step creates state, one chunk a run (a
        sliced param's slices each create their own, adopted after their call)."""
        groups: list[list[int]] = []
        seen: set[Tensor] = set()
        closed = True  # the last run takes no more chunks
        for c in cs:
            touched = self._chunks[c].touched
            creates = not all(p in had_state for p in touched)
            if closed or creates or any(p in seen for p in touched):
                groups.append([])
                seen = set()
            groups[-1].append(c)
            seen.update(touched)
            closed = creates
        return groups

    def _step_chunks(
        self,
        subset: SubsetStep,
        cs: Sequence[int],
        compute: torch.Stream | None,
        loaded: Mapping[int, bool],
        had_state: set[Tensor],
        timed: bool,
        scaling: Mapping[str, Any],
    ) -> None:
        """Enqueue chunks `cs`'s update on `compute` in one call of the subset step (it
        updates each unit on its own: the same bits as one call a chunk), from their
        staging slots (or resident homes), with GradScaler's `scaling` set on the wrapped
        optimizer for the call, as `GradScaler.step` sets it for an unwrapped one's."""
        streams, state = self._streams, self.optimizer.state
        chunks = [self._chunks[c] for c in cs]
        for chunk, c in zip(chunks, cs, strict=True):
            if chunk.slot >= 0:
                # A loaded slot was freed before its load; an unloaded one (state not
                # created yet) must still wait for its last write-back before the step
                # creates state into it.
                ready = streams.loaded if loaded.get(c, False) else streams.freed
                streams.wait(compute, ready[chunk.slot])
            for view in chunk.views:
                if view.param in had_state:
                    state[view.param][view.key] = view.staging_state
        params = [p for chunk in chunks for p in chunk.params]
        slices = [s for chunk in chunks for s in chunk.slices]
        with streams.on(compute), _attributes_set(self.optimizer, scaling):
            if slices:
                subset.step_slices(params, slices)
            else:
                subset.step_params(params)
            for chunk in chunks:
                self._adopt_new_state(chunk, had_state)
        for chunk, c in zip(chunks, cs, strict=True):
            if self._overlap is not None:
                streams.record(self._overlap.chunk_done[c], compute)
            if timed:
                self._auto.timer.chunk_done(compute)
            if chunk.slot >= 0:
                streams.record(streams.stepped[chunk.slot], compute)
            for view in chunk.views:
                if state.get(view.param):
                    state[view.param][view.key] = view.home.home_state

    def _interruptible(
        self, chunks: Iterator[None], compute: torch.Stream | None = None
    ) -> Iterator[None]:
        """`chunks` (the step's, enqueued on `compute`); if one raises (KeyboardInterrupt, an
        error in the update), the state goes home and the step is marked interrupted."""
        stepped = 0
        try:
            for _ in chunks:
                stepped += 1
                yield
        except GeneratorExit:  # dropped unfinished: the wrapper is being collected
            raise
        except BaseException as error:
            self._abandon_step(stepped, error, compute)
            raise

    def _abandon_step(
        self, stepped: int, error: BaseException, compute: torch.Stream | None
    ) -> None:
        """After a chunk raised: every state entry back in its home (the chunk's point into
        the staging ring), and the next `step()` refused: the step is partly applied, which
        cannot be finished exactly (the chunk that raised may have updated some of its
        params). The ring keeps its memory until a step ends or the optimizer goes: the
        error's traceback holds views of it, which a debugger or a test report reads (given
        back, they pointed at freed memory)."""
        state, streams = self.optimizer.state, self._streams
        for (param, key), home in self._homes.items():
            if key in state.get(param, ()):
                state[param][key] = home.home_state
        compute = compute if compute is not None else streams.current()
        streams.wait(streams.d2h, streams.mark(compute))
        self._step_done = streams.mark(streams.d2h)  # what reads the homes waits for this
        self._interrupted = (
            f"the last step() was interrupted by {type(error).__name__} after {stepped} of "
            f"{len(self._chunks)} chunks had stepped: their params and state are updated (and "
            "perhaps some of the later chunks'), the others' not, and that cannot be finished "
            "exactly. Restore the model and this optimizer from a checkpoint (load_state_dict "
            "clears this), or, to go on from here, close() this optimizer and wrap the inner "
            "one anew"
        )

    def _write_back(self, chunk: _Chunk, compute: torch.Stream | None) -> None:
        """Enqueue the D2H copy of a stepped chunk's state; an extra slot goes back to the
        allocator once it is done."""
        streams = self._streams
        with streams.on(streams.d2h):
            streams.wait(streams.d2h, streams.stepped[chunk.slot])
            for home, staging in chunk.copies:
                home.copy_(staging, non_blocking=True)
            streams.record(streams.freed[chunk.slot], streams.d2h)
        if chunk.slot >= self.staging_slots and self._ring is not None:
            # the backward's: not needed again this step (none held when nothing is staged)
            self._extra_slots[chunk.slot - self.staging_slots].release(
                [streams.h2d, streams.d2h, compute]
            )

    def _acquire_slots(self) -> None:
        """Allocate the ring and the backward's extra slots (those not held yet)."""
        self._ring.acquire()
        for slot in self._extra_slots:
            slot.acquire()

    def _backward_reached(self, passed: int, watched: int) -> None:
        """The backward passed the `passed`-th of `watched` owner modules (see
        `ForwardOverlap.backward_reached`)."""
        if self._auto is not None and self._auto.measuring:
            self._auto.timer.backward_started(self._streams.current())
        self._load_ahead(passed, watched)

    def _load_ahead(self, passed: int, watched: int) -> None:
        """From the backward (`load_in_backward`), as it passes the `passed`-th of the
        `watched` owner modules: load the state of the step's first staged chunks
        (`backward_load_bytes`), in step order, spread evenly over the modules before the
        last; the step then skips those loads.

        Spread, and each share started only once the device's backward gets there: copies
        the trainer makes (FSDP2 copies a small tensor to the GPU in each module's
        post-backward) queue in the copy engine behind ours, and loads enqueued all at once
        stalled the backward for as long as they took (`bench/trace_summary.py` shows it).

        Not while "auto" measures (everything offloaded, nothing loaded ahead) or before
        state exists.
        """
        if (
            self._ring is None
            or not self._load_in_backward
            or self._closed
            or self._overlap.pending_chunks
        ):
            return
        schedule = self._schedule
        staged = [self._chunks[c] for c in schedule.loaded_in_backward]
        loaded = len(self._loaded_ahead)
        share = backward_load_share(len(staged), passed, watched)
        if share <= loaded:
            return
        # Only this share's params: called once per module the backward passes, a look-up
        # of every param here made the backward's host time grow with params x modules.
        state = self.optimizer.state
        had_state = {p for c in staged[loaded:share] for p in c.touched if state.get(p)}
        if not had_state and not self._loaded_ahead:  # no state yet (the first step)
            return
        streams = self._streams
        with torch.no_grad():
            # Each chunk's own slot, allocated on the backward's stream (the loads start
            # after its work so far) as its share comes; the ring waits for `step()`.
            for chunk in staged[loaded:share]:
                self._extra_slots[chunk.slot - self.staging_slots].acquire()
            streams.wait(streams.h2d, streams.mark(streams.current()))
            if not loaded:
                self._loaded_ahead_versions = []
            for index in range(loaded, share):
                self._loaded_ahead[index] = self._load(staged[index], had_state)
                self._loaded_ahead_versions += _state_versions(staged[index])
        self._loaded_ahead_done = streams.mark(streams.h2d)

    def _edited_since_loaded_ahead(self) -> bool:
        """Whether state the backward loaded was edited in place since (by torch ops)."""
        staged = self._schedule.loaded_in_backward
        now = [v for i in self._loaded_ahead for v in _state_versions(self._chunks[staged[i]])]
        return now != self._loaded_ahead_versions

    def _drop_loaded_ahead(self) -> None:
        """Forget chunks loaded in the backward (their homes are about to change)."""
        if self._loaded_ahead_done is not None:
            self._loaded_ahead_done.synchronize()
        self._loaded_ahead, self._loaded_ahead_done = {}, None

    def _load(self, chunk: _Chunk, had_state: set[Tensor], timed: bool = False) -> bool:
        """Enqueue the H2D copy of a chunk's state, unless none of its params has state yet."""
        if not any(p in had_state for p in chunk.touched):
            return False
        streams = self._streams
        with streams.on(streams.h2d):
            # The slot's previous chunk must be written back before it is overwritten.
            streams.wait(streams.h2d, streams.freed[chunk.slot])
            timer = self._auto.timer if timed else None
            before = timer.mark(streams.h2d) if timed else None
            for home, staging in chunk.copies:
                staging.copy_(home, non_blocking=True)
            if timed:
                timer.loaded(chunk.invariant_bytes, before, timer.mark(streams.h2d))
            streams.record(streams.loaded[chunk.slot], streams.h2d)
        return True

    def _adopt_new_state(self, chunk: _Chunk, had_state: set[Tensor]) -> None:
        """State the step just created goes into the chunk's staging slot, then home."""
        state = self.optimizer.state
        for view in chunk.views:
            param, key = view.param, view.key
            if param in had_state or not state.get(param):
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

    # -- planning and allocation --------------------------------------------------------

    def _ensure_plan(self, subset: SubsetStep, layout: Callable[[Tensor], StateLayout]) -> None:
        index = {p: i for i, p in enumerate(self._params)}
        units = subset.units
        if self._overlap is not None:
            # Chunks in the order the forward needs them (stable, so the same on every rank).
            units = self._overlap.forward_order(units)
        units_key = tuple(tuple(index[p] for p in unit) for unit in units)
        # A sparse grad (nn.Embedding(sparse=True)) has no flat slices: its param steps whole,
        # from the first step it shows one on (re-planned then, once: it stays whole).
        sparse = {p for p in self._params if p.grad is not None and p.grad.is_sparse}
        self._stepped_whole |= sparse
        if self._plan is not None:
            if units_key != self._units_key:
                raise RuntimeError("the optimizer's units changed between steps; re-wrap it")
            # Planned anew for a sparse grad on a sliced param, for state a step created
            # after the first without a home (SGD's momentum_buffer, momentum turned on):
            # it lives in the host slabs as any other from this step, and after a loaded
            # state_dict, whose options may keep other state (amsgrad off).
            resplit = any(self._specs[index[p]].splittable for p in sparse)
            loaded, self._state_loaded = self._state_loaded, False
            if not resplit and not loaded and not self._unhomed_state():
                return
        specs = self._specs_of(subset, layout)
        if self._plan is not None:
            if specs == self._specs:  # unhomed state the step does not keep (set by hand)
                return
            self.wait_for_optimizer_step()  # the new homes copy the old ones
            self._drop_loaded_ahead()
            if self._host_room_for_all:  # one host layout: the old GPU state goes home first
                self._give_back_gpu_state()
        first_plan = self._plan is None
        self._specs = specs
        self._build(self._plan_for(units_key), units_key)
        if first_plan and self._auto is None:
            self._warn_if_nothing_resident(units_key)

    def _warn_if_nothing_resident(self, units_key: tuple[tuple[int, ...], ...]) -> None:
        """A `gpu_resident_bytes` too small for the first unit residency takes keeps nothing."""
        if self._resident_budget == 0 or self._plan.resident_bytes > 0:
            return
        sizes = [u.bytes for u in unit_sizes(units_key, self._specs) if u.bytes > 0]
        if not sizes:
            return
        first = sizes[0] if self._overlap is not None else sizes[-1]
        which = "the forward needs first" if self._overlap is not None else "steps last"
        warnings.warn(
            f"gpu_resident_bytes={self._resident_budget} keeps no state on the GPU: residency "
            f"takes whole units, from the one {which}, whose state is {first} bytes on its "
            f"own. Give at least that, or 0",
            stacklevel=_user_stacklevel(),
        )

    def _specs_of(
        self, subset: SubsetStep, layout: Callable[[Tensor], StateLayout]
    ) -> list[ParamSpec]:
        """What planning needs of each param, from the state `layout` says it keeps."""
        splits = isinstance(subset, SlicingSubsetStep)
        specs = []
        for p in self._params:
            state = tuple(StateSpec(k, torch.Size(s), d) for k, (s, d) in layout(p).items())
            local = local_tensor(p)
            splittable = (
                splits
                and p not in self._stepped_whole
                and bool(state)
                and local.is_contiguous()
                and all(s.shape == local.shape for s in state)
            )
            specs.append(ParamSpec(invariant_numel(p), state, splittable))
        return specs

    def _plan_for(
        self, units_key: tuple[tuple[int, ...], ...], split: Split | None = None
    ) -> OffloadPlan:
        """The plan of the current budget, or of `split`'s (as `_replan` would run it)."""
        resident, backward = self._resident_budget, self._load_in_backward
        if split is not None:
            resident = split.resident_bytes
            backward = split.backward_load_bytes > 0 or self._insist_on_backward_loads
        return plan_offload(
            units_key,
            self._specs,
            self.chunk_bytes,
            resident_bytes=resident,
            resident_first=self._overlap is not None,
            # The first chunks load in the backward: full ones fill the ring.
            ramp_first=not backward,
            host_room_for_all=self._host_room_for_all,
        )

    def _held_bytes(self, split: Split) -> int:
        """GPU bytes for state the plan of `split` holds at most: its resident state, the
        ring and the backward's extra slots (held together from `step()` on)."""
        plan = self._plan_for(self._units_key, split)
        loads = 0
        if self._overlap is not None and (
            split.backward_load_bytes > 0 or self._insist_on_backward_loads
        ):
            loads = self._backward_loads(plan, None, split.backward_load_bytes or None)  # bytes
        return self._held_with_loads(plan, loads)

    def _held_with_loads(self, plan: OffloadPlan, loads: int) -> int:
        """GPU bytes for state `plan` holds at most with `loads` chunks loaded in the
        backward (its schedule's resident state, ring and extra slots)."""
        staged = [not c.resident for c in plan.chunks]
        schedule = plan_step(staged, self.staging_slots, loads, overlap=self._overlap is not None)
        return plan.held_bytes(schedule.slots, self.staging_slots)

    def _backward_loads(
        self, plan: OffloadPlan, first_wait: Sequence[int] | None, budget: int | None
    ) -> int:
        """How many of `plan`'s first staged chunks the backward loads (`chosen_backward_loads`:
        the chunks holding `first_wait`, or `budget` bytes of them)."""
        return chosen_backward_loads(
            [(*c.params, *(s.param for s in c.slices)) for c in plan.chunks],
            [c.invariant_bytes for c in plan.chunks],
            [not c.resident for c in plan.chunks],
            self.staging_slots,
            first_wait=first_wait,
            budget=budget,
        )

    def _first_wait_loads(self, plan: OffloadPlan) -> int:
        """How many of `plan`'s first staged chunks the default backward loads (forward
        overlap without "auto"): those holding what the forward first waits for, and more
        while the step holds no more than its share of the room under the measured peak."""
        index = {p: i for i, p in enumerate(self._params)}
        first = [index[p] for p in self._overlap.first_wait(index)]
        loads = self._backward_loads(plan, first, None)
        room = self._room_for_state()
        if room is not None:
            held = functools.partial(self._held_with_loads, plan)
            staged = sum(not c.resident for c in plan.chunks)
            loads = loads_within_room(loads, staged, self.staging_slots, held, room)
        return loads

    def _default_backward_bytes(self) -> int:
        """What the backward loads without "auto" (`_first_wait_loads`, of the plan with
        nothing resident, the room under the peak measured now), for "auto" to try."""
        plan = self._plan_for(self._units_key, Split(0, 1))  # any bytes: it loads
        staged = [c for c in plan.chunks if not c.resident]
        return sum(c.invariant_bytes for c in staged[: self._first_wait_loads(plan)])

    def _room_for_state(self) -> int | None:
        """What the step's state may hold on the device without raising its peak: the
        share of the room under the peak the default's backward loads fill (None off
        CUDA)."""
        room = self._room_under_peak
        return None if room is None else int(BACKWARD_ROOM_SHARE * room)

    def _run_auto(self, auto: AutoResidency) -> None:
        """ "auto"'s decision at this step: re-plan with the split it returns (the host
        waits here for the last step, as for a checkpoint); once it has settled, say
        what it chose."""
        plan = self._plan
        shape = StepShape(
            tuple(c.invariant_bytes for c in plan.chunks),
            tuple(u.bytes for u in unit_sizes(self._units_key, self._specs)),
            self._overlap is not None,
        )
        # The ring was held at the measured peak: it is the optimizer's to hold again.
        ring = plan.ring_bytes(self._schedule.slots, self.staging_slots)
        split = auto.decide(
            shape,
            self._held_bytes,
            lambda: device_headroom_bytes(self.device) + ring,
            self._default_backward_bytes,
            self._room_for_state,
        )
        settled = auto.choice
        if (
            split is None
            and settled is not None
            and self._load_in_backward
            != (
                self._overlap is not None
                and (settled.backward_load_bytes > 0 or self._insist_on_backward_loads)
            )
        ):  # measured without backward loads; the choice keeps nothing more but loads
            split = Split(settled.resident_bytes, settled.backward_load_bytes)
        if split is not None:
            ran = Split(self._resident_budget, self._backward_loads_chosen())
            try:
                self._replan(split, auto.failed_ranks)
            except BaseException:
                auto.settle_on(ran)  # the state is home; the next step plans `ran` again
                self._say_what_auto_chose(auto.choice)
                raise
        if settled is not None:
            self._say_what_auto_chose(settled)

    def _backward_loads_chosen(self) -> int:
        return (self.backward_load_bytes or 0) if self._load_in_backward else 0

    def _say_what_auto_chose(self, choice: ResidencyChoice) -> None:
        self._auto = None
        self.residency = choice
        self.gpu_resident_bytes = choice.resident_bytes
        probes = "; ".join(
            f"{p.split.resident_bytes / 2**30:.2f}+{p.split.backward_load_bytes / 2**30:.2f} GiB "
            f"{p.iteration_ms:.1f} ms (+-{p.error_ms:.1f})"
            for p in choice.probes
        )
        logger.info(
            "gpu_resident_bytes='auto' chose %d bytes (%d units) resident and %d loaded in "
            "the backward, of %d bytes of state, within a budget of %d bytes of GPU memory "
            "(the host slabs keep room for all the state); the trainer stalled %.1f ms a "
            "step for the offloaded step, predicted %.1f ms with this choice%s",
            choice.resident_bytes,
            choice.resident_units,
            choice.backward_load_bytes,
            choice.state_bytes,
            choice.budget_bytes,
            choice.measured_stall_ms,
            choice.predicted_stall_ms,
            f"; steps tried (resident+backward: iteration): {probes}" if probes else "",
        )
        if choice.checked is not None:
            logger.info(
                "gpu_resident_bytes='auto': the split its search settled on ran %.1f ms a "
                "step over the next steps (the search measured %.1f ms)",
                choice.checked.iteration_ms,
                next(
                    (p.iteration_ms for p in choice.probes if p.split == choice.checked.split),
                    float("nan"),
                ),
            )

    def _replan(self, split: Split, failed_ranks: Callable[[bool], list[int]]) -> None:
        """Run from this step with `split` kept off the forward's path (host slabs kept).

        Every rank re-plans at this step, and `failed_ranks(failed here)` says on which it
        failed: if on any, every rank goes back to what ran before (the state in its host
        homes, planned anew at the next step) and raises, so no rank steps alone (its peers
        would wait for it in the next collective, or step params it did not)."""
        self.wait_for_optimizer_step()
        self._drop_loaded_ahead()
        self._give_back_gpu_state()
        ran = (self._resident_budget, self._load_in_backward, self.backward_load_bytes)
        self._resident_budget = split.resident_bytes
        if self._overlap is not None:
            backward = split.backward_load_bytes
            self._load_in_backward = backward > 0 or self._insist_on_backward_loads
            self.backward_load_bytes = backward if backward > 0 else None
        error: Exception | None = None
        try:
            self._build(self._plan_for(self._units_key, split), self._units_key)
        except Exception as err:
            error = err
        except BaseException:  # an interrupt: no agreeing with peers, which stop too
            self._forget_plan(ran)
            raise
        failed = failed_ranks(error is not None)
        if not failed:
            return
        if error is None:
            self._give_back_gpu_state()
        self._forget_plan(ran)
        if error is not None:
            raise error
        raise RuntimeError(
            f"gpu_resident_bytes='auto': re-planning to {split.resident_bytes} bytes resident "
            f"and {split.backward_load_bytes} loaded in the backward failed on rank(s) "
            f"{failed}, so no rank ran this step; every rank steps what ran before from the "
            "next step (see the failing rank's error)"
        )

    def _forget_plan(self, ran: tuple[int, bool, int | None]) -> None:
        """After a re-plan that failed (here or on a peer), with the state in its host
        homes: the options that ran before, planned anew at the next step, and what the
        failed plan allocated goes now."""
        self._resident_budget, self._load_in_backward, self.backward_load_bytes = ran
        self._plan, self._resident_slabs = None, {}
        self._ring, self._extra_slots = None, []

    def _give_back_gpu_state(self) -> None:
        """Before a re-plan within one host layout: resident state to its room in the host
        slabs, and the ring and the backward's slots dropped, so the new plan's GPU memory
        is not allocated beside the old's (the budget holds one plan, not two)."""
        state = self.optimizer.state
        resident = {(v.param, v.key) for c in self._chunks if c.slot < 0 for v in c.views}
        everything_home = plan_offload(
            self._units_key, self._specs, self.chunk_bytes, host_room_for_all=True
        )
        for layout in everything_home.chunks:
            for view in layout.views:
                param, spec = self._params[view.param], view.spec
                entries = state.get(param)
                if (param, spec.key) not in resident or not entries or spec.key not in entries:
                    continue
                resident.discard((param, spec.key))  # a sliced tensor has a view per chunk
                slab = self._host_slabs[spec.dtype][view.home_offset :][: spec.numel]
                host = _carve(slab, spec.shape, param)
                host.copy_(local_tensor(entries[spec.key]))
                entries[spec.key] = _as_state(param, host)
        for slots in (self._ring, *self._extra_slots):
            if slots is not None:
                slots.release([])
        self._chunks, self._homes, self._resident_slabs = [], {}, {}
        self._ring, self._extra_slots = None, []

    # Normal tensors whatever mode `step()` runs in: the backward, outside it, loads them.
    @torch.inference_mode(False)
    def _build(
        self, plan: OffloadPlan, units_key: tuple[tuple[int, ...], ...], ring: bool = True
    ) -> None:
        """Allocate slabs and the ring, carve views, and move any existing state home.

        The serial path stages all state per step instead of through the ring, so
        without `ring` the staging buffers live on the meta device and take no memory.
        """
        slot_bytes = plan.staging_bytes(1)
        if ring and slot_bytes > max(2 * self.chunk_bytes, OVERSIZED_UNIT_WARN_BYTES):
            mib = 2**20
            warnings.warn(
                f"a unit of the wrapped optimizer holds {slot_bytes / mib:.0f} MiB of state, "
                f"more than chunk_bytes ({self.chunk_bytes / mib:.0f} MiB), and it cannot be "
                f"split: the GPU staging ring takes {self.staging_slots} x "
                f"{slot_bytes / mib:.0f} MiB. Give the optimizer smaller units (muon.Muon: "
                f"bucket_cap_bytes; muon_offload.setup_optimizer caps it for you) or raise "
                f"chunk_bytes.",
                stacklevel=_user_stacklevel(),
            )
        kept = {dtype: slab.numel() for dtype, slab in self._host_slabs.items()}
        if not (self._host_room_for_all and kept == dict(plan.host_numel)):
            # (with room for all, every plan has one host layout: the slabs stay)
            self._host_slabs = allocate_host_slabs(plan.host_numel, self.device)
        self._resident_slabs = {
            dtype: torch.zeros(n, dtype=dtype, device=self.device)
            for dtype, n in plan.resident_numel.items()
        }
        staged = [c for c in plan.chunks if not c.resident]
        loads = 0
        if ring and self._load_in_backward:
            if self._load_first_wait:
                loads = self._first_wait_loads(plan)
                self.backward_load_bytes = sum(c.invariant_bytes for c in staged[:loads])
            else:
                loads = self._backward_loads(plan, None, self.backward_load_bytes)
        schedule = plan_step(
            [not c.resident for c in plan.chunks],
            self.staging_slots,
            loads,
            overlap=self._overlap is not None,
        )
        ring_numel = plan.ring_slot_numel(schedule.slots, self.staging_slots)
        staging_numel = {dtype: schedule.ring_slots_taken * n for dtype, n in ring_numel.items()}
        self._streams.ensure_slots(self.staging_slots + schedule.extra_slots)
        if ring:
            self._ring = _StagingRing(staging_numel, self.device)
            # An extra slot holds one chunk: sized for it, not for the largest.
            self._extra_slots = [
                _StagingRing(chunk.staging_numel, self.device)
                for chunk, slot in zip(plan.chunks, schedule.slots, strict=True)
                if slot >= self.staging_slots
            ]
            staging_buffers = self._ring.buffers
        else:
            staging_buffers = {
                dtype: torch.empty(n, dtype=dtype, device="meta")
                for dtype, n in staging_numel.items()
            }
        self._schedule = schedule

        def slot_buffer(dtype: torch.dtype, slot: int) -> Tensor:
            """A slot's staging memory for `dtype` (a slice of the ring, or an extra slot)."""
            if slot >= self.staging_slots:
                return self._extra_slots[slot - self.staging_slots].buffers[dtype]
            return staging_buffers[dtype][slot * ring_numel[dtype] :][: ring_numel[dtype]]

        homes: dict[tuple[Tensor, str], _Home] = {}
        chunks = []
        for layout, slot in zip(plan.chunks, schedule.slots, strict=True):
            slabs = self._resident_slabs if layout.resident else self._host_slabs
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
                spec, param = view.spec, self._params[view.param]
                home = homes.get((param, spec.key))
                if home is None:
                    h = _carve(
                        slabs[spec.dtype][view.home_offset :][: spec.numel], spec.shape, param
                    )
                    home = homes[param, spec.key] = _Home(h, _as_state(param, h))
                if layout.resident:
                    staging = home.home if not view.sliced else home.home.view(-1)
                    staging = staging[view.start : view.stop] if view.sliced else staging
                elif view.stop == view.start:  # nothing of it on this rank: no slot space
                    staging = torch.empty(view.shape, dtype=spec.dtype, device=self.device)
                else:
                    staging = slot_buffer(spec.dtype, slot)[view.staging_offset :]
                    staging = _carve(staging[: view.stop - view.start], view.shape, param)
                staging_state = staging if view.sliced else _as_state(param, staging)
                views.append(_View(param, spec.key, home, staging, staging_state))
            chunks.append(
                _Chunk(
                    [self._params[i] for i in layout.params],
                    [ParamSlice(self._params[s.param], s.start, s.stop) for s in layout.slices],
                    slot,
                    layout.invariant_bytes,
                    copies,
                    views,
                )
            )
        self._plan, self._units_key, self._chunks, self._homes = plan, units_key, chunks, homes
        if self._overlap is not None:
            self._overlap.set_chunks(
                [chunk.touched for chunk in chunks], self._unit_ends(units_key), schedule
            )
        if ring and not plan.slot_numel:
            self._ring, self._extra_slots = None, []  # no state staged: no staging memory
        state = self.optimizer.state
        for (param, key), home in homes.items():
            entries = state.get(param)
            if entries and key in entries:
                current = local_tensor(entries[key])
                if current.data_ptr() != home.home.data_ptr() or current.device != home.home.device:
                    home.home.copy_(current)
                entries[key] = home.home_state
        if self._ring is not None:
            for slots in (self._ring, *self._extra_slots):
                slots.release([])  # acquired again at the start of each step

    def _unit_ends(self, units_key: tuple[tuple[int, ...], ...]) -> dict[Tensor, int]:
        """Where each param's unit ends in the step: its state bytes and all before it."""
        ends = itertools.accumulate(u.bytes for u in unit_sizes(units_key, self._specs))
        return {
            self._params[i]: end for unit, end in zip(units_key, ends, strict=True) for i in unit
        }

    @functools.cached_property
    def _room_under_peak(self) -> int | None:
        """The device's room under its peak when the first plan is built (`step()` after
        the first backward), the least over the default process group's ranks (their
        schedules must agree: one collective); None where unknown (off CUDA). Measured
        once: later plans hold state of their own."""
        room = room_under_peak_bytes(self.device)
        if room is not None and dist.is_available() and dist.is_initialized():
            least = torch.tensor([room], dtype=torch.int64, device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            room = int(least.item())
        return room

    def _host_views(self) -> dict[tuple[Tensor, str], _Home]:
        return self._homes

    # -- serial path --------------------------------------------------------------------

    def _serial_step(
        self, closure: Callable[[], float] | None, scaling: Mapping[str, Any]
    ) -> float | None:
        """All state in, step (with the closure, and GradScaler's `scaling` set on the
        optimizer), all state out, on the current stream.

        Its layout is learned from the state the optimizer creates, so the slabs are
        (re)built after a step that created state for a param: the first step, and
        any step where a param gets its first grad. The host's memory for them is
        checked before that step, from a dry run, where the optimizer allows one.
        """
        if self._plan is None and self._unhomed_state():  # loaded before the first step
            self._build_serial_plan()
        self._take_replaced_state()
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
                if not state.get(param):  # its state started afresh (`del opt.state[p]`)
                    continue
                s = staging[spec.dtype][view.staging_offset :][: spec.numel]
                s = _carve(s, spec.shape, param)
                home = self._homes[param, spec.key]
                s.copy_(home.home, non_blocking=True)
                state[param][spec.key] = _as_state(param, s)
                staged.append((param, spec.key, home))
        try:
            with _attributes_set(self.optimizer, scaling):
                loss = step_without_hooks(self.optimizer, closure)
        finally:  # interrupted too: the state goes home as the step left it, as plain torch's
            self._serial_write_back(staged)
        return loss

    def _serial_write_back(self, staged: list[tuple[Tensor, str, _Home]]) -> None:
        """Copy the staged state home, and move home state the step created on the device."""
        state = self.optimizer.state
        for param, key, home in staged:
            # The step may have replaced the tensor rather than updated it (LBFGS's "d").
            h = home.home
            now = local_tensor(state[param][key])
            if now.shape != h.shape or now.dtype != h.dtype:
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} changed state {key!r} of param "
                    f"{_position(self._params, param)} from {tuple(h.shape)} {h.dtype} to "
                    f"{tuple(now.shape)} {now.dtype}; its state cannot live in fixed host slabs"
                )
            h.copy_(now, non_blocking=True)
            state[param][key] = home.home_state
        if self._unhomed_state():  # created on the device by this step: move it home
            self._build_serial_plan()
        if self._streams.async_copies:
            self._step_done = self._streams.mark(self._streams.current())

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


def _state_versions(chunk: _Chunk) -> list[int]:
    """The version counters of `chunk`'s state at home. An in-place torch op on a home bumps
    its slab's (shared by the slab's views); one on a DTensor state only the wrapper's (its
    local op runs below the counting). `Tensor._version` is private: the one place it is
    read (torch 2.11 and 2.13 checked)."""
    return [t._version for view in chunk.views for t in (view.home.home, view.home.home_state)]


def _remove_handles(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def _nothing(*args: Any) -> None:
    pass


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
