"""CPUOffloadOptimizer: optimizer state in host memory, streamed through the GPU.

The optimizer's surface (torch's `Optimizer` API, checks, checkpoints) and its choices:
each step's plan (`step_plan`: chunks, residency, the backward's loads, the schedule),
built once and re-planned only when "auto" decides or the state changes. Running a plan
(slabs, the staging ring, copies and updates on side streams) is `executor.StepExecutor`;
running the chunks as the next forward reaches them is `forward_overlap.ForwardOverlap`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from offload.auto_residency import (
    AutoResidency,
    StepShape,
    agree_across_ranks,
    failed_ranks,
    has_peers,
)
from offload.backward_tuning import BackwardTuning, TuningRound
from offload.chunk_plan import (
    OffloadPlan,
    ParamSpec,
    StateSpec,
    plan_offload,
    resident_in_both,
    unit_sizes,
)
from offload.executor import StepExecutor, as_state, attributes_set
from offload.forward_overlap import ForwardOverlap, user_stacklevel
from offload.host_memory import (
    check_device_memory,
    check_host_memory,
    device_headroom_bytes,
    room_under_peak_bytes,
)
from offload.options import check_offload_options
from offload.residency import ResidencyChoice, Split, StepTimer
from offload.state_estimate import dry_run_state_bytes
from offload.step_plan import BackwardLoads, OffloadedStep, plan_offloaded_step
from offload.step_schedule import StepSchedule
from offload.streams import CopyStreams
from offload.subset_step import (
    PER_PARAM_OPTIMIZERS,
    GroupSubsetStep,
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
_NOT_AGREEING = 2**62
"""What a rank whose backward loads "auto" chooses (or none) sends to `_least_backward_loads`."""
_T = TypeVar("_T")

DEFAULT_CHUNK_BYTES = 256 * 2**20  # bench/offload_step.py: 1.03x the copy floor with 4 slots
DEFAULT_STAGING_SLOTS = 4  # 4 measured 3-7% faster than 3 at every chunk size
BACKWARD_ROOM_SHARE = 0.9
"""By default, with overlap, the backward loads more than the chunks the forward first
waits for while the plan holds at most this share of the room under the device's peak
(`room_under_peak_bytes`): the activations are not given back evenly over the backward."""


def shard_count(param: Tensor) -> int:
    """Mesh ranks a DTensor param is sharded over (1 for a plain tensor). A placement that
    shards names a tensor dim: `Shard`, and the strided shard FSDP2 makes over another
    sharding of a dim (torch's private `_StridedShard`, no `Shard` on torch 2.13)."""
    placements = getattr(param, "placements", ())
    mesh = getattr(param, "device_mesh", None)
    return math.prod(
        mesh.size(d) for d, pl in enumerate(placements) if isinstance(getattr(pl, "dim", None), int)
    )


def invariant_numel(param: Tensor) -> int:
    """Global numel / number of shards: a size every rank computes the same."""
    return param.numel() // shard_count(param) if hasattr(param, "placements") else param.numel()


def _check_state_shape(
    param: Any, key: str, value: Tensor | None, expected: torch.Size, fix: str
) -> None:
    """Refuse a state tensor (loaded, or assigned by hand) not shaped as the step keeps it:
    copied into its home, a broadcastable one would fill it silently. A None (not dropped
    as absent, `_forget_none_state`: an optimizer of its own) is refused by name."""
    if value is None:
        raise ValueError(
            f"state {key!r} of param {param} is None where the step keeps a tensor; assign a "
            "tensor, or start the param's state afresh (del opt.state[param])"
        )
    shape = local_tensor(value).shape
    if shape != expected:
        raise ValueError(
            f"state {key!r} of param {param} has shape {tuple(shape)}, expected "
            f"{tuple(expected)} ({fix})"
        )


ACCEPTED = "offload plan accepted"
"""The name of the outcome `_refused_on_every_rank` agrees on."""


def _refusals_agreed(settings: Sequence[tuple[str, Any]], device: torch.device) -> None:
    """The agreement of an overlapped wrapper whose chunks do not communicate (AdamW under
    FSDP2) but whose first plan does (`_least_backward_loads`): only whether a rank refused
    the step (`ACCEPTED`). Its ranks may plan other chunks; a rank that refused alone left
    its peers waiting in the plan's collective, and its next step paired with their
    waiting one, so they ran a step it did not."""
    refused = any(name == ACCEPTED and value != "yes" for name, value in settings)
    flags = torch.tensor([float(refused)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags.item() and not refused:
        raise ValueError(
            "another rank refused this offloaded step (see its error there), so no rank ran "
            "it; mend that rank's cause, then every rank steps again"
        )


def _refused_on_every_rank(
    agree: Callable[[Sequence[tuple[str, Any]]], None] | None,
    settings: Sequence[tuple[str, Any]],
    work: Callable[[], _T],
) -> _T:
    """`work()`, whose error (this rank's grads, state or settings refused) is raised on
    every rank `agree` runs over, with `settings` checked alike: a rank that raised alone
    would leave its peers waiting in the next agreement, or the exchanges. No agreement
    where `agree` is None, nor after an error raised on every rank at once (one with
    `raised_on_every_rank`, as distributed Muon's own plan agreement raises): a peer that
    raised it outside a wrapper (not offloaded there) joins no agreement after it."""
    if agree is None:
        return work()
    refused = None
    try:
        result = work()
    except Exception as error:
        if getattr(error, "raised_on_every_rank", False):
            raise
        refused = error
    outcome = (ACCEPTED, "no, see the error on that rank" if refused else "yes")
    try:
        agree((*settings, outcome))
    except ValueError:
        if refused is None:
            raise
    if refused is not None:  # this rank's own error, whatever its peers said
        raise refused
    return result


def _placed_as(value: Tensor, param: Tensor, name: str) -> Tensor:
    """A loaded state tensor placed as its param, whose homes hold its local shard: a
    whole plain tensor for a sharded param (a single-process checkpoint loaded on every
    rank, as `muon.Muon` takes it) cut to this rank's shard, a DTensor placed otherwise
    (the model sharded another way since the save) redistributed, a DTensor for a plain
    param gathered; one on another mesh refused. `muon.Muon`'s load places its state
    alike (the packages import nothing of each other)."""
    if not isinstance(param, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if not isinstance(value, DTensor):
        if value.shape != param.shape:
            return value  # a local shard, or a shape the shape check names
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    if value.device_mesh != param.device_mesh:
        raise ValueError(
            f"{name} is a DTensor on {value.device_mesh} but the param is on "
            f"{param.device_mesh}; load a full (unsharded) state dict, or save and load with "
            "torch.distributed.checkpoint, which reshards"
        )
    if value.placements != param.placements:
        return value.redistribute(param.device_mesh, param.placements)
    return value


def _byte_span(tensor: Tensor) -> tuple[int, int]:
    """The first byte `tensor` reaches and one past its last."""
    first = tensor.data_ptr()
    shape = zip(tensor.shape, tensor.stride(), strict=True)
    reach = sum((size - 1) * stride for size, stride in shape)
    return first, first + (reach + 1) * tensor.element_size()


def _dense(tensor: Tensor) -> bool:
    """Whether `tensor`'s elements fill its span once each (contiguous in some dim order)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda d: d[1]):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _overlapping_spans(named: Sequence[tuple[str, Tensor]]) -> list[list[tuple[str, Tensor]]]:
    """`named` tensors (numel > 0) in groups whose byte spans overlap, chained, one device
    each; groups of one left out."""
    spans = sorted(
        ((str(t.device), *_byte_span(t), name, t) for name, t in named if t.numel()),
        key=lambda span: span[:4],
    )
    clusters: list[list[tuple[str, Tensor]]] = []
    reach: tuple[str, int] | None = None
    for device, start, end, name, t in spans:
        if reach is None or reach[0] != device or start >= reach[1]:
            clusters.append([])
            reach = (device, end)
        reach = (device, max(reach[1], end))
        clusters[-1].append((name, t))
    return [cluster for cluster in clusters if len(cluster) > 1]


def _check_cluster_apart(
    cluster: Sequence[tuple[str, Tensor]], refuse: Callable[[str, str], None]
) -> None:
    """Call `refuse(a, b)` for tensors of `cluster` that share a byte: dense ones by their
    spans, strided views (`W[:, :4]`) by their bytes, sorted once for the whole cluster."""
    dense = [(n, t) for n, t in cluster if _dense(t)]
    strided = [(n, t) for n, t in cluster if not _dense(t)]
    for (a, t), (b, u) in itertools.combinations(dense, 2):
        (t_first, t_end), (u_first, u_end) = _byte_span(t), _byte_span(u)
        if t_first < u_end and u_first < t_end:
            refuse(b, a)
    if not strided:
        return
    addresses = torch.cat([_bytes_of(t) for _, t in strided])
    owners = torch.cat(
        [
            torch.full((t.numel() * t.element_size(),), i, device="cpu")
            for i, (_, t) in enumerate(strided)
        ]
    )
    addresses, order = addresses.sort()
    owners = owners[order]
    same = (addresses[1:] == addresses[:-1]) & (owners[1:] != owners[:-1])
    for i, j in {(int(owners[k]), int(owners[k + 1])) for k in same.nonzero().flatten()}:
        refuse(strided[j][0], strided[i][0])
    for name, t in dense:
        first, end = _byte_span(t)
        lo, hi = torch.searchsorted(addresses, torch.tensor([first, end], device="cpu")).tolist()
        for i in owners[lo:hi].unique().tolist():
            refuse(strided[i][0], name)


CPU_GRAIN_ELEMENTS = 32768
"""torch's CPU elementwise ops (TensorIterator) split a tensor of more elements than this
between threads, each share ending in a scalar tail (`at::internal::GRAIN_SIZE`; torch
2.11, 2.13)."""


def _sliceable(
    param: Tensor, state: Sequence[tuple[torch.Size, torch.dtype]], slices: bool
) -> bool:
    """Whether a step that `slices` params may cut `param` into slices: it keeps state, all
    shaped like the param, whose local shard is contiguous (a slice is a run of memory).
    Not a 16-bit float one whose largest shard holds over `CPU_GRAIN_ELEMENTS` on the CPU
    (the largest: every rank cuts the same chunks): there the threads' shares of the whole
    tensor end in scalar tails that round 16-bit math after each operation, where the
    vectorized body keeps fp32 between them, so a slice, split elsewhere, gave other bits."""
    local = local_tensor(param)
    half = any(d in (torch.bfloat16, torch.float16) for d in (local.dtype, *(d for _, d in state)))
    shards = shard_count(param) if hasattr(param, "placements") else 1
    largest_shard = -(-param.numel() // shards)
    return (
        slices
        and bool(state)
        and local.is_contiguous()
        and all(shape == local.shape for shape, _ in state)
        and not (local.device.type == "cpu" and half and largest_shard > CPU_GRAIN_ELEMENTS)
    )


def _without_subset_step(optimizer: torch.optim.Optimizer) -> str:
    """Why `optimizer` has no subset step, for a refusal that needs one."""
    name = type(optimizer).__name__
    base = next((c for c in PER_PARAM_OPTIMIZERS if isinstance(optimizer, c)), None)
    protocol = (
        "give it begin_subset_step() (returning the step's units and step_params) and "
        "state_layout(): docs/design.md, the subset-step protocol"
    )
    if base is None:
        return f"{name} has none ({protocol})"
    return (
        f"{name} has none: it subclasses torch's {base.__name__}, but the chunked step "
        f"adapts torch's classes themselves, as it never calls a subclass's step(), which "
        f"may do more. Wrap the {base.__name__} itself (what the subclass adds to step() "
        f"can go in a step pre- or post-hook), or {protocol}"
    )


def _bytes_of(tensor: Tensor) -> Tensor:
    """The address of every byte `tensor`'s elements hold, on the CPU."""
    starts = torch.full((), tensor.data_ptr(), dtype=torch.int64, device="cpu")
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
        shape = [1] * tensor.ndim
        shape[dim] = size
        offsets = torch.arange(size, device="cpu") * stride * tensor.element_size()
        starts = starts + offsets.view(shape)
    return (starts.reshape(-1, 1) + torch.arange(tensor.element_size(), device="cpu")).reshape(-1)


_OPTIMIZER_HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The hook registries `torch.optim.Optimizer.__init__` sets on an optimizer, which the
wrapper registers hooks on and runs. Private API (torch 2.11, 2.13)."""


def _refuse_not_set_up(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that `torch.optim.Optimizer.__init__` never set up (a wrapper of
    another optimizer sharing its groups, which skips it): it has no hook registries
    (`_OPTIMIZER_HOOK_REGISTRIES`), and the wrapper failed on a private attribute."""
    missing = next((r for r in _OPTIMIZER_HOOK_REGISTRIES if not hasattr(optimizer, r)), None)
    if missing is None:
        return
    name = type(optimizer).__name__
    raise TypeError(
        f"{name} was not set up by torch.optim.Optimizer.__init__ (it has no {missing}, "
        "which that sets): an optimizer that wraps another and skips it (a lookahead "
        f"wrapper) cannot be offloaded itself. Offload the optimizer it wraps and put {name} "
        f"around the CPUOffloadOptimizer: {name}(CPUOffloadOptimizer(torch.optim.AdamW(...)))"
    )


def _own_definitions(cls: type, method: str, base: type) -> list[type]:
    """The classes of `cls`'s MRO below `base` that define `method` as a function of their
    own, not one of `base` and its ancestors'. Torch's `_patch_step_function` sets a
    wrapper of the inherited `step` (marked `hooked`) on the class an optimizer is made
    of: that one is seen through, and the class named is the one that wrote the function
    (a decorator of the user's, `functools.wraps` or not, is a function of that class's)."""
    mro = cls.__mro__
    at = mro.index(base)

    def written(function: Any) -> Any:
        hooked = getattr(function, "hooked", False) and hasattr(function, "__wrapped__")
        return function.__wrapped__ if hooked else function

    own = [(c, written(vars(c)[method])) for c in mro if method in vars(c)]
    inherited = {f for c, f in own if mro.index(c) >= at}
    below = [(c, f) for c, f in own if mro.index(c) < at and f not in inherited]
    # each function once, named by the class whose own attribute it is
    return list(
        {f: next((c for c, g in below if vars(c)[method] is g), c) for c, f in below}.values()
    )


def _subset_step_class(optimizer: torch.optim.Optimizer) -> type | None:
    """The class that gives `optimizer` its own subset step (defines `begin_subset_step`);
    None where no class does (an attribute served by `__getattr__`)."""
    return next((c for c in type(optimizer).__mro__ if "begin_subset_step" in vars(c)), None)


def _load_hooks(optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """`optimizer`'s load_state_dict pre and post hooks, in the order it calls them.
    Private API (torch 2.11, 2.13): `_optimizer_load_state_dict_pre_hooks` and
    `_optimizer_load_state_dict_post_hooks`, ordered dicts of the registered hooks."""
    return (
        list(optimizer._optimizer_load_state_dict_pre_hooks.values()),
        list(optimizer._optimizer_load_state_dict_post_hooks.values()),
    )


def _after_pre_hooks(
    optimizer: torch.optim.Optimizer, hooks: Iterable[Any], state_dict: dict[str, Any]
) -> dict[str, Any]:
    """`state_dict` after load pre-hooks `hooks` of `optimizer`, each given what the one
    before returned (or kept), as `torch.optim.Optimizer.load_state_dict` calls them."""
    for hook in list(hooks):
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


@contextmanager
def _load_hooks_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """`optimizer`'s load hooks (`_load_hooks`) out of the way: the wrapper loads it in
    parts (groups, then scalars) and calls them once itself. Hooks registered meanwhile
    (muon.Muon's own, for the length of its load) go and are dropped with the stand-in."""
    kept = (
        optimizer._optimizer_load_state_dict_pre_hooks,
        optimizer._optimizer_load_state_dict_post_hooks,
    )
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield
    finally:
        (
            optimizer._optimizer_load_state_dict_pre_hooks,
            optimizer._optimizer_load_state_dict_post_hooks,
        ) = kept


_SET_AT_CONSTRUCTION = (
    "{name} is set at construction: close() this wrapper and wrap the inner optimizer "
    "anew with the {name} you want (its state carries over)"
)


def _with_sparse_grads(params: Sequence[Tensor]) -> list[Tensor]:
    return [p for p in params if p.grad is not None and p.grad.is_sparse]


# torch.optim's optimizers whose step takes sparse grads unfused (the others raise in it).
_TAKES_SPARSE_GRADS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


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


def _check_params_apart(params: Sequence[Tensor]) -> None:
    """Refuse two params that share an element (`nn.Parameter(embed.weight)` given to a
    head makes a second param over the embedding's memory, not a tie): torch's step
    updates the shared elements twice, in the order the params are listed, and the
    chunked step in the order of its chunks, which rounds otherwise."""

    def refuse(name: str, other: str) -> None:
        raise ValueError(
            f"{name} shares memory with {other} (two Parameters over the same elements, "
            "each updated in turn): the chunked step updates them in another order than the "
            "optimizer's own step, which gives other results. Tie such weights as one "
            "Parameter (head.weight = embed.weight), or do not offload this optimizer"
        )

    # Dense params only (contiguous in some dim order: W, W.t()): telling a strided
    # view's bytes apart (W[:, :4] beside W[:, 4:]) indexes every byte, a GiB of host
    # memory for a 16 MiB matrix at construction.
    named = [
        (f"param {i} (shape {tuple(p.shape)})", local)
        for i, p in enumerate(params)
        if _dense(local := local_tensor(p))
    ]
    for cluster in _overlapping_spans(named):
        _check_cluster_apart(cluster, refuse)


def _refuse_steps(optimizer: torch.optim.Optimizer) -> None:
    """Refuse the optimizer's steps until a `load_state_dict`: its wrapper was collected
    with an overlapped step pending, which left params and state apart (step pre-hooks
    run in its own `step()` and in any wrapper's)."""

    name = type(optimizer).__name__  # the hooks hold no reference to it: no cycle

    def refuse(*_: Any) -> None:
        raise RuntimeError(
            f"this {name}'s CPUOffloadOptimizer was collected with an "
            "overlapped step pending: the chunks that had run updated their params but not "
            "their state, the others nothing, and that cannot be finished. Restore the "
            "model and this optimizer from a checkpoint (load_state_dict clears this)"
        )

    def loaded(_: torch.optim.Optimizer) -> None:
        # Only the step hook goes: torch iterates the load hooks' own dict around this one
        # (the next refusal removes this one).
        step_hook.remove()

    for handle in _REFUSALS.pop(optimizer, ()):  # one refusal at a time: none pile up
        handle.remove()
    step_hook = optimizer.register_step_pre_hook(refuse)
    _REFUSALS[optimizer] = (step_hook, optimizer.register_load_state_dict_post_hook(loaded))


_REFUSALS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[RemovableHandle, ...]] = (
    weakref.WeakKeyDictionary()
)
"""The hooks of each optimizer's `_refuse_steps`."""


def _refuse_differentiable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse `differentiable=True`: its step is part of the autograd graph (through the
    params and the state), which the chunked step's detached stand-ins and host homes cut."""
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ValueError(
                f"param group {g} of the wrapped {type(optimizer).__name__} has "
                "differentiable=True: its step is recorded by autograd through the params "
                "and state, and CPUOffloadOptimizer steps detached copies and keeps the "
                "state in host memory, which cuts that graph. Do not offload a "
                "differentiable optimizer"
            )


AMP_SCALING_ATTRIBUTES = ("grad_scale", "found_inf")
"""What `torch.amp.GradScaler.step` sets on an optimizer with `_step_supports_amp_scaling`
(fused Adam, AdamW, SGD, Adagrad) for its `step()` call and deletes after: its step reads
them (`getattr(self, "grad_scale", None)`), unscales the grads in its kernel and skips the
update on inf (torch 2.11, 2.13)."""


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
            a subset step. Torch calls on the trainer's thread that read a param
            or state wait for its update by themselves; call
            `wait_for_optimizer_step()` first for reads on another thread or
            stream, through `.data`, `.detach()` or DLPack, and (distributed
            Muon) reads made on some ranks only.
        gpu_resident_bytes: state bytes (rank-invariant count, whole units) kept
            on the GPU, never copied: the units the forward needs first with
            `overlap_forward` (overlap cannot hide them), else the last ones
            (nothing overlaps their copies), up to the first unit that does not fit.
            "auto": measure the first steps with everything offloaded (the trainer's
            stalls for chunks, the backward's length, the load rate, each step; on a
            GPU with `overlap_forward`, the last one's backward loads the leading chunks
            its length carries, which the first choice then copies on the device), then
            choose how much state the forward does not load: with `overlap_forward`,
            the backward loads what its length carries and the leading units of the
            rest stay resident; then, on a GPU, run the most the budget allows a few
            steps (and the default's backward loads, as without "auto", where that
            was no faster than nothing), and walk down from it for the least amount
            (stopping at one that only loads in the backward and is held within the
            room under the peak) whose step is as
            fast as the fastest, within `residency.NEAR_FASTEST` or the steps' own spread
            (`residency.NOISE_SIGMAS`, at most `residency.NOISE_CAP`;
            `offload.auto_residency`); the steps after it settles are checked against
            the largest split tried, run again just before them (or, when it settled on
            that one, the fastest measured), and if they are not as fast it takes that
            one instead. Without
            overlap the last units stay resident. `residency` says what it chose, and
            one log line. It keeps room in the host slabs for the whole state, so
            re-choosing never allocates pinned memory.
        gpu_budget_bytes: the GPU memory the optimizer may hold for state (resident
            state, the staging ring and the backward's extra slots), for what it chooses:
            with "auto", what it keeps and loads in the backward; default: what the
            device had free at the measured steps' peak, less
            `residency.BUDGET_MARGIN_FRACTION` of its memory, and never more than
            keeping the whole state on the GPU would hold; the default's backward loads
            (what runs without "auto", within the room under the peak) are tried too.
            With `overlap_forward`, nothing resident and `load_in_backward` unset, what
            the default's backward loads hold with the ring, first and as they grow
            (`backward_tuning`): fewer chunks than the forward first waits for, or none,
            where those would hold more; default: the room under the peak, and the
            device's headroom as they grow.
        load_in_backward: with `overlap_forward`, load the next step's first chunks in
            the backward of the first forward after a step, spread over the modules it
            passes from the last module that forward ran on (by then the loss and head's
            activations, the backward's usual peak, are freed) to the first: the step
            finds them loaded. Default (None): the chunks holding what the forward first
            waits for (the first module that reads params: under FSDP2 the root's unit, in
            a transformer wrapped per layer its embedding and head), at least the ring's,
            so the forward starts without waiting for copies; with "auto", "auto" chooses
            how much. False: never (the least GPU memory); True: the ring's
            `staging_slots` chunks (with "auto": at least those); a byte count: the leading
            chunks whose state (rank-invariant bytes) fits in it, at most that much (with
            "auto": the most it may load). Each chunk loaded takes a staging slot of its own
            (sized for it), allocated in the backward and given back as soon as its chunk is written
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

    Host syncs: none inside `step()`, but the first step pins the host slabs, and
    "auto" reads its measured steps' events (the first step after them waits for the
    forward before it; the last of them reads the step before it's, which the device has
    passed unless the host runs a whole backward ahead) and, with peers in the process
    group, each decision's agreement (one all-reduce read back). Reading state
    (`state_dict`, `load_state_dict`) first waits for the last write-back.

    `close()` finishes the last step, removes the forward hooks and gives back
    the staging ring; state stays readable. A dropped optimizer is collected even
    without `close()`: the model's hooks do not keep it alive. An optimizer has
    one open wrapper at a time.

    State tensors shaped like a param are laid out like it (as torch optimizers
    create them). One assigned by hand (`opt.state[p][key] = t`) is copied home
    at the next step. A step interrupted inside a chunk (KeyboardInterrupt, an
    error) leaves the state at home, partly updated, and the next `step()`
    refuses until `load_state_dict` restores a checkpoint (or `close()` this
    wrapper and wrap the inner optimizer anew, going on from the partial step).
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
        self._staging_slots = staging_slots
        self.gpu_resident_bytes: int | Literal["auto"] = gpu_resident_bytes
        """The resident state's bytes; "auto" until it has settled, then what it chose."""
        self._gpu_budget_bytes = gpu_budget_bytes
        self._resident_budget = 0 if gpu_resident_bytes == "auto" else gpu_resident_bytes
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._index = {p: i for i, p in enumerate(self._params)}  # the same on every rank
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
        _check_params_apart(self._params)
        _refuse_differentiable(optimizer)
        _refuse_not_set_up(optimizer)
        self._subset = subset_step_for(optimizer)
        self._refuse_a_patched_step()
        self._refuse_an_overridden_step()
        if (why := self._overridden_load()) is not None:  # said now, not at a resume
            warnings.warn(
                f"{why}: CPUOffloadOptimizer.load_state_dict will refuse to load through it "
                "(it loads in parts). Resume by loading into the unwrapped optimizer "
                "before wrapping it, or move what it does into load_state_dict hooks",
                stacklevel=user_stacklevel(),
            )
        if self._subset is None and (gpu_resident_bytes != 0 or gpu_budget_bytes is not None):
            raise ValueError(
                f"gpu_resident_bytes and gpu_budget_bytes need an optimizer with a subset "
                f"step; {_without_subset_step(optimizer)} (it takes the serial path, which "
                "keeps no state on the GPU between steps): leave them unset"
            )
        self._check_ring_fits()
        self._streams = CopyStreams(self.device, staging_slots)
        self._executor = StepExecutor(optimizer, self._params, self._streams, staging_slots)
        self._specs: list[ParamSpec] = []
        self._units_key: tuple[tuple[int, ...], ...] | None = None
        self._stepped_whole: set[Tensor] = set()  # params never sliced (sparse grads)
        self._grad_unseen: list[Tensor] = []  # `_watch_grad_dtypes`
        # (param, key) of state not shaped like its param the plan does not keep
        self._not_kept: set[tuple[Tensor, str]] = set()
        # State loaded, or replaced by hand in another dtype, since the last plan: planned
        # anew from the state as it is (a load's options may keep other state).
        self._plan_from_state = False
        self._auto: AutoResidency | None = None
        # "auto"'s plans while it searches (`_search_plan`), and what they were planned from
        self._search_plans: dict[Any, OffloadedStep | OffloadPlan] = {}
        self._search_plans_of: tuple[Any, ...] = ()
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
        self._step_interrupted: str | None = None  # that, where a chunk raised: params part-updated
        self._hooks_for_lr_scheduler()
        self._overlap: ForwardOverlap | None = None
        if overlap_forward is not None:
            if self._subset is None:
                raise ValueError(
                    f"overlap_forward needs an optimizer with a subset step; "
                    f"{_without_subset_step(optimizer)} (it would take the serial path)"
                )
            self._overlap = ForwardOverlap(overlap_forward, self._params, self._streams)
            self._overlap.dropped_pending.append(functools.partial(_refuse_steps, optimizer))
        self._insist_on_backward_loads = load_in_backward is True
        self._backward_option = load_in_backward  # as given: the ranks of Muon agree on it
        # Default with overlap (not "auto"): the backward loads what the forward first waits for.
        self._load_first_wait = (
            load_in_backward is None and self._overlap is not None and self._auto is None
        )
        self._load_in_backward = self._load_first_wait or (
            bool(load_in_backward) and self._auto is None
        )
        # The default's loads grow to what the forward stalls for, with nothing resident:
        # its re-plans keep one host layout (all the state is on the host anyway), so the
        # pinned slabs stay and no resident state moves.
        self._tuning: BackwardTuning | None = None
        if self._load_first_wait and gpu_resident_bytes == 0:
            device = self.device
            self._tuning = BackwardTuning(lambda: StepTimer(device))
            self._host_room_for_all = True
        self.backward_tuning: tuple[TuningRound, ...] | None = None if self._tuning else ()
        """The rounds the default's backward loads took to grow (`offload.backward_tuning`)
        once it is done; None while it runs; empty where nothing is timed (the CPU) or
        nothing is tuned (state kept resident, or the loads given)."""
        if self._overlap is not None and (
            self._load_in_backward or (self._auto is not None and self._auto.backward is not None)
        ):
            reached = weakref.WeakMethod(self._backward_reached)  # the model must not keep self
            self._overlap.backward_reached = lambda *at: (reached() or _nothing)(*at)
        waited = weakref.WeakMethod(self.wait_for_optimizer_step)
        if self._overlap is not None:
            self._overlap.written_back = lambda: (waited() or _nothing)()
            this = weakref.ref(self)
            self._overlap.interrupted = lambda: getattr(this(), "_step_interrupted", None)
        self._steps_without_grads = 0  # in a row (`_warn_if_no_grads_again`)
        # torch's optimizers (their subclasses too) and Muon read a None state entry as one
        # not made yet (`_forget_none_state`); torch.optim.Muon and Adafactor are defined in
        # `torch.optim` itself (torch 2.13)
        modules = [c.__module__ for c in type(optimizer).__mro__ if c is not torch.optim.Optimizer]
        self._none_is_absent = any(
            m == "torch.optim" or m.startswith(("torch.optim.", "muon.")) for m in modules
        )
        # The wrapped optimizer's own state_dict() and load_state_dict() (a trainer that
        # checkpoints `.optimizer`) see the last step whole, as the wrapper's do; its own
        # step() is refused (its state is in the homes; the wrapper's step runs it without
        # hooks, `step_without_hooks`).
        # Removed by close(), or once this wrapper is collected (the optimizer may outlive it).
        self._stepping = False  # inside step(): a patched step calling the hooked one runs
        this_wrapper = weakref.ref(self)
        direct_step = optimizer.register_step_pre_hook(
            lambda *_: _refuse_direct_step(this_wrapper())
        )
        self._direct_step_hook = direct_step.id
        self._remove_inner_hooks = weakref.finalize(
            self,
            _remove_handles,
            [
                optimizer.register_state_dict_pre_hook(lambda _: (waited() or _nothing)()),
                optimizer.register_load_state_dict_pre_hook(lambda *_: (waited() or _nothing)()),
                direct_step,
            ],
        )
        self._remove_inner_hooks.atexit = False
        self.backward_load_bytes = backward_bytes
        """With loads in the backward, their byte budget: `load_in_backward`'s bytes as
        given (the backward loads the leading whole chunks within it; None: the ring's);
        by default, once planned, the bytes of the chunks the forward first waits for and
        those the room under the peak holds, grown over the first steps to what the forward
        stalls for (`offload.backward_tuning`; the rounds: `backward_tuning`);
        under "auto", once settled, the budget of the split it chose (what that loads:
        `residency.backward_load_bytes`). The chunks it loads: `schedule.loaded_in_backward`."""
        _WRAPPERS[optimizer] = weakref.ref(self)

    def _check_ring_fits(self) -> None:
        """Fail at construction if the staging ring cannot fit on the device.

        A slot holds at least the largest param's state (a chunk is whole units),
        so `staging_slots` times that is a floor on the ring the first step allocates.
        """
        if self._subset is None:  # the serial path stages state per step, no ring
            return
        slices = getattr(self._subset, "slices_params", False)

        def least_slot(param: Tensor) -> int:
            layout = self._subset.state_layout(param)
            state = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
            if _sliceable(param, list(layout.values()), slices):
                return min(state, self.chunk_bytes)
            return state

        largest = max(map(least_slot, self._params))
        check_device_memory(
            self.staging_slots * largest,
            self.device,
            f"the staging ring ({self.staging_slots} slots of at least {largest} bytes: the "
            "largest param's state, or chunk_bytes where the step cuts params into slices)",
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

    def _refuse_an_overridden_step(self) -> None:
        """An optimizer with its own subset step steps through it, never through `step`: a
        subclass's `step` (clipping its grads, say) would silently not run. (A torch
        optimizer's subclass takes the serial path, which calls its `step`.)"""
        base = _subset_step_class(self.optimizer)
        if self._subset is not self.optimizer or base is None:
            return
        overriding = _own_definitions(type(self.optimizer), "step", base)
        if not overriding:
            return
        name, optimizer = overriding[0].__name__, type(self.optimizer).__name__
        raise TypeError(
            f"{name} overrides step(), which CPUOffloadOptimizer never calls: it steps the "
            f"optimizer a chunk of params at a time through {base.__name__}'s "
            f"begin_subset_step, so {name}.step would not run. Put what it does in a step "
            f"pre-hook (register_step_pre_hook on the {optimizer}: the wrapper runs those "
            "once a step, before any chunk)"
        )

    def _overridden_load(self) -> str | None:
        """Why the wrapper cannot load through the wrapped optimizer's `load_state_dict`, or
        None. It loads a state_dict into its homes itself, calling that method on the
        groups and then on the state not offloaded (`_load_state_dict`): a subclass's own
        (or one set on the instance) would see neither the whole state_dict (its own keys)
        nor the offloaded state, and what it did to that would be lost. An optimizer with
        its own subset step may define one (it knows this)."""
        optimizer = self.optimizer
        name = type(optimizer).__name__
        if "load_state_dict" in vars(optimizer):
            return f"the {name}'s load_state_dict is set on the instance"
        base = _subset_step_class(optimizer) if self._subset is optimizer else None
        if base is None:  # the torch optimizer it is made from
            base = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch."))
        overriding = _own_definitions(type(optimizer), "load_state_dict", base)
        return f"{overriding[0].__name__} overrides load_state_dict" if overriding else None

    def _refuse_an_overridden_load(self) -> None:
        why = self._overridden_load()
        if why is None:
            return
        name = type(self.optimizer).__name__
        raise TypeError(
            f"{why}, which CPUOffloadOptimizer cannot call as written: it loads the state "
            "into host memory itself, calling it on the groups and the small per-param "
            "state only, so it would not see the whole state_dict (its own keys, the "
            f"offloaded state). Put what it does in load_state_dict hooks on the {name} "
            "(register_load_state_dict_pre_hook: given the whole state_dict; "
            "register_load_state_dict_post_hook: run once the state is in place), or load "
            f"into the {name} before wrapping it. Nothing was loaded"
        )

    def _check_step_inputs(self) -> None:
        """Refuse, before anything changes, a step the wrapper cannot take exactly."""
        self._refuse_a_patched_step()
        _refuse_differentiable(self.optimizer)
        self._refuse_changed_params()
        moved = next((i for i, p in enumerate(self._params) if p.device != self.device), None)
        if moved is not None:
            raise RuntimeError(
                f"param {moved} is on {self._params[moved].device} but was on {self.device} "
                "when its optimizer was wrapped: move the model first, then build and wrap the "
                "optimizer (CPUOffloadOptimizer plans its staging for one device)"
            )

    def _warn_if_no_grads_again(self) -> None:
        """Warn at a second step in a row with no grad on any param: one is a step before
        training (for a scheduler's sake), two an optimizer whose params no backward
        reaches (built before `fully_shard`, which replaces them), stepping nothing. Not
        where only some params are stale (`fully_shard` on part of the model): a param
        without grads may as well be unused by design."""
        if any(p.grad is not None for p in self._params):
            self._steps_without_grads = 0
            return
        self._steps_without_grads += 1
        if self._steps_without_grads == 2:
            warnings.warn(
                f"step() found no grad on any of the wrapped {type(self.optimizer).__name__}'s "
                f"{len(self._params)} params two steps in a row, so it updated nothing. Unless "
                "they are frozen: an optimizer built before fully_shard holds params the model "
                "no longer uses (fully_shard replaces them): build and wrap it after "
                "fully_shard; otherwise call backward() before step()",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def _refuse_changed_params(self) -> None:
        """The wrapped optimizer's params, in its groups' order, are those it was wrapped
        with: the slabs, and a load's pairing of saved state to params, follow that order."""
        current = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(current) != len(self._params) or any(
            a is not b for a, b in zip(current, self._params, strict=True)
        ):
            raise RuntimeError(
                f"the wrapped {type(self.optimizer).__name__}'s params changed after wrapping "
                f"({len(self._params)} params then, {len(current)} now, or reordered): "
                "CPUOffloadOptimizer plans its host slabs once. Add param groups before "
                "wrapping, or call close() on this wrapper and wrap the optimizer again (its "
                "state carries over)"
            )

    def _refuse_sparse_grads_the_step_refuses(self, sparse: set[Tensor]) -> None:
        """`sparse` grads' params the chunked step cannot take, refused before any chunk
        steps (after the closure, which makes the grads): torch's step would raise in the
        chunk holding one, after the earlier chunks ran, and SGD's sparse momentum cannot
        live in slabs."""
        optimizer = type(self.optimizer)
        for group in self.optimizer.param_groups:
            first = next((p for p in group["params"] if p in sparse), None)
            if first is None:
                continue
            position = self._index[first]
            if group.get("fused") or (
                optimizer.__module__.startswith("torch.optim.")
                and optimizer not in _TAKES_SPARSE_GRADS
            ):
                fused = "fused " if group.get("fused") else ""
                raise ValueError(
                    f"param {position} has a sparse grad, which {fused}{optimizer.__name__} "
                    "does not support (torch's step refuses it too): use dense grads "
                    "(nn.Embedding(sparse=False)) or an optimizer that takes sparse grads "
                    "(SGD, Adagrad, SparseAdam, not fused)"
                )
            if optimizer is torch.optim.SGD and group["momentum"] != 0:
                raise ValueError(
                    f"param {position} has a sparse grad, for which "
                    f"SGD(momentum={group['momentum']}) keeps a sparse momentum_buffer; "
                    "offloaded state lives in dense host slabs. Use dense grads "
                    "(nn.Embedding(sparse=False)), momentum=0, or do not offload this optimizer"
                )

    def _hooks_for_lr_scheduler(self) -> None:
        # What Optimizer.__init__ would have set and schedulers or hooks read.
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
        self._warn_if_state_read_runs_collectives()
        self.wait_for_optimizer_step()
        self._executor.drop_loaded_ahead()
        return self.optimizer.state

    @state.setter
    def state(self, value: Mapping[Tensor, dict[str, Any]]) -> None:
        """`opt.state = defaultdict(dict)` (torch's way to reset every param's state), or
        any mapping: the wrapped optimizer's state dict takes its entries, as edits through
        `state` are taken (at the next step). The dict stays the one the step holds."""
        entries = dict(value)  # `value` may be the state itself
        state = self.state
        state.clear()
        state.update(entries)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """The wrapped optimizer's (True for fused Adam, AdamW, SGD): `GradScaler.step` then
        hands `step()` its scale and inf flag (`AMP_SCALING_ATTRIBUTES`) rather than
        unscaling the grads itself and skipping `step()` on inf, as it would for the wrapped
        optimizer: the same bits, and the same state after a skipped step."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def __setattr__(self, name: str, value: Any) -> None:
        # A public setting of the wrapped optimizer's own (Muon's ns_dtype) set on the wrapper
        # would be an attribute of the wrapper alone: the step reads the wrapped one's.
        # (Once constructed: the constructor sets the wrapper's own, `defaults` among them.)
        inner = self.__dict__.get("optimizer")
        if (
            not name.startswith("_")
            and inner is not None
            and name in vars(inner)
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and (holder := _WRAPPERS.get(inner)) is not None
            and holder() is self
        ):
            raise AttributeError(
                f"{name} is a setting of the wrapped {type(inner).__name__}, which the wrapper "
                f"does not hold: set opt.optimizer.{name}"
            )
        super().__setattr__(name, value)

    @property
    def staging_slots(self) -> int:
        """GPU staging slots in the ring (a constructor setting: the copy streams' events
        and the executor are made for them)."""
        return self._staging_slots

    @staging_slots.setter
    def staging_slots(self, value: int) -> None:
        raise AttributeError(_SET_AT_CONSTRUCTION.format(name="staging_slots"))

    @property
    def gpu_budget_bytes(self) -> int | None:
        """With "auto", the GPU memory it may hold for state (a constructor setting: the
        search measures against it from the first step)."""
        return self._gpu_budget_bytes

    @gpu_budget_bytes.setter
    def gpu_budget_bytes(self, value: int | None) -> None:
        raise AttributeError(_SET_AT_CONSTRUCTION.format(name="gpu_budget_bytes"))

    @property
    def plan(self) -> OffloadPlan | None:
        """The chunk plan, built on the first step (None before)."""
        return self._executor.plan

    @property
    def schedule(self) -> StepSchedule | None:
        """How the step runs the plan's chunks (`offload.step_schedule`), built with it."""
        return self._executor.schedule

    @property
    def chunks_loaded_in_backward(self) -> int:
        """How many chunks the last step found loaded in the backward (`load_in_backward`;
        at a re-plan of "auto", copied from what the old plan held on the device)."""
        return self._executor.chunks_loaded_in_backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._overlap is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        if not set_to_none:
            self._overlap.finish()  # zeroing in place would race the overlapped step's reads
        # Not while another thread runs a chunk (a checkpoint's wait): a chunk swaps in the
        # grads and narrowed groups it steps and puts back what it found, a cleared grad's
        # grad included, and the groups it narrowed hid the other params from this zeroing.
        with self._overlap.chunks_held():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "CPUOffloadOptimizer plans its host slabs once: call close(), add the group to "
            "the wrapped optimizer (.optimizer.add_param_group), and wrap it again (its "
            "state carries over)"
        )

    def _warn_if_state_read_runs_collectives(self) -> None:
        """`state` and `state_dict()` wait for the whole step, as a read of a state home
        does: said once where that runs chunks that communicate, which every rank must."""
        if self._overlap is not None:
            self._overlap.warn_if_rank_local(len(self._overlap.chunk_done))

    def wait_for_optimizer_step(self) -> None:
        """Block the host until the last step is done: params updated, state written back.

        Call it before reading params or state outside a forward (checkpoint save,
        weight export); `state_dict` and `load_state_dict` call it themselves.
        """
        if self._overlap is not None:
            self._overlap.finish()
        self._executor.wait()

    def close(self) -> None:
        """Finish the last step, remove the forward hooks and give back the staging ring.

        State and params stay readable (`state_dict` works); `step()` is refused.
        """
        if self._closed:
            return
        try:
            self.wait_for_optimizer_step()
        except BaseException:
            # A chunk raised in the wait: the step is abandoned, nothing of it pending, and
            # the hooks and the waiting mode go all the same. Raised elsewhere (an
            # interrupt between chunks), the step is still pending: close() may be called
            # again to land it.
            if self._step_interrupted is None:
                raise
            # Only dropped, not given back: the error's traceback holds views of the ring
            # (`StepExecutor.abandon`), which stay valid once its write-backs are done.
            self._executor.wait()
            self._close_now(give_back_staging=False)
            raise
        self._close_now(give_back_staging=True)

    def _close_now(self, give_back_staging: bool) -> None:
        self._executor.drop_loaded_ahead()
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None
        self._remove_inner_hooks()
        if give_back_staging:
            # Given back, not only dropped: the chunks' views keep the slots' storage (the
            # backward's loads may hold it between a backward and its step), and nothing in
            # flight reads it (the step and those loads are done).
            self._executor.release_staging()
        self._executor.ring, self._executor.extra_slots = None, []
        if self._tuning is not None:  # not done: what it did so far
            self.backward_tuning, self._tuning = tuple(self._tuning.rounds), None
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
        called around it as `torch.optim.Optimizer.state_dict` calls them. After an
        interrupted step or load it warns: the state it returns is not a whole step's."""
        self._warn_if_state_read_runs_collectives()
        # Not while the trainer's thread runs a chunk of its next step (a checkpoint
        # thread's): a chunk puts stand-ins of its params into the state, which torch's
        # state_dict() cannot name (it raised a KeyError).
        held = contextlib.nullcontext() if self._overlap is None else self._overlap.chunks_held()
        with held:
            self.wait_for_optimizer_step()
            if self._interrupted is not None:  # a "checkpoint on Ctrl-C" handler saves this
                warnings.warn(
                    f"state_dict() returns state that is not whole: {self._interrupted}",
                    stacklevel=user_stacklevel(),
                )
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
        The wrapped optimizer's own load hooks are called once, as its `load_state_dict`
        would: its pre hooks (after the wrapper's) on the whole state_dict, its post hooks
        (before the wrapper's) once the state is in its homes.
        """
        self._refuse_an_overridden_load()
        self.wait_for_optimizer_step()
        self._refuse_changed_params()  # saved state pairs with params by their position
        self._executor.drop_loaded_ahead()
        state_dict = state_dict.copy()
        own_hooks = self._optimizer_load_state_dict_pre_hooks.values()
        state_dict = _after_pre_hooks(self, own_hooks, state_dict)
        # the wrapped optimizer's, as registered once the wrapper's ran
        state_dict = _after_pre_hooks(self.optimizer, _load_hooks(self.optimizer)[0], state_dict)
        with _load_hooks_set_aside(self.optimizer):
            self._load_state_dict(state_dict)
        self._interrupted = self._step_interrupted = None
        for post_hook in _load_hooks(self.optimizer)[1]:  # a pre-hook may have added one
            post_hook(self.optimizer)
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
        # State under a key no group lists (an optimizer's own `state["global"]`) goes to
        # the wrapped optimizer as it is, as torch's load keeps it; the rest is params'.
        saved = {k: v for k, v in state_dict["state"].items() if k in param_of}
        unlisted = {k: v for k, v in state_dict["state"].items() if k not in param_of}
        # The saved groups' options choose the state (amsgrad, momentum): loaded first, what
        # the step keeps with them says which tensors go to the homes; a refused load puts
        # the old groups and state back.
        # The inner optimizer's attributes, not only its groups and state: its own load
        # hooks may set more (Muon's momentum baseline).
        before = dict(self.optimizer.__dict__)
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        try:
            kept = self._kept_shapes()
            offloaded, light = self._sorted_loaded_state(saved, param_of, kept)
            self.optimizer.load_state_dict(
                {"state": light | unlisted, "param_groups": state_dict["param_groups"]}
            )
            self._check_complete_state(saved, param_of, kept)
            for (index, key), value in offloaded.items():
                expected = kept.get(param_of[index], {}).get(key)
                if expected is not None:
                    _check_state_shape(
                        index, key, value, expected, "load a state_dict saved for these params"
                    )
        except BaseException:
            self.optimizer.__setstate__(before)
            raise
        self._plan_from_state = True
        try:
            self._copy_loaded_state(offloaded, param_of)
        except BaseException as error:  # the homes hold part of it: neither state is whole
            self._interrupted = (
                f"load_state_dict was interrupted by {type(error).__name__} while copying the "
                "state into its homes: the state is part loaded, part as it was. Load the "
                "state_dict again (a whole load clears this)"
            )
            raise

    def _sorted_loaded_state(
        self,
        saved: dict[Any, dict[str, Any]],
        param_of: Mapping[Any, Tensor],
        kept: Mapping[Tensor, Mapping[str, torch.Size]],
    ) -> tuple[dict[tuple[Any, str], Tensor], dict[Any, dict[str, Any]]]:
        """The saved state split into tensors for the homes, keyed (param id, key), and what
        the wrapped optimizer loads itself (its scalars), each tensor placed as its param
        (`_placed_as`). What the step keeps (`kept`) goes home whatever its shape, which is
        checked there (a 0-dim `exp_avg` was broadcast into the slab); a scalar saved with
        shape (1,) (`step`, NAdam's `mu_product`) loads into the optimizer as it is (torch's
        load takes it: held back, it was missing there); other tensors of one or more dims
        (one the options no longer keep: `max_exp_avg_sq` with amsgrad off) are held on
        the host, as torch holds them."""
        offloaded: dict[tuple[Any, str], Tensor] = {}
        light: dict[Any, dict[str, Any]] = {}
        for index, entries in saved.items():
            param = param_of[index]
            keeps = kept.get(param, {})
            light[index] = {}
            for key, value in entries.items():
                if not isinstance(value, Tensor) or (value.numel() == 1 and key not in keeps):
                    light[index][key] = value
                else:
                    offloaded[index, key] = _placed_as(
                        value, param, f"state {key!r} of param {index}"
                    )
        return offloaded, light

    def _copy_loaded_state(
        self, offloaded: Mapping[tuple[Any, str], Tensor], param_of: Mapping[Any, Tensor]
    ) -> None:
        """The loaded state tensors into their homes (in place), or, where a tensor has no
        home of its dtype (none yet, or one in the dtype of the state before the load),
        held on the host until the next step plans one."""
        views = self._executor.homes
        # The state_dict may hold the homes themselves (this optimizer's own, its entries
        # moved to other params): every source is read before any home is written.
        slabs = [*self._executor.host_slabs.values(), *self._executor.resident_slabs.values()]
        in_slabs = {slab.untyped_storage().data_ptr() for slab in slabs}
        copies = []
        for (index, key), value in offloaded.items():
            # detached: a state tensor saved requiring grad (torch's own load steps it under
            # no_grad) made the homes require grad, and the next step's in-place copy raised
            param, source = param_of[index], local_tensor(value).detach()
            dtype = self._loaded_dtype(param, key, value)
            view = views.get((param, key))
            if view is not None and view.home.dtype == dtype:
                if source.untyped_storage().data_ptr() in in_slabs and not _same_view(
                    source, view.home
                ):
                    source = source.clone()
                copies.append((view.home, source))
                self.optimizer.state[param][key] = view.home_state
            else:
                held = torch.empty_like(source, device="cpu", dtype=dtype)
                held.copy_(source)
                self.optimizer.state[param][key] = as_state(param, held)
        for home, source in copies:
            home.copy_(source)

    def _loaded_dtype(self, param: Tensor, key: str, value: Tensor) -> torch.dtype:
        """The dtype the wrapped optimizer's own load gives a state tensor: one with a subset
        step of its own keeps it in its layout's (Muon: fp32 momentum for bf16 params);
        torch's cast floating state but `step` to the param's dtype (whatever dtype their
        step would make it in: SGD's momentum, from a grad of another dtype)."""
        if self._subset is not None and not isinstance(self._subset, GroupSubsetStep):
            layout = self._layout(param)
            if key in layout:
                return layout[key][1]
        cast = key != "step" and param.is_floating_point()
        return param.dtype if cast else value.dtype

    def _check_complete_state(
        self,
        saved: dict[Any, dict[str, Any]],
        param_of: dict[Any, Tensor],
        kept: dict[Tensor, dict[str, torch.Size]],
    ) -> None:
        """Every param with saved state has every state tensor the step will read, and,
        for torch's optimizers, every scalar (`step`).

        A missing tensor would be staged from its slab unchanged (zeros, or the last
        run's values); a missing scalar raised a KeyError from the first chunk's step, which
        then refused to go on (torch's own load raises).
        """
        for index, entries in saved.items():
            if not entries:
                continue
            expected = set(kept.get(param_of[index], {}))
            if isinstance(self._subset, GroupSubsetStep):
                expected |= self._subset.state_keys(param_of[index])
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
        for (param, key), home in self._executor.homes.items():
            kept.setdefault(param, {})[key] = home.home.shape
        return kept

    def _forget_none_state(self) -> None:
        """A state entry set to None where the step keeps a tensor, or kept one, is absent
        for torch's optimizers (and their subclasses) and Muon, as torch's SGD reads
        `momentum_buffer` (torch <= 2.2 saved None for every param at momentum 0): dropped,
        so the step starts it anew (a None in the homes' checks was a crash)."""
        if not self._none_is_absent:
            return  # an optimizer of its own: None may mean more there
        state = self.optimizer.state
        for param in self._params:
            entries = state.get(param)
            if not entries or all(value is not None for value in entries.values()):
                continue
            layout = self._layout(param) or {}
            for key in [k for k, v in entries.items() if v is None]:
                if key in layout or (param, key) in self._executor.homes:
                    del entries[key]

    def _take_replaced_state(self) -> None:
        """Copy state tensors assigned by hand since the last step (`opt.state[p][key] = t`)
        into their homes: a step stages the homes, and would silently use the old values.

        Done before anything reads the homes: waits for the last write-back, and forgets
        the backward's loads (they staged the old values).
        """
        state = self.optimizer.state
        for param, key in self._executor.homes:
            if not state.get(param) or key in state[param]:
                continue
            # Staged from its home, a deleted state tensor would come back with old values
            # (unless the step no longer keeps it: a state_dict loaded with amsgrad off).
            # None of what the step keeps is not deleted but not created yet: a Muon group
            # switched to AdamW keeps its momentum buffer until the param's first grad.
            layout = self._layout(param)
            if layout is None or (key in layout and any(k in state[param] for k in layout)):
                raise KeyError(
                    f"state {key!r} of param {_position(self._params, param)} was deleted, and the "
                    f"step reads it (the param's state has {sorted(state[param])}): assign it a "
                    "tensor, or start the param's state afresh (del opt.state[param])"
                )
        replaced = [
            (param, key, home)
            for (param, key), home in self._executor.homes.items()
            if key in state.get(param, ()) and state[param][key] is not home.home_state
        ]
        if not replaced:
            return
        self.wait_for_optimizer_step()
        self._executor.drop_loaded_ahead()
        for param, key, home in replaced:
            value, index = state[param][key], _position(self._params, param)
            fix = "assign a tensor like the one it replaces, or edit that one in place"
            _check_state_shape(index, key, value, home.home.shape, fix)
            if value.dtype != home.home.dtype:
                layout = self._layout(param)  # None on the serial path, planned from the state
                kept = layout is not None and key in layout  # else dropped at the re-plan
                if kept and layout[key][1] != value.dtype:  # an own subset step's
                    raise ValueError(
                        f"state {key!r} of param {index} was replaced by a {value.dtype} "
                        f"tensor, expected {home.home.dtype} ({fix})"
                    )
                # torch's optimizers go on with it in its dtype (a load casts floating state
                # to the param's): the next plan homes it so (their layout keeps the dtype
                # of state that exists)
                self._plan_from_state = True
                continue
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
        self._stepping = True
        try:
            return self._step(closure)
        finally:
            self._stepping = False

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        self._run_wrapped_step_hooks(pre=True)
        self._check_step_inputs()
        self._forget_none_state()
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
        self._warn_if_no_grads_again()  # after the step: a closure makes the grads
        record_step_for_lr_schedulers(self.optimizer)
        self._run_wrapped_step_hooks(pre=False)
        return loss

    def _begin_subset_step(self) -> SubsetStep:
        subset = self._subset.begin_subset_step()
        if isinstance(self._subset, GroupSubsetStep):  # Muon checks its state itself
            self._subset.check_state_for_options()
        return subset

    def _run_wrapped_step_hooks(self, pre: bool) -> None:
        """The wrapped optimizer's own step hooks, once a step, as its `step()` would run
        them (its step runs per chunk without them: `step_without_hooks`); with overlap
        the post-hooks run as `step()` returns, and what they read waits for the update.
        Private API (torch 2.11, 2.13): an optimizer keeps them in
        `_optimizer_step_pre_hooks` and `_optimizer_step_post_hooks`."""
        inner = self.optimizer
        hooks = inner._optimizer_step_pre_hooks if pre else inner._optimizer_step_post_hooks
        for key, hook in list(hooks.items()):
            if key == self._direct_step_hook:  # the wrapper's own guard
                continue
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
        sparse = _with_sparse_grads(self._params)
        if sparse:
            self._refuse_sparse_grads_the_step_refuses(set(sparse))
        streams = self._streams
        auto = self._auto
        if self._overlap is not None:
            self._overlap.finish()  # the rest of an overlapped previous step
            # A gathered unit first: a model whose units are all gathered holds only
            # their unsharded params, and would look built after the optimizer.
            self._overlap.refuse_gathered_units()
            if self._executor.plan is None:
                self._overlap.check_holds(self._params, stepping=True)
        self._take_replaced_state()
        executor = self._executor
        if executor.loaded_ahead and executor.edited_since_loaded_ahead():
            # A state tensor held from an earlier step was edited in place after the
            # backward's loads (an edit through `state` has dropped them already).
            executor.drop_loaded_ahead()
        # The wrapped optimizer's checks (Muon's groups and grads) may refuse the step too: at
        # the first plan on every rank alike (Muon's own agreement runs only where it plans).
        first_plan = executor.plan is None
        agree = self._rank_agreement() if first_plan else None
        subset = _refused_on_every_rank(agree, (), self._begin_subset_step)
        units_key = self._units_key_of(subset)
        regrouped = self._executor.plan is not None and units_key != self._units_key
        if auto is not None and regrouped:
            raise RuntimeError(
                "the wrapped optimizer's units (what one step_params call updates whole, "
                "e.g. Muon's buckets) changed between steps while gpu_resident_bytes='auto' "
                "is still choosing from timed steps of the old ones: change the param groups "
                "(a group's algorithm, row_blocks, params) before the first step or once "
                "'auto' has said what it chose"
            )
        # Counted once the checks have passed: a refused step is no step of "auto"'s (on
        # every rank alike: a rank counting one its peers took would decide before them).
        # A re-plan after the first that refuses (state assigned by hand, of the wrong
        # shape, as options start keeping it) is counted: "auto" decided before it.
        if auto is not None and not first_plan:
            auto.step_started(streams.current())
            if self._plan_from_state:
                # State loaded or given another dtype is planned anew first: a split
                # re-planned from the last plan's specs would cast it into their homes.
                self._ensure_plan(subset, units_key, regrouped, self._subset.state_layout, sparse)
            self._run_auto(auto)
        self._ensure_plan(subset, units_key, regrouped, self._subset.state_layout, sparse)
        if auto is not None and first_plan:  # its checks are the plan's
            auto.step_started(streams.current())
        tuning = self._tuning
        if tuning is not None and not first_plan:
            tuning.step_started(streams.current())
            self._run_tuning(tuning)
        timer = None
        if auto is not None and auto.profiling:
            timer = auto.timer
        elif self._tuning is not None and self._tuning.profiling:
            timer = self._tuning.timer
        if timer is not None:
            timer.step_started(streams.current())
        if self._overlap is not None:  # the next forward's waits: timed in measured steps only
            self._overlap.timer = timer
        if executor.ring is not None:
            # Allocated on the trainer's stream: the copy streams start after its work so far.
            executor.acquire_slots()
            ready = streams.mark(streams.current())
            streams.wait(streams.h2d, ready)
            streams.wait(streams.d2h, ready)
        if self._overlap is None:
            # The trainer's stream runs the whole step: all of it is exposed.
            compute = streams.current()
            before = timer.mark(compute) if timer is not None else None
            chunks = executor.enqueue(subset, compute, scaling, timer, None)
            for _ in self._interruptible(chunks):
                pass
            if timer is not None:
                everything = sum(c.invariant_bytes for c in executor.plan.chunks)
                after = timer.mark(compute)
                timer.waited(len(executor.chunks) - 1, everything, before, after)
            return loss
        grads = [local_tensor(p.grad) for p in self._params if p.grad is not None]
        grads += [v for v in scaling.values() if isinstance(v, Tensor)]  # read as grads are
        state = self.optimizer.state
        # what the step updates in place besides the offloaded state (`step` counters)
        scalars = {
            p: [
                v
                for k, v in state[p].items()
                if isinstance(v, Tensor) and (p, k) not in executor.homes
            ]
            for p in self._params
            if state.get(p)
        }
        # The pending chunks hold this optimizer weakly: its overlap holds them, and a
        # cycle through them would keep a dropped optimizer (its pending-read mode on the
        # trainer's stack, its pinned slabs) alive until the cycle collector ran.
        this = weakref.proxy(self)
        side = self._overlap.side_stream
        chunks = executor.enqueue(subset, side, scaling, timer, self._overlap.chunk_done)
        homes = [home.home_state for home in executor.homes.values()]
        # the slabs too: what views of the homes (a held `exp_avg.view(-1)`) are views of
        homes += [*executor.host_slabs.values(), *executor.resident_slabs.values()]
        pending = CPUOffloadOptimizer._interruptible(this, chunks, side)
        collectives = getattr(subset, "runs_collectives", False)  # optional in the protocol
        self._overlap.start(pending, grads, scalars, homes, collectives)
        return loss

    def _interruptible(
        self, chunks: Iterator[None], compute: torch.Stream | None = None
    ) -> Iterator[None]:
        """`chunks` (the step's, enqueued on `compute`); if one raises (KeyboardInterrupt, an
        error in the update), the state goes home and the step is marked interrupted."""
        try:
            yield from chunks
        except GeneratorExit:  # dropped unfinished: the wrapper is being collected
            raise
        except BaseException as error:
            self._abandon_step(error, compute)
            raise

    def _abandon_step(self, error: BaseException, compute: torch.Stream | None) -> None:
        """After a chunk raised: the state back home (`StepExecutor.abandon`), and the next
        `step()` refused: the step is partly applied, which cannot be finished exactly (the
        chunk that raised may have updated some of its params)."""
        self._executor.abandon(compute)
        self._interrupted = (
            f"the last step() was interrupted by {type(error).__name__} while its chunks were "
            "stepping: the params and state of the chunks before it are updated (and perhaps "
            "some of the one that raised), the others' not, and that cannot be finished "
            "exactly. Restore the model and this optimizer from a checkpoint (load_state_dict "
            "clears this), or, to go on from here, close() this optimizer and wrap the inner "
            "one anew"
        )
        self._step_interrupted = self._interrupted

    def _backward_reached(self, passed: int, watched: int) -> None:
        """The backward passed the `passed`-th of `watched` owner modules (see
        `ForwardOverlap.backward_reached`): with `load_in_backward`, load its share of the
        next step's first chunks (`StepExecutor.load_ahead`); "auto" times the backwards
        of its first steps (`AutoResidency.timing_backward`). Not while any of the last
        step is still to be enqueued (a backward over a graph retained from before it):
        the loads would read homes its write-backs have not reached, and fill slots they
        still read; the next step loads those chunks itself."""
        if self._auto is not None and self._auto.timing_backward:
            self._auto.timer.backward_started(self._streams.current())
        if self._tuning is not None and self._tuning.profiling:
            self._tuning.timer.backward_started(self._streams.current())
        if self._load_in_backward and not self._closed and self._overlap.step_enqueued:
            self._executor.load_ahead(passed, watched)

    # -- planning and allocation --------------------------------------------------------

    def _units_key_of(self, subset: SubsetStep) -> tuple[tuple[int, ...], ...]:
        """The step's units as param indices, in the order its chunks run."""
        index = self._index
        units = subset.units
        if self._overlap is not None:
            # Chunks in the order the forward needs them (stable, so the same on every rank).
            units = self._overlap.forward_order(units)
        return tuple(tuple(index[p] for p in unit) for unit in units)

    def _ensure_plan(
        self,
        subset: SubsetStep,
        units_key: tuple[tuple[int, ...], ...],
        regrouped: bool,
        layout: Callable[[Tensor], StateLayout],
        sparse: Sequence[Tensor],
    ) -> None:
        # A sparse grad (nn.Embedding(sparse=True)) has no flat slices: its param steps whole,
        # from the first step it shows one on (re-planned then, once: it stays whole).
        self._stepped_whole.update(sparse)
        # Planned anew when the units change (a Muon group switched to AdamW regroups its
        # params), for a sparse grad on a sliced param, for state a step created after the
        # first without a home (SGD's momentum_buffer, momentum turned on): it lives in the
        # host slabs as any other from this step, and after a loaded state_dict, whose
        # options may keep other state (amsgrad off).
        if self._executor.plan is not None and not regrouped:
            resplit = any(self._specs[self._index[p]].splittable for p in sparse)
            if (
                not resplit
                and not self._plan_from_state
                and not self._unhomed_state()
                and not self._sliced_param_relaid()
                and not self._grad_dtype_changed()
            ):
                return
        specs = self._specs_of(subset, layout)
        if self._executor.plan is not None and specs == self._specs and not regrouped:
            # Unhomed state the step does not keep, not shaped like its param (a counter of
            # shape (1,)): not asked for again, as each ask re-laid every param's state.
            # State shaped like its param is (options turned on may keep it: amsgrad's).
            self._plan_from_state = False
            self._not_kept = {
                (p, k)
                for p, k in self._unhomed()
                if local_tensor(self.optimizer.state[p][k]).shape != local_tensor(p).shape
            }
            self._watch_grad_dtypes()
            return
        first_plan = self._executor.plan is None
        agree = self._rank_agreement() if first_plan else None

        def check_state() -> None:  # before anything moves: a refused step changes nothing
            self._check_state_shapes(specs)
            self._check_state_apart()

        _refused_on_every_rank(agree, self._step_options(), check_state)
        self._plan_from_state = False
        self._watch_grad_dtypes()
        if self._executor.plan is not None:
            self.wait_for_optimizer_step()  # the new homes copy the old ones
            self._executor.drop_loaded_ahead()
            if self._host_room_for_all:  # one host layout: the old GPU state goes home first
                self._give_back_gpu_state()
        self._specs = specs
        self._units_key = units_key
        if first_plan and self._overlap is not None and self._auto is None:
            # Measured on every overlapped rank, whatever its loads: its collective left a
            # peer given `load_in_backward` waiting where only the default's plan asked.
            _ = self._room_under_peak
        step = self._least_backward_loads(self._planned_now())
        if agree is not None:  # refused, nothing is built: the next step checks again
            agree(self._step_chunks(step))
        self._build(step, keep_host_slabs=False)
        if first_plan and self._auto is None:
            self._warn_if_nothing_resident(units_key)
            self._warn_if_nothing_loaded_in_backward()
        if self._auto is None:
            self._warn_if_over_budget(step)

    def _rank_agreement(self) -> Callable[[Sequence[tuple[str, Any]]], None] | None:
        """Where the chunks' updates communicate (distributed Muon), every rank must make
        the same calls in the same order, so plan the same chunks: ranks wrapped with
        another chunk_bytes, residency, backward loads or overlap exchanged Muon's buckets
        out of step, silently where the buckets matched in size; and a step one rank
        refuses must be refused on every rank. The optimizer's own check refuses settings
        that differ on every rank of its exchanges at once (`check_ranks_agree_on`,
        optional in the protocol; nothing to agree where no exchange spans ranks); None
        where the optimizer has none. Asked at the first plan: later ones follow choices
        the ranks agree on ("auto"'s). Without its own, an overlapped wrapper with peers
        agrees whether a rank refused (`_refusals_agreed`): its first plan communicates."""
        own = getattr(self._subset, "check_ranks_agree_on", None)
        if own is not None or self._overlap is None or not has_peers():
            return own
        return functools.partial(_refusals_agreed, device=self.device)

    def _step_options(self) -> tuple[tuple[str, Any], ...]:
        """The options that choose the chunks and whether planning them communicates."""
        return (
            ("offload chunk_bytes", self.chunk_bytes),
            ("offload overlap_forward", self._overlap is not None),
            ("offload gpu_resident_bytes", "auto" if self._auto else self._resident_budget),
            ("offload load_in_backward", self._backward_option),
        )

    def _step_chunks(self, step: OffloadedStep) -> tuple[tuple[str, Any], ...]:
        """The chunks `step` runs: their units (slices by param: their ranges are each
        rank's), residency, and which the backward loads."""
        chunks = tuple(
            (c.params, tuple(s.param for s in c.slices), c.resident) for c in step.plan.chunks
        )
        return (
            ("offload chunks loaded in the backward", tuple(step.schedule.loaded_in_backward)),
            ("offload chunks (params, sliced params, resident)", chunks),
        )

    def _grad_dtype_changed(self) -> bool:
        """Whether a param that takes grads of any dtype, planned without a grad or state
        (so in its own dtype), has a grad of another dtype now: SGD's momentum, a copy of
        the grad, takes the grad's."""
        return any(p.grad is not None and p.grad.dtype != p.dtype for p in self._grad_unseen)

    def _watch_grad_dtypes(self) -> None:
        """The params `_grad_dtype_changed` watches, for the plan just made."""
        state = self.optimizer.state
        self._grad_unseen = [
            p
            for p in self._params
            # torch 2.13's `p.grad_dtype = None`; torch 2.11 has no such params
            if getattr(p, "grad_dtype", p.dtype) is None and p.grad is None and not state.get(p)
        ]

    def _sliced_param_relaid(self) -> bool:
        """Whether a param the plan slices is no longer contiguous (`model.to(memory_format=
        torch.channels_last)` between steps): its slices are runs of its memory, so it is
        planned anew, whole."""
        return any(
            not local_tensor(piece.param).is_contiguous()
            for chunk in self._executor.chunks
            for piece in chunk.slices
        )

    def _check_state_apart(self, applied: str = "") -> None:
        """State a plan homes for the first time (created by a step, assigned or loaded by
        hand) shares no element with another state tensor or a param: homes are per
        (param, key), so state two params share would be split, and state that is a param
        (or a view of one) copied over it. Refused before it is homed, naming both
        (`applied`: what the message adds about the step that made it)."""
        state, homed = self.optimizer.state, self._executor.homes
        fresh = [
            (f"state {key!r} of param {i}", local_tensor(value))
            for i, p in enumerate(self._params)
            for key, value in state.get(p, {}).items()
            if isinstance(value, Tensor) and value.ndim >= 1 and (p, key) not in homed
        ]
        if not fresh:
            return
        named = [(f"param {i}", local_tensor(p)) for i, p in enumerate(self._params)]
        named += [
            (f"state {key!r} of param {self._index[p]}", local_tensor(home.home_state))
            for (p, key), home in homed.items()
        ]
        fresh_names = {name for name, _ in fresh}

        def refuse(name: str, other: str) -> None:
            if name in fresh_names or other in fresh_names:  # else: params, or homed state
                raise ValueError(
                    f"{name} shares memory with {other}: CPUOffloadOptimizer keeps each "
                    "param's state tensors in host memory of their own, which would split "
                    "what the optimizer shares; keep such state apart per param, or do not "
                    f"offload this optimizer{applied}"
                )

        for cluster in _overlapping_spans(fresh + named):
            _check_cluster_apart(cluster, refuse)

    def _check_state_shapes(self, specs: Sequence[ParamSpec]) -> None:
        """State a new plan adopts into its homes (assigned by hand, or created by a step
        before it) shaped as the plan homes it: copied in, a broadcastable one would fill
        it. Checked before anything is built."""
        state = self.optimizer.state
        for index, (param, spec) in enumerate(zip(self._params, specs, strict=True)):
            for kept in spec.state:
                if kept.key in state.get(param, ()):
                    fix = "assign a tensor shaped as the param's state"
                    _check_state_shape(index, kept.key, state[param][kept.key], kept.shape, fix)

    def _warn_if_nothing_resident(self, units_key: tuple[tuple[int, ...], ...]) -> None:
        """A `gpu_resident_bytes` too small for the first unit residency takes keeps nothing."""
        # Whether a unit is resident, not this rank's bytes: a rank may hold none of it.
        if self._resident_budget == 0 or any(c.resident for c in self._executor.plan.chunks):
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
            stacklevel=user_stacklevel(),
        )

    def _warn_if_nothing_loaded_in_backward(self) -> None:
        """A `load_in_backward` byte count too small for the first staged chunk loads none."""
        budget = self.backward_load_bytes
        if not self._load_in_backward or self._load_first_wait or budget is None:
            return
        plan, schedule = self._executor.plan, self._executor.schedule
        staged = [plan.chunks[c].invariant_bytes for c in schedule.staged]
        if schedule.loaded_in_backward or not staged:
            return
        warnings.warn(
            f"load_in_backward={budget} loads nothing in the backward: it loads whole "
            f"chunks, and the first the step stages holds {staged[0]} bytes of state. Give "
            "at least that, True for the ring's chunks, or False",
            stacklevel=user_stacklevel(),
        )

    def _warn_if_over_budget(self, step: OffloadedStep) -> None:
        """A `gpu_budget_bytes` that leaves this rank no room for the default's backward
        loads beside the staging ring: the forward then waits for every load."""
        budget, schedule = self._gpu_budget_bytes, step.schedule
        if budget is None or schedule.backward_loads or not schedule.staged:
            return
        first = step.plan.chunks[schedule.staged[0]].invariant_bytes
        one = self._step_plan(self._resident_budget, BackwardLoads(budget=first)).held_bytes
        if one <= budget:
            return  # this rank could load one: another rank's budget cut them all
        warnings.warn(
            f"gpu_budget_bytes={budget} leaves no room for the backward's loads: the staging "
            f"ring holds {step.held_bytes} bytes of GPU memory for state, and loading the "
            f"first chunk in the backward as well {one}. Give at least {one} bytes, or fewer "
            "staging_slots or a smaller chunk_bytes; as it is, the next forward waits for "
            "every load",
            stacklevel=user_stacklevel(),
        )

    def _specs_of(
        self, subset: SubsetStep, layout: Callable[[Tensor], StateLayout]
    ) -> list[ParamSpec]:
        """What planning needs of each param, from the state `layout` says it keeps."""
        splits = isinstance(subset, SlicingSubsetStep)
        specs = []
        for p in self._params:
            state = tuple(StateSpec(k, torch.Size(s), d) for k, (s, d) in layout(p).items())
            splittable = p not in self._stepped_whole and _sliceable(
                p, [(s.shape, s.dtype) for s in state], splits
            )
            specs.append(ParamSpec(invariant_numel(p), state, splittable))
        return specs

    def _step_plan(self, resident_bytes: int, backward: BackwardLoads | None) -> OffloadedStep:
        """The step's plan (`step_plan`) with `resident_bytes` resident and `backward`'s loads.

        While "auto" searches, each plan is made once (`_search_plan`)."""
        return self._search_plan(
            (resident_bytes, backward), lambda: self._step_plan_now(resident_bytes, backward)
        )

    def _step_plan_now(self, resident_bytes: int, backward: BackwardLoads | None) -> OffloadedStep:
        return plan_offloaded_step(
            self._units_key,
            self._specs,
            chunk_bytes=self.chunk_bytes,
            staging_slots=self.staging_slots,
            resident_bytes=resident_bytes,
            overlap=self._overlap is not None,
            backward=backward,
            host_room_for_all=self._host_room_for_all,
        )

    def _search_plan(self, key: Any, plan: Callable[[], Any]) -> Any:
        """`plan()`, made once per `key` while "auto" searches and nothing it is planned
        from changes: a re-plan step's host work outlasts what the backward still queued on
        the device covers (the device idles until the step's work is enqueued), and the search
        asks for the same plans at several steps (what fits, the split it re-plans to, where
        the state goes home). Pure plans: sharing is safe."""
        if self._auto is None:
            return plan()
        of = (
            self._units_key,
            self._specs,
            self.chunk_bytes,
            self.staging_slots,
            self._overlap is not None,
            self._host_room_for_all,
        )
        last = self._search_plans_of
        if not last or last[0] is not of[0] or last[1] is not of[1] or last[2:] != of[2:]:
            self._search_plans, self._search_plans_of = {}, of
        if key not in self._search_plans:
            self._search_plans[key] = plan()
        return self._search_plans[key]

    def _planned_now(self) -> OffloadedStep:
        """The step's plan with the options as they are now (a byte budget, or what "auto"
        runs)."""
        backward = None
        if self._load_in_backward:
            backward = (
                self._first_wait_loads()
                if self._load_first_wait
                # the tuning's bytes, within the budget also where a re-plan's chunks
                # (a regrouped Muon group's) hold more for them
                else BackwardLoads(budget=self.backward_load_bytes, most=self._loads_bound())
            )
        return self._step_plan(self._resident_budget, backward)

    def _loads_bound(self) -> int | None:
        """What the default's backward loads may hold with the ring (`gpu_budget_bytes`;
        "auto" weighs its budget itself, and tries the default's loads unbounded)."""
        return None if self._auto is not None else self._gpu_budget_bytes

    def _planned_with(self, split: Split) -> OffloadedStep:
        """The step's plan with `split` (as `_replan` runs it)."""
        backward = None
        if self._overlap is not None and (
            split.backward_load_bytes > 0 or self._insist_on_backward_loads
        ):
            backward = BackwardLoads(budget=split.backward_load_bytes or None)
        return self._step_plan(split.resident_bytes, backward)

    def _held_bytes(self, split: Split) -> int:
        """GPU bytes for state the plan of `split` holds at most: its resident state, the
        ring and the backward's extra slots (held together from `step()` on)."""
        return self._planned_with(split).held_bytes

    def _first_wait_loads(self) -> BackwardLoads:
        """What the default backward loads (forward overlap without "auto"): the chunks
        holding what the forward first waits for, and more while the step holds no more
        than its share of the room under the measured peak, within `gpu_budget_bytes`."""
        first = tuple(self._index[p] for p in self._overlap.first_wait(self._index))
        return BackwardLoads(
            first_wait=first, room=self._room_for_state(), most=self._loads_bound()
        )

    def _least_backward_loads(self, step: OffloadedStep) -> OffloadedStep:
        """The default's backward loads of a plan `_ensure_plan` builds (first-wait, or the
        tuning's bytes), the fewest any rank's room or `gpu_budget_bytes` holds (one
        collective): each rank's slots hold its own shards, and a budget may be the rank's
        own (its free memory), while ranks exchanging in their updates (distributed Muon)
        must run the same chunks. Every
        overlapped wrapper with peers joins, whatever its options (a rank given
        `load_in_backward`, or a budget, where its peers were not, left them waiting);
        plans are built on every rank at the same steps (the first, and where the groups,
        state or grads change alike on every rank)."""
        if self._overlap is None or not has_peers():
            return step
        schedule = step.schedule
        # the default's, and the tuning's bytes after it (both cut by a budget); those
        # given as True or bytes load the same chunks on every rank, and agree as they are
        agreeing = self._load_in_backward and self._auto is None
        mine = schedule.backward_loads if agreeing else _NOT_AGREEING
        least = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        count = int(least.item())
        if not agreeing or count == schedule.backward_loads:
            return step
        # the leading chunks' rank-invariant bytes load just those on every rank
        loads = sum(step.plan.chunks[c].invariant_bytes for c in schedule.staged[:count])
        return self._step_plan(self._resident_budget, BackwardLoads(budget=loads))

    def _default_backward_bytes(self) -> int:
        """What the backward loads without "auto" (`_first_wait_loads`, of the plan with
        nothing resident, the room under the peak measured now), for "auto" to try."""
        return self._step_plan(0, self._first_wait_loads()).backward_load_bytes

    def _room_for_state(self) -> int | None:
        """What the step's state may hold on the device without raising its peak: the
        share of the room under the peak the default's backward loads fill (None off
        CUDA)."""
        room = self._room_under_peak
        return None if room is None else int(BACKWARD_ROOM_SHARE * room)

    def _run_auto(self, auto: AutoResidency) -> None:
        """ "auto"'s decision at this step: re-plan with the split it returns (the state
        moves on the trainer's stream, `_replan`); once it has settled, say what it
        chose."""
        plan = self._executor.plan
        shape = StepShape(
            tuple(c.invariant_bytes for c in plan.chunks),
            tuple(u.bytes for u in unit_sizes(self._units_key, self._specs)),
            self._overlap is not None,
            getattr(self._subset, "slices_params", False),
        )
        # The ring was held at the measured peak: it is the optimizer's to hold again.
        ring = plan.ring_bytes(self._executor.schedule.slots, self.staging_slots)
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
        ran = Split(self._resident_budget, self._backward_loads_chosen())
        if (
            auto.measuring
            and split is not None
            and not self._planned_with(split).backward_load_bytes
        ):
            auto.settle_on(ran)  # loading ahead, it would load no whole chunk: no re-plan
            split = None
        if split is not None:
            try:
                self._replan(split, auto.failed_ranks)
            except BaseException:
                auto.settle_on(ran)  # the state is home; the next step plans `ran` again
                if auto.choice is not None:
                    self._say_what_auto_chose(auto.choice)
                raise
        if settled is not None:
            self._say_what_auto_chose(settled)

    def _run_tuning(self, tuning: BackwardTuning) -> None:
        """The default's backward loads at this step (`BackwardTuning.decide`): re-planned
        with more leading chunks, or fewer (a round undone, or checked against the bytes
        before it), a byte budget from then on; once it is done, said in one line."""
        if not tuning.deciding:
            return
        executor = self._executor
        plan, schedule = executor.plan, executor.schedule
        staged = [plan.chunks[c].invariant_bytes for c in schedule.staged]
        loaded = sum(plan.chunks[c].invariant_bytes for c in schedule.loaded_in_backward)
        held = plan.held_bytes(schedule.slots, schedule.ring_slots)
        headroom = device_headroom_bytes(self.device)
        resident, budget = self._resident_budget, self._gpu_budget_bytes

        def limit(backward: int) -> str | None:
            step = self._step_plan(resident, BackwardLoads(budget=backward))
            if budget is not None and step.held_bytes > budget:
                return "gpu_budget_bytes"
            return "the device's headroom" if step.held_bytes - held > headroom else None

        device = self.device
        try:
            chosen, done = tuning.decide(
                staged, loaded, limit, lambda most, least: agree_across_ranks(most, least, device)
            )
        except BaseException:  # once: the loads stay as they are
            self._tuning = None
            self.backward_tuning = tuple(tuning.rounds)
            raise
        if done:
            self._tuning = None
        if chosen is not None:
            first_wait, self._load_first_wait = self._load_first_wait, False
            try:
                self._replan(
                    Split(resident, chosen),
                    lambda failed: failed_ranks(failed, device),
                    "load_in_backward's default",
                )
            except BaseException:
                self._load_first_wait, self._tuning = first_wait, None
                self._say_what_tuning_chose(tuning, failed=True)
                raise
        if done:
            self._say_what_tuning_chose(tuning)

    def _say_what_tuning_chose(self, tuning: BackwardTuning, failed: bool = False) -> None:
        """One line, once the tuning is done (`failed`: its last re-plan failed, and what
        ran before runs again)."""
        self.backward_tuning = tuple(tuning.rounds)
        if not tuning.rounds:
            return  # nothing timed (the CPU)
        mib = 2**20
        rounds = "; ".join(
            f"stalled {r.stall_ms:.1f} ms of a {r.iteration_ms:.1f} ms step, loads at "
            f"{r.load_bytes_per_ms * 1000 / 2**30:.2f} GiB/s, backward {r.backward_ms:.1f} ms: "
            f"{r.loaded_bytes / mib:.1f} -> {r.chosen_bytes / mib:.1f} MiB"
            + ("" if r.held_back_by is None else f" (held back by {r.held_back_by})")
            for r in tuning.rounds
        )
        executor = self._executor
        running = (  # after a failed re-plan none is held: the one the next step builds
            self._planned_now()
            if executor.plan is None
            else OffloadedStep(executor.plan, executor.schedule)
        )
        logger.info(
            "load_in_backward's default loads %.1f MiB of state in the backward (%s)%s",
            running.backward_load_bytes / mib,
            rounds,
            "; the last re-plan failed, and what ran before runs again" if failed else "",
        )

    def _backward_loads_chosen(self) -> int:
        return (self.backward_load_bytes or 0) if self._load_in_backward else 0

    def _say_what_auto_chose(self, choice: ResidencyChoice) -> None:
        self._auto = None
        self._search_plans, self._search_plans_of = {}, ()
        # What runs, not the split's label: a split's backward bytes are a cap (True loads
        # a ring's worth under a label of 0), and the ring may outgrow a budget. After a
        # failed re-plan no plan is held: the one the next step builds again.
        running = (
            self._planned_now()
            if self._executor.plan is None
            else OffloadedStep(self._executor.plan, self._executor.schedule)
        )
        choice = dataclasses.replace(
            choice,
            backward_load_bytes=running.backward_load_bytes,
            held_bytes=running.held_bytes,
        )
        self.residency = choice
        self.gpu_resident_bytes = choice.resident_bytes
        budget = self._gpu_budget_bytes  # the user's: a measured one is passed by design
        if budget is not None and choice.held_bytes > budget:
            warnings.warn(
                f"gpu_resident_bytes='auto' holds {choice.held_bytes} bytes of GPU memory for "
                f"state, over the gpu_budget_bytes={budget} given: no split fits it (the "
                "staging ring holds more). Give a budget of at least "
                f"{choice.held_bytes} bytes, or fewer staging_slots or a smaller chunk_bytes",
                stacklevel=user_stacklevel(),
            )
        probes = "; ".join(
            f"{p.split.resident_bytes / 2**30:.2f}+{p.split.backward_load_bytes / 2**30:.2f} GiB "
            f"{p.iteration_ms:.1f} ms (+-{p.error_ms:.1f})"
            for p in choice.probes
        )
        logger.info(
            "gpu_resident_bytes='auto' chose %d bytes (%d units) resident and %d loaded in "
            "the backward, of %d bytes of state, holding %d bytes of GPU memory for state "
            "with the staging (budget %d; the host slabs keep room for all the state); the "
            "trainer stalled %.1f ms a step for the offloaded step, predicted %.1f ms with "
            "this choice%s",
            choice.resident_bytes,
            choice.resident_units,
            choice.backward_load_bytes,
            choice.state_bytes,
            choice.held_bytes,
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
        if choice.reference is not None:
            logger.info(
                "gpu_resident_bytes='auto': checked against the largest split it tried, "
                "%d bytes resident and %d loaded in the backward, run again just before: "
                "%.1f ms a step (the search measured %.1f ms)",
                choice.reference.split.resident_bytes,
                choice.reference.split.backward_load_bytes,
                choice.reference.iteration_ms,
                next(p.iteration_ms for p in choice.probes if p.split == choice.reference.split),
            )

    def _replan(
        self,
        split: Split,
        failed_ranks: Callable[[bool], list[int]],
        chooser: str = "gpu_resident_bytes='auto'",
    ) -> None:
        """Run from this step with `split` kept off the forward's path (host slabs kept);
        `chooser` chose it (named where it fails).

        Every rank re-plans at this step, and `failed_ranks(failed here)` says on which it
        failed: if on any, every rank goes back to what ran before (the state in its host
        homes, planned anew at the next step) and raises, so no rank steps alone (its peers
        would wait for it in the next collective, or step params it did not).

        The state moves on the trainer's stream after the last step's write-backs, while the
        device still runs the backward: the host waits only, with peers, for their word.
        State resident before and after is copied device to device, where the old slabs
        may be held beside the new plan (`_resident_in_place`): only the state whose
        residency changes crosses the host link."""
        if self._overlap is not None:
            self._overlap.finish()
        ran = (self._resident_budget, self._load_in_backward, self.backward_load_bytes)
        error: Exception | None = None
        stays: frozenset[tuple[Tensor, str]] = frozenset()
        keep_on_device = False
        try:
            step = self._planned_with(split)
            stays = self._resident_in_place(step)
            keep_on_device = self._both_plans_fit(step)
        except Exception as err:
            error = err
        self._give_back_gpu_state(stays, keep_on_device)
        self._resident_budget = split.resident_bytes
        if self._overlap is not None:
            backward = split.backward_load_bytes
            self._load_in_backward = backward > 0 or self._insist_on_backward_loads
            self.backward_load_bytes = backward if backward > 0 else None
        try:
            if error is None:
                self._build(step, keep_host_slabs=self._host_room_for_all)
        except Exception as err:
            error = err
        except BaseException:  # an interrupt: no agreeing with peers, which stop too
            self._give_back_gpu_state()
            self._forget_plan(ran)
            raise
        failed = failed_ranks(error is not None)
        if not failed:
            return
        self._give_back_gpu_state()
        self._forget_plan(ran)
        if error is not None:
            raise error
        raise RuntimeError(
            f"{chooser}: re-planning to {split.resident_bytes} bytes resident "
            f"and {split.backward_load_bytes} loaded in the backward failed on rank(s) "
            f"{failed}, so no rank ran this step; every rank steps what ran before from the "
            "next step (see the failing rank's error)"
        )

    def _forget_plan(self, ran: tuple[int, bool, int | None]) -> None:
        """After a re-plan that failed (here or on a peer), with the state in its host
        homes: the options that ran before, planned anew at the next step, and what the
        failed plan allocated goes now."""
        self._resident_budget, self._load_in_backward, self.backward_load_bytes = ran
        self._executor.forget()

    def _give_back_gpu_state(
        self, stays: frozenset[tuple[Tensor, str]] = frozenset(), keep_on_device: bool = False
    ) -> None:
        """Before a re-plan within one host layout: resident state, but `stays`, to its room
        in the host slabs, and the staging slots dropped, or with `keep_on_device` held
        until the new plan has copied from them what it would load
        (`StepExecutor.give_back_gpu_state`)."""
        self._executor.give_back_gpu_state(
            self._search_plan(
                "home",
                lambda: plan_offload(
                    self._units_key, self._specs, self.chunk_bytes, host_room_for_all=True
                ),
            ),
            stays,
            keep_on_device,
        )

    def _both_plans_fit(self, step: OffloadedStep) -> bool:
        """Whether the plan running now and `step` may be held at once, for the re-plan to
        copy device to device the state the backward loaded and the resident state leaving
        the device (`StepExecutor.give_back_gpu_state`): within the `gpu_budget_bytes`
        given, or else `step` within the device's headroom (free at the peak so far, which
        the plan running now held)."""
        executor = self._executor
        if executor.plan is None:
            return False
        budget = self._gpu_budget_bytes
        if budget is None:
            return step.held_bytes <= device_headroom_bytes(self.device)
        held = executor.plan.held_bytes(executor.schedule.slots, executor.schedule.ring_slots)
        return held + step.held_bytes <= budget

    def _resident_in_place(self, step: OffloadedStep) -> frozenset[tuple[Tensor, str]]:
        """The state (param, key) resident now and in `step` (`chunk_plan.resident_in_both`),
        to copy device to device instead of through the host, where the old resident slabs
        may be held beside `step`'s resident slabs (they are freed before its staging is
        allocated): within the `gpu_budget_bytes` given, or else what that holds beyond the
        old plan within the device's headroom (free at the peak so far, which the old plan
        held). Empty: all resident state goes home."""
        executor = self._executor
        if executor.plan is None:
            return frozenset()
        stays = resident_in_both(executor.plan, step.plan)
        both = executor.plan.resident_bytes + step.plan.resident_bytes
        budget = self._gpu_budget_bytes
        if budget is None:
            held = executor.plan.held_bytes(executor.schedule.slots, executor.schedule.ring_slots)
            fits = both - held <= device_headroom_bytes(self.device)
        else:
            fits = both <= budget
        return frozenset((executor.params[i], key) for i, key in stays) if fits else frozenset()

    def _build(self, step: OffloadedStep, keep_host_slabs: bool, ring: bool = True) -> None:
        """Allocate and lay out `step`'s plan (`StepExecutor.build`), moving any existing
        state home; the serial path builds without the `ring` (it stages all state).
        `keep_host_slabs`: only for another residency of the same units and state (with room
        for all, one host layout homes each state tensor in one place); a plan of other
        units or state lays the slabs out otherwise, and moved within them, one tensor's
        new home overwrote another's old one."""
        self._not_kept = set()
        slot_bytes = step.plan.staging_bytes(1)
        if ring and slot_bytes > max(2 * self.chunk_bytes, OVERSIZED_UNIT_WARN_BYTES):
            mib = 2**20
            warnings.warn(
                f"a unit of the wrapped optimizer holds {slot_bytes / mib:.0f} MiB of state, "
                f"more than chunk_bytes ({self.chunk_bytes / mib:.0f} MiB), and it cannot be "
                f"split: the GPU staging ring takes {self.staging_slots} x "
                f"{slot_bytes / mib:.0f} MiB. For a param stepped whole (a param of "
                f"muon.Muon's AdamW groups, e.g. an embedding, or a matrix it "
                f"orthogonalizes on its own rank): fewer staging_slots, or shard it over "
                f"more ranks (FSDP2); for one of Muon's exchanged buckets: a smaller "
                f"bucket_cap_bytes (muon_offload.setup_optimizer caps it).",
                stacklevel=user_stacklevel(),
            )
        executor = self._executor
        old_slabs = [*executor.host_slabs.values(), *executor.resident_slabs.values()]
        executor.build(step, ring=ring, keep_host_slabs=keep_host_slabs)
        self._hold_unhomed(old_slabs)
        if self._load_first_wait and ring:
            self.backward_load_bytes = step.backward_load_bytes
        if self._overlap is not None:
            self._overlap.set_chunks(
                [chunk.touched for chunk in self._executor.chunks],
                self._unit_ends(self._units_key),
                step.schedule,
            )

    def _hold_unhomed(self, old_slabs: Sequence[Tensor]) -> None:
        """State the new plan does not home but the last one did (a Muon group switched to
        AdamW keeps its momentum buffer, as plain Muon keeps it) moves to a host tensor of
        its own: as a view of an old slab, it held that whole slab (pinned host memory, or
        GPU memory beyond the budget)."""
        old = {slab.untyped_storage().data_ptr() for slab in old_slabs}
        new = {*self._executor.host_slabs.values(), *self._executor.resident_slabs.values()}
        if not old - {slab.untyped_storage().data_ptr() for slab in new}:
            return  # the slabs stayed: whatever they hold, they hold anyway
        homed = self._executor.homes
        for param, entries in self.optimizer.state.items():
            for key, value in entries.items():
                if not isinstance(value, Tensor) or (param, key) in homed:
                    continue
                local = local_tensor(value)
                if local.untyped_storage().data_ptr() in old:
                    entries[key] = as_state(param, local.to("cpu", copy=True))

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
        if room is not None and has_peers():
            least = torch.tensor([room], dtype=torch.int64, device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            room = int(least.item())
        return room

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
        executor = self._executor
        if executor.plan is None and self._unhomed_state():  # loaded before the first step
            self._build_serial_plan()
        self._take_replaced_state()
        if self._plan_from_state:  # state of another dtype than its home's, loaded or assigned
            self._build_serial_plan()
            self._plan_from_state = False
        self._check_host_memory_for_new_state()
        staged = executor.stage_all()
        try:
            with attributes_set(self.optimizer, scaling):
                loss = step_without_hooks(self.optimizer, closure)
        finally:  # interrupted too: the state goes home as the step left it, as plain torch's
            executor.write_back_staged(staged)
            if self._unhomed_state():  # created on the device by this step: move it home
                executor.wait()  # the new slabs copy the old homes, once written back
                self._build_serial_plan(" (this step ran: its update is applied)")
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

    def _unhomed(self) -> set[tuple[Tensor, str]]:
        """(param, key) of each state tensor (ndim >= 1) without a home."""
        homed = self._executor.homes
        return {
            (p, k)
            for p in self._params
            for k, v in self.optimizer.state.get(p, {}).items()
            if isinstance(v, Tensor) and v.ndim >= 1 and (p, k) not in homed
        }

    def _unhomed_state(self) -> bool:
        """Whether state is without a home that the plan may keep (`_not_kept`)."""
        return bool(self._unhomed() - self._not_kept)

    def _build_serial_plan(self, applied: str = "") -> None:
        self._check_state_apart(applied)
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
        step = plan_offloaded_step(
            units,
            specs,
            chunk_bytes=2**62,  # one chunk: all state staged at once
            staging_slots=self.staging_slots,
            resident_bytes=0,
            overlap=False,
            backward=None,
        )
        self._build(step, ring=False, keep_host_slabs=False)


def _same_view(a: Tensor, b: Tensor) -> bool:
    """`a` and `b` view the same elements alike (copying one into the other is a no-op)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _remove_handles(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def _nothing(*args: Any) -> None:
    pass


def _refuse_direct_step(wrapper: CPUOffloadOptimizer | None) -> None:
    """A step pre-hook on the wrapped optimizer: its own `step()`, called from outside the
    wrapper's, would step the state in the wrapper's host homes beside the wrapper, or
    fail on their device with an error that names neither."""
    # With no state yet, a step that creates it (DCP's state dict functions step at lr 0
    # to) runs as torch's, on the device: the wrapper's next step homes what it made.
    if wrapper is None or wrapper._stepping or not wrapper.optimizer.state:
        return
    name = type(wrapper.optimizer).__name__
    raise RuntimeError(
        f"this {name} is wrapped by a CPUOffloadOptimizer, which keeps its state in host "
        f"memory and steps it: call step() on the CPUOffloadOptimizer, not on the {name} "
        "(a GradScaler or trainer given the wrapped optimizer: give it the wrapper); to go "
        f"on without offload, load the wrapper's state_dict() into a new {name}"
    )
