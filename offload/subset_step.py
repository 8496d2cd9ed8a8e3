"""The subset-step protocol, and its adapter for plain torch optimizers.

An optimizer that can update a subset of its params at a time, with the same
result bit for bit as a full step, lets `CPUOffloadOptimizer` stream its state
through the GPU in chunks. The contract:

- `begin_subset_step()` replaces `step()` for one step. It captures what the
  step reads that a trainer may change before the last chunk runs (group
  hyperparameters, gradients) and advances step counters once.
- `units` partitions the params the step updates into the smallest sets that
  must update together. If the step communicates, `units` is identical on every
  rank, decided from global shapes.
- `step_params(params)` updates exactly a union of whole units. It reads state
  from `optimizer.state` at call time (the wrapper has swapped in GPU staging
  views), enqueues on the current stream and never syncs the host. Each unit
  steps once a step, so once it has, the step drops what it captured of it (its
  grads): a trainer that let go of its grads after an overlapped `step()`
  (`zero_grad()`) gets their memory back chunk by chunk, not at the step's end.
- `state_layout(param)` names the state tensors (ndim >= 1) the step keeps for
  `param`, with their local shapes and dtypes, before any step has run, so the
  host slabs can be sized and allocated once; the wrapper plans from the layout it
  gives after the first `begin_subset_step()` (options set since count). On the
  first step `step_params` may create that state; afterwards it never creates state
  (state a later step creates anyway, SGD's momentum turned on, is planned a home
  at the next step). The wrapper lays out a state tensor shaped like the param as
  the param is laid out (as
  `zeros_like(p, memory_format=torch.preserve_format)` does). For an optimizer that
  implements the protocol itself, a state_dict loaded into the wrapper gives each
  state tensor its layout's dtype (`muon.Muon`'s load keeps its momentum fp32), and a
  state tensor its layout keeps, assigned by hand in another dtype, is refused: its own
  step may cast it, or refuse it. Under `GroupSubsetStep` (torch's optimizers) a load
  casts floating state to the param's dtype, as torch's does, and a tensor assigned by
  hand goes on in its dtype, planned anew.
- Optional, `runs_collectives`: true when `step_params` of some unit runs
  collectives (Muon's exchanges), so that a step left pending must be advanced alike
  on every rank (the wrapper warns where a read outside the forward advances it).
  Then the optimizer's optional `check_ranks_agree_on(settings)` refuses, on every
  rank it exchanges with, (name, value) settings that differ between them: the wrapper
  gives it its chunks at the first plan, which order the calls. An error the optimizer
  raises on every rank at once (its own plan agreement) carries `raised_on_every_rank =
  True`: the wrapper then raises it without agreeing further, as a peer that is not
  wrapped would not join.
- Optional, `step_slices(params, slices)`: a step whose update is elementwise
  declares it can update slices of one-param units (`SlicingSubsetStep`), so a
  large param never makes a staging slot larger than a chunk.

An optimizer implements `begin_subset_step` and `state_layout` itself (duck
typing, see `muon.Muon`), or `subset_step_for` wraps it in `GroupSubsetStep`
when its per-param updates are independent.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

StateLayout = Mapping[str, tuple[torch.Size, torch.dtype]]


@runtime_checkable
class SubsetStep(Protocol):
    units: list[list[Tensor]]

    def step_params(self, params: Collection[Tensor]) -> None: ...


@dataclass(frozen=True)
class ParamSlice:
    """Elements [start, stop) of `param`'s flattened local shard (a DTensor's `to_local()`),
    and `state`: the slice's state tensors by key (flat, `stop - start` elements each; on
    the step that creates a key's state, the uninitialised memory it is created in; a key
    left out is state the step does not keep), or None: the entries swapped into
    `optimizer.state[param]` are the slice's."""

    param: Tensor
    start: int
    stop: int
    state: Mapping[str, Tensor] | None = field(default=None, compare=False, repr=False)


@runtime_checkable
class SlicingSubsetStep(SubsetStep, Protocol):
    """A subset step that can also update slices of params.

    `step_slices(params, slices)` updates the whole params `params` (as
    `step_params`) and each slice of `slices`, with the same result, bit for bit,
    as the full step, provided every element of a param is in exactly one slice
    per step. For a slice it reads `optimizer.state[param][key]` (each key whose
    tensor is shaped like the param at `begin_subset_step`) as that slice's state: a
    flat tensor of `stop - start` elements the wrapper has swapped in, also given as
    `slice.state[key]`. One that reads `slice.state` instead sets the attribute
    `reads_slice_state = True` (not a member `isinstance` checks); its calls may then
    hold several slices of one param (where they do, the swapped-in entry is one of
    them). A param's other state (the `step` counter, of shape () or (1,), ...)
    advances once per step however many slices it is cut into. Only one-param units
    whose state tensors are shaped like the param may be sliced.
    """

    def step_slices(self, params: Collection[Tensor], slices: Sequence[ParamSlice]) -> None: ...


@runtime_checkable
class SupportsSubsetStep(Protocol):
    def begin_subset_step(self) -> SubsetStep: ...

    def state_layout(self, param: Tensor) -> StateLayout: ...


# torch optimizers whose update of one element reads only that element of the
# param, grad and state (and per-param scalars such as `step`), so stepping a
# subset of a group, or slices of params, equals the full step on them.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)
# torch optimizers whose update of one param reads only that param's grad and state.
PER_PARAM_OPTIMIZERS = ELEMENTWISE_OPTIMIZERS
if hasattr(torch.optim, "Muon"):  # torch.optim.Muon orthogonalizes each param on its own
    PER_PARAM_OPTIMIZERS += (torch.optim.Muon,)

# Options that change how a torch optimizer computes, never which state it keeps;
# the meta-device dry run in `GroupSubsetStep.state_layout` turns them off.
_IMPLEMENTATION_OPTIONS = {"foreach": False, "fused": None, "capturable": False}


def step_without_hooks(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """`optimizer.step(closure)` without step hooks, its own or torch's global ones: a
    subset step runs it once per chunk and a dry run on meta-device copies, while hooks
    belong to the whole step (`CPUOffloadOptimizer` runs the optimizer's own once a step,
    and torch's global ones run for the wrapper).

    A `step` set on the instance (a user's or a tool's patch, `patched_step`) is called as
    it is (by the serial path, once a step; `CPUOffloadOptimizer` refuses one where it
    steps a subset at a time), except the one an LR scheduler built on the optimizer sets:
    it would run the hooks per chunk (the wrapper records the step for the scheduler:
    `record_step_for_lr_schedulers`).
    Private API (torch 2.11, 2.13): `Optimizer._patch_step_function` wraps a class's
    `step` (functools.wraps: `__wrapped__` is the class's own) in the function that runs
    the hooks, and marks it `hooked`.
    """
    args = () if closure is None else (closure,)  # a custom step may take no closure
    step = type(optimizer).step
    if (
        patched_step(optimizer) is None
        and getattr(step, "hooked", False)
        and hasattr(step, "__wrapped__")
    ):
        return step.__wrapped__(optimizer, *args)
    return optimizer.step(*args)


def patched_step(optimizer: torch.optim.Optimizer) -> Any | None:
    """A `step` set on `optimizer` itself (`opt.step = ...`, a user's or a tool's patch), but
    the one an LR scheduler built on it sets; else None."""
    own_step = vars(optimizer).get("step")
    if own_step is None or _is_lr_scheduler_patch(own_step, type(optimizer).step):
        return None
    return own_step


def record_step_for_lr_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """What an LR scheduler's patch of `optimizer.step` records when called: the optimizer
    has stepped (else the scheduler's first `step()` warns that it ran first). The
    offloaded step never calls that patch (`step_without_hooks`; Muon's subset step never
    calls `step`), so the wrapper records each of its steps here."""
    own_step = vars(optimizer).get("step")
    if own_step is not None and _is_lr_scheduler_patch(own_step, type(optimizer).step):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def _is_lr_scheduler_patch(own_step: Any, class_step: Any) -> bool:
    """Whether `own_step`, set on an optimizer, is an LR scheduler's patch of `class_step`.

    Private API of torch's `LRScheduler`, read here only (checked in torch 2.13's source;
    the same since pytorch#129933 added the wraps, in 2.5, so in 2.11 too): a scheduler
    built on an optimizer sets on the instance a `step` marked `_wrapped_by_lr_sched`
    (functools.wraps of the class's step, its `__wrapped__`) that sets
    `optimizer._opt_called` and calls the class's step; the scheduler's first `step()`
    warns "lr_scheduler.step() before optimizer.step()" unless `_opt_called` is set.
    Without these attributes the patch is called as any other.
    """
    return bool(getattr(own_step, "_wrapped_by_lr_sched", False)) and (
        getattr(own_step, "__wrapped__", None) is class_step
    )


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, else `t` itself."""
    local = dtensor_local(t)
    return t if local is None else local


def dtensor_local(t: Tensor) -> Tensor | None:
    """A DTensor's local shard itself (what its `to_local()` views), else None.

    Private API (`DTensor._local_tensor`; torch 2.11 and 2.13), read here only:
    `to_local()` costs a few us a call and makes a param a fresh view each time, which the
    chunked step paid a few hundred times a step on the trainer's thread.
    """
    return getattr(t, "_local_tensor", None)


def version(t: Tensor) -> int:
    """`t`'s version counter, which each in-place torch op on it (or on a view sharing it)
    bumps. `Tensor._version` is private: the one place it is read (torch 2.11 and 2.13
    checked)."""
    return t._version


class GroupStep:
    """One step of a `GroupSubsetStep`: hyperparameters and grads captured at its start."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        # Tensor hyperparameters are copied: a scheduler updates them in place.
        self._groups = [
            {k: _captured(v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups
        ]
        self._group_of: dict[Tensor, int] = {}
        self._grads: dict[Tensor, Tensor | None] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[p] = index
                self._grads[p] = p.grad
        self.units = [[p] for p in self._group_of]

    def step_params(self, params: Collection[Tensor]) -> None:
        saved_grads = {p: p.grad for p in params}
        try:
            for p in params:
                p.grad = self._grad(p)
            self._step_narrowed([(p, self._group_of[p]) for p in params])
        finally:
            for p, grad in saved_grads.items():
                p.grad = grad
        self._release(params)

    def _grad(self, param: Tensor) -> Tensor | None:
        if param not in self._grads:
            raise ValueError(
                "step_params got a param that is not in this step's units or that has "
                "already stepped this step (each unit steps once)"
            )
        return self._grads[param]

    def _release(self, params: Iterable[Tensor]) -> None:
        """Drop the captured grads of params this step is done with (nothing reads them
        again; the stream that read them was recorded on them by whoever handed them over)."""
        for p in params:
            del self._grads[p]

    def _step_narrowed(
        self, tensors: Sequence[tuple[Tensor, int]], options: Mapping[int, dict] | None = None
    ) -> None:
        """One `optimizer.step()` over the groups as this step began, each narrowed to its
        (tensor, group) entries (`options`: more per group). The live groups are set aside
        for the call: regrouped while an overlapped step is pending (fewer groups, or
        other params in them), the step still runs as it began, as it would have in
        `step()`; a group added since takes no part in it."""
        narrowed = [{**group, "params": []} for group in self._groups]
        for t, index in tensors:
            narrowed[index]["params"].append(t)
        for index, extra in (options or {}).items():
            narrowed[index].update(extra)
        optimizer = self._optimizer
        live = optimizer.param_groups
        optimizer.param_groups = narrowed
        try:
            step_without_hooks(optimizer)
        finally:
            optimizer.param_groups = live


def _captured(option: Any) -> Any:
    """A group option as the step reads it later: tensors copied, also inside a tuple or
    list (`betas=(torch.tensor(0.9), ...)`), which a schedule may fill in place."""
    if isinstance(option, Tensor):
        return option.clone()
    if type(option) in (tuple, list):
        return type(option)(map(_captured, option))
    return option


class ElementwiseGroupStep(GroupStep):
    """A `GroupStep` of an elementwise optimizer: it can also update slices of params.

    Every param and slice steps as a stand-in: its plain local shard (a flat view of it
    for a slice), with the matching view of its grad and state. The math per element
    is the same as on the param, and a stand-in skips tensor-subclass dispatch: a
    DTensor costs every foreach op a sharding pass on the host, which, once per chunk,
    made the host the bottleneck of an overlapped step (`bench/train_step.py --trace`
    shows it). A whole param's stand-in steps the param's own scalar state (`step`,
    ...) in place, as torch does; a sliced param's is copied from its value at the
    step's start into each slice's stand-in, so every slice computes with the same
    counters, and the result (the same from every slice) is copied into the param's
    own scalar tensors, in place as torch steps them. A scalar is any state not shaped
    like the param, whatever its dims: a counter of shape (1,) (a checkpoint's, one
    assigned by hand) given to every slice as its state was stepped once a slice. A
    slice's state is its `ParamSlice.state` (`reads_slice_state`), so one call may take
    several slices of a param; a slice carrying none (None) reads the entries swapped
    into the optimizer's state, one slice of a param a call, or is refused.
    """

    reads_slice_state = True  # `_stand_in`: one call may take several slices of a param

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        state = optimizer.state
        self._had_state = {p for p in self._group_of if state.get(p)}
        # Told apart now, by size (a DTensor's state is placed as it is: global sizes, no
        # unwrap): a slice's state, swapped in by the caller for the call, has no param's
        # size.
        self._not_param_sized: set[tuple[Tensor, str]] = set()
        for p in self._had_state:
            numel = p.numel()
            for k, v in state[p].items():
                if isinstance(v, Tensor) and v.ndim and v.numel() != numel:
                    self._not_param_sized.add((p, k))
        self._scalars: dict[Tensor, dict[str, Any]] = {}  # sliced params': at the step's start
        self._own_scalars: dict[Tensor, dict[str, Any]] = {}  # sliced params': their own
        self._left: dict[Tensor, int] = {}  # elements of a sliced param still to step
        self._flat_grads: dict[Tensor, Tensor] = {}  # of sliced params still to step
        self._fresh_momentum, self._sparse = _per_tensor_buckets(
            optimizer, self._group_of, self._grads
        )

    def step_params(self, params: Collection[Tensor]) -> None:
        self.step_slices(params, ())

    def step_slices(self, params: Collection[Tensor], slices: Sequence[ParamSlice]) -> None:
        state = self._optimizer.state
        self._check_swapped_in(slices)
        stand_ins, unmade = [], []
        try:  # whatever raises, no stand-in stays in the optimizer's state
            for param, piece in [(p, None) for p in params] + [(s.param, s) for s in slices]:
                if self._grad(param) is None:  # the full step skips a param without a grad
                    continue
                stand_in, entries = self._stand_in(param, piece)
                stand_ins.append((param, stand_in))
                state[stand_in] = entries
            if stand_ins:
                groups = {self._group_of[p] for p, _ in stand_ins}
                unmade = self._unmade_momentum(stand_ins)
                self._step_narrowed(
                    [(t, self._group_of[p]) for p, t in stand_ins] + unmade,
                    {g: self._implementation(g, stand_ins) for g in groups},
                )
        finally:
            for p, stand_in in stand_ins:
                # as torch, no entry for a param the step keeps no state for (SGD, momentum 0)
                if stepped := state.pop(stand_in, {}):
                    state[p].update(stepped)
            for empty, _ in unmade:
                state.pop(empty, None)
        # A caller holding a sliced param's `state[param]["step"]` reads the result in it.
        for param in {s.param: None for s in slices}:
            for key, own in self._own_scalars.get(param, {}).items():
                if isinstance(own, Tensor) and state[param][key] is not own:
                    own.copy_(state[param][key])
                    state[param][key] = own
        self._release(params)
        for param in self._finished(slices):
            flat = self._flat_grads.pop(param, None)
            grad = self._grads[param]
            local = None if grad is None else local_tensor(grad)
            if flat is not None and local is not None and _writable_copy(flat, local):
                # a copy (a grad with no flat view): what the step wrote into it in place
                # (foreach SGD's nesterov adds the momentum into the grads) goes back
                local.copy_(flat.view(local.shape))
            # A shorter shard's trailing slices are empty, and still step (on the first step
            # they create their slice's state): they get an empty grad.
            self._grads[param] = None if local is None else local.new_empty(0)

    def _check_swapped_in(self, slices: Sequence[ParamSlice]) -> None:
        """Refuse, before anything is touched, a slice carrying no state whose entries
        swapped into the optimizer's state cannot be its own: the call holds another such
        slice of its param, or an entry is not a flat tensor of the slice's length."""
        swapped = collections.Counter(s.param for s in slices if s.state is None)
        for piece in slices:
            param = piece.param
            if piece.state is not None or param not in self._had_state or self._grad(param) is None:
                continue
            own = self._optimizer.state[param]
            length = piece.stop - piece.start
            if swapped[param] > 1 or any(
                local_tensor(own[k]).shape != (length,) for k in self._sliced_keys(param)
            ):
                raise ValueError(
                    f"a slice [{piece.start}, {piece.stop}) of a param of shape "
                    f"{tuple(param.shape)} carries no state (ParamSlice.state), and "
                    + (
                        f"the call holds {swapped[param]} such slices of it"
                        if swapped[param] > 1
                        else "optimizer.state holds no state of its length for it"
                    )
                    + ": swap each slice's state in, one slice of a param a call, or give "
                    "it in ParamSlice.state"
                )

    def _sliced_keys(self, param: Tensor) -> set[str]:
        """`param`'s state a slice of it steps its own slice of (shaped like the param)."""
        return {
            k
            for k, v in self._optimizer.state[param].items()
            if _is_offloaded(v) and (param, k) not in self._not_param_sized
        }

    def _stand_in(self, param: Tensor, piece: ParamSlice | None) -> tuple[Tensor, dict[str, Any]]:
        """`param`'s stand-in (a flat view for a slice) with its grad, and its state entries."""
        stand_in = local_tensor(param).detach()
        stand_in_grad = local_tensor(self._grad(param))
        if piece is not None:
            stand_in = stand_in.view(-1)[piece.start : piece.stop]
            stand_in_grad = self._flat_grad(param, stand_in_grad)[piece.start : piece.stop]
        if stand_in_grad.dtype != stand_in.dtype:
            # A param may take a grad of another dtype (`p.grad_dtype = None`, torch 2.13;
            # earlier versions refuse such grads): so may its stand-in.
            stand_in.grad_dtype = None
        stand_in.grad = stand_in_grad
        if param not in self._had_state:
            return stand_in, {}
        own = self._optimizer.state[param]
        if piece is None:  # one stand-in: it steps the param's own scalars, as torch does
            return stand_in, {k: local_tensor(v) if _is_offloaded(v) else v for k, v in own.items()}
        sliced = self._sliced_keys(param)
        if piece.state is not None:
            # a key it leaves out is not homed (options keep it no longer): not read
            entries = {k: local_tensor(piece.state[k]) for k in sliced if k in piece.state}
        else:  # the entries swapped in (`_check_swapped_in`)
            entries = {k: local_tensor(own[k]) for k in sliced}
        if param not in self._scalars:  # its scalars at the step's start, for every slice
            self._own_scalars[param] = {k: v for k, v in own.items() if k not in sliced}
            self._scalars[param] = {k: _copied(v) for k, v in self._own_scalars[param].items()}
        entries.update({k: _copied(v) for k, v in self._scalars[param].items()})
        return stand_in, entries

    def _flat_grad(self, param: Tensor, grad: Tensor) -> Tensor:
        """`grad` flattened, once for all of `param`'s slices: a view, or, for a grad with
        no flat view (transposed, expanded: a param's grad may have any strides), a
        contiguous copy holding the same values."""
        flat = self._flat_grads.get(param)
        if flat is None:
            flat = self._flat_grads[param] = grad.reshape(-1)
        return flat

    def _finished(self, slices: Sequence[ParamSlice]) -> list[Tensor]:
        """The params whose last local elements `slices` stepped."""
        done = []
        for piece in slices:
            if self._left.get(piece.param) == 0:
                continue
            left = self._left.get(piece.param, local_tensor(piece.param).numel())
            self._left[piece.param] = left = left - (piece.stop - piece.start)
            if left == 0:
                done.append(piece.param)
        return done

    def _unmade_momentum(self, stand_ins: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, int]]:
        """An empty param with a grad and no momentum buffer for each (group, dtype) of
        these stand-ins whose bucket torch steps with a buffer still to be made
        (`_per_tensor_buckets`): the chunk's call then takes torch's own mixed path (its
        momentum per tensor, the rest foreach: nesterov adds into the grads in place)."""
        if not self._fresh_momentum:  # every step but those making a buffer: per chunk
            return []
        buckets = {(self._group_of[p], t.dtype, t.device) for p, t in stand_ins}
        unmade = []
        for group, dtype, device in buckets:
            # fused SGD decides otherwise (all buffers unmade or none): no stand-in for it
            if (group, dtype) in self._fresh_momentum and not self._groups[group].get("fused"):
                empty = torch.empty(0, dtype=dtype, device=device)
                empty.grad = torch.empty_like(empty)
                unmade.append((empty, group))
        return unmade

    def _implementation(self, group: int, stand_ins: list[tuple[Tensor, Tensor]]) -> dict:
        """Pin the foreach choice torch would make for the real params (DTensors, say):
        stand-ins are plain tensors and could get a different (differently rounded) one.
        Where torch's Adagrad steps a dtype's params one tensor at a time for the whole
        group (`_per_tensor_buckets`), a chunk of them steps so too."""
        captured = self._groups[group]
        if captured.get("fused"):
            return {}
        params = [p for p, _ in stand_ins if self._group_of[p] == group]
        if any((group, p.dtype) in self._sparse for p in params):  # Adagrad's whole step
            return {"foreach": False}
        if "foreach" not in captured or captured["foreach"] is not None:
            return {}
        # Private API (torch 2.11, 2.13): the default foreach/fused choice for these params.
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        return {"foreach": foreach}


def _per_tensor_buckets(
    optimizer: torch.optim.Optimizer,
    group_of: Mapping[Tensor, int],
    grads: Mapping[Tensor, Tensor | None],
) -> tuple[set[tuple[int, torch.dtype]], set[tuple[int, torch.dtype]]]:
    """(group, dtype) buckets torch's foreach step, called on the whole group, takes down
    a per-tensor path for a property of the whole bucket (torch 2.11, 2.13): SGD's
    momentum update where a param in it has no buffer yet (`_multi_tensor_sgd`; the rest
    of its step stays foreach), and all of Adagrad's step where one has a sparse grad
    (`_multi_tensor_adagrad`). A chunk without that param would take the foreach ops,
    which round otherwise in half precision on the CPU. Returns (SGD's, Adagrad's)."""
    sgd = isinstance(optimizer, torch.optim.SGD)
    fresh: set[tuple[int, torch.dtype]] = set()
    sparse: set[tuple[int, torch.dtype]] = set()
    if not (sgd or isinstance(optimizer, torch.optim.Adagrad)):
        return fresh, sparse
    groups = optimizer.param_groups
    for param, group in group_of.items():
        grad = grads.get(param)
        if grad is None:
            continue
        if sgd:
            unmade = optimizer.state.get(param, {}).get("momentum_buffer") is None
            if groups[group]["momentum"] != 0 and unmade and not grad.is_sparse:
                fresh.add((group, param.dtype))
        elif grad.is_sparse:
            sparse.add((group, param.dtype))
    return fresh, sparse


def _kept_dtype(kept: Any, shape: torch.Size, dtype: torch.dtype) -> torch.dtype:
    """The dtype of state `kept` where it is a tensor of `shape` (else `dtype`): a wrong
    shape is left to the wrapper's check."""
    if isinstance(kept, Tensor) and local_tensor(kept).shape == shape:
        return kept.dtype
    return dtype


def _writable_copy(flat: Tensor, grad: Tensor) -> bool:
    """Whether `flat` is a copy of `grad` (not a view of it) that can be written back: an
    expanded grad (a stride of 0) holds one element in many places, and takes no write."""
    if flat.data_ptr() == grad.data_ptr():
        return False
    sizes = zip(grad.stride(), grad.shape, strict=True)
    return all(stride != 0 or size <= 1 for stride, size in sizes)


def _is_offloaded(value: Any) -> bool:
    return isinstance(value, Tensor) and value.ndim >= 1


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


class GroupSubsetStep:
    """Adapter: a torch optimizer with independent per-param updates, one param per unit.

    `step_params` narrows each param group to the requested params around one
    `optimizer.step()` call (without its step hooks: `step_without_hooks`), so the
    update runs the optimizer's own code. For an
    elementwise optimizer the step also updates slices of params (`step_slices`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # param -> (group index, index in the group), checked at each use (`_group`)
        self._positions: dict[Tensor, tuple[int, int]] = {}
        # (options, shape, dtype, grad dtype) -> the dry run's layout and every key it made
        self._layouts: dict[
            tuple[tuple, torch.Size, torch.dtype, torch.dtype], tuple[StateLayout, frozenset[str]]
        ] = {}
        # `check_state_for_options`: per group, the options it passed with, the params with
        # state it has not looked at (no grad then) and the options changed before that
        self._checked_options: list[tuple[tuple, list[Tensor], list[str]]] = []

    @property
    def slices_params(self) -> bool:
        """Whether its steps can update slices of params (`step_slices`)."""
        return type(self.optimizer) in ELEMENTWISE_OPTIMIZERS

    def begin_subset_step(self) -> GroupStep:
        # Layouts are keyed by the options' values (a float lr too, which a schedule
        # changes every step): kept for one step.
        self._layouts.clear()
        if self.slices_params:
            return ElementwiseGroupStep(self.optimizer)
        return GroupStep(self.optimizer)

    def check_state_for_options(self) -> None:
        """Refuse, naming the param and key, state made before its group's options changed
        that lacks a key the step reads with them now (amsgrad turned on: torch's AdamW
        raises a KeyError at `step()`, before anything changes; in a chunk, the chunks before
        it would have stepped). Looked at where a group's options changed since it last
        passed, as far as options choose state (`_options_choosing_state`), and for params
        with state that had no grad then, once they have one."""
        passed: list[tuple[tuple, list[Tensor], list[str]]] = []
        for g, group in enumerate(self.optimizer.param_groups):
            options = _options_choosing_state(group)
            last = self._checked_options[g] if g < len(self._checked_options) else None
            # the options changed since the params looked at last passed (for those with
            # no grad then, since before them)
            changed = list(last[2]) if last is not None and last[1] else []
            if last is None or last[0] != options:
                params = group["params"]
                before = dict(last[0]) if last is not None else {}
                changed += [k for k, v in options if k in before and before[k] != v]
                changed = list(dict.fromkeys(changed))
            elif last[1]:  # still in this group: it may have been regrouped by hand
                listed = {id(p) for p in group["params"]}
                params = [p for p in last[1] if id(p) in listed]
            else:
                params = []
            later = self._check_state_of(g, group, params, changed)
            passed.append((options, later, changed if later else []))
        self._checked_options = passed

    def _check_state_of(
        self, g: int, group: dict[str, Any], params: list[Tensor], changed: list[str]
    ) -> list[Tensor]:
        """`check_state_for_options` for `params` of group `g`, whose options `changed` since
        it last passed; returns those with state but no grad (the step skips them), to look
        at once they have one."""
        state = self.optimizer.state
        later = []
        for p in params:
            own = state.get(p)
            if not own:  # state made afresh
                continue
            if p.grad is None:
                later.append(p)
                continue
            missing = self.state_keys(p) - set(own)
            if missing:  # what the step makes over state it has (SGD's momentum) is no loss
                missing -= self._keys_made_over_state(p)
            if missing:
                name = type(self.optimizer).__name__
                k = next(i for i, q in enumerate(group["params"]) if q is p)
                raise ValueError(
                    f"param group {g}: the state of param {k} ({tuple(p.shape)}) has no "
                    f"{min(missing)!r}, which {name} reads with the group's options as they "
                    f"are now (it has {sorted(own)}); torch's {name} would raise KeyError. "
                    f"Set {_options_named(changed)} when the group is made, not once state "
                    "exists; or delete the param's state (del opt.state[param]) to start "
                    "it afresh"
                )
        return later

    def state_layout(self, param: Tensor) -> StateLayout:
        """State the optimizer will keep for `param`, found by a dry run on the meta device
        with its group's options as they are now (loaded from a state_dict, say); a state
        tensor the param has already keeps its dtype."""
        layout, _ = self._dry_run(param)
        own = self.optimizer.state.get(param)
        if own:
            # State that exists goes on in its dtype, as torch updates it in place: Adagrad's,
            # made at construction, after `model.to(torch.bfloat16)`; one assigned by hand
            # or loaded (a load casts floating state to the param's dtype); SGD's momentum
            # made from a grad of another dtype (`p.grad_dtype = None`, torch 2.13)
            layout = {
                k: (shape, _kept_dtype(own.get(k), shape, dtype))
                for k, (shape, dtype) in layout.items()
            }
        return layout

    def state_keys(self, param: Tensor) -> frozenset[str]:
        """Every key of the state the optimizer will keep for `param`, scalars (`step`)
        too: the same dry run as `state_layout`'s."""
        return self._dry_run(param)[1]

    def _dry_run(self, param: Tensor) -> tuple[StateLayout, frozenset[str]]:
        group = self._group(param)
        local = local_tensor(param)
        # SGD's momentum is a copy of the grad: in its dtype where the param takes a grad of
        # another (`p.grad_dtype = None`)
        grad_dtype = local.dtype if param.grad is None else param.grad.dtype
        key = (_state_options(group), local.shape, local.dtype, grad_dtype)
        if key not in self._layouts:
            self._layouts[key] = _meta_dry_run(self.optimizer, group, local, grad_dtype)
        return self._layouts[key]

    def _keys_made_over_state(self, param: Tensor) -> frozenset[str]:
        """The state keys a step makes for `param` when its state holds other entries
        (SGD's momentum_buffer, read with `state.get`): a dry run over a state of one
        placeholder entry; none where that raises (Adam reads every key it keeps)."""
        local = local_tensor(param)
        grad_dtype = local.dtype if param.grad is None else param.grad.dtype
        group = self._group(param)
        return _meta_dry_run(self.optimizer, group, local, grad_dtype, over_state=True)[1]

    def _group(self, param: Tensor) -> dict[str, Any]:
        """`param`'s group, as the groups are now (`opt.param_groups = ...` may regroup, a
        hand may trade params between groups): a cached position is used only where the
        live groups still hold `param`; a miss maps every param anew (the wrapper asks for
        each param, so a scan per call would be quadratic)."""
        groups = self.optimizer.param_groups
        position = self._positions.get(param)
        if position is None or not _holds(groups, position, param):
            self._positions = {
                p: (g, k) for g, group in enumerate(groups) for k, p in enumerate(group["params"])
            }
            position = self._positions[param]
        return groups[position[0]]


def _holds(groups: list[dict[str, Any]], position: tuple[int, int], param: Tensor) -> bool:
    """Whether `param` is at (group index, index in the group) of `groups`."""
    g, k = position
    return g < len(groups) and k < len(groups[g]["params"]) and groups[g]["params"][k] is param


def _state_options(group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A group's options, which may choose its state (a tensor `momentum` of 0 keeps no
    buffer), but its params' names (one per param: a key of them grew with the params
    squared)."""
    return tuple((k, _hashable(v)) for k, v in group.items() if k not in ("params", "param_names"))


def _options_named(changed: Sequence[str]) -> str:
    """The options that changed, as the refusal names them."""
    if not changed:
        return "the options that choose the state (amsgrad, momentum, centered, ...)"
    if len(changed) == 1:
        return repr(changed[0])
    return f"the one of {', '.join(map(repr, changed))} that makes it"


def _options_choosing_state(group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A group's options as far as they may choose its state: a number, or a CPU scalar
    tensor, by whether it is 0 (RMSprop keeps a momentum buffer only for momentum > 0; a
    schedule's lr moves every step), another tensor by identity, a tuple by its items."""

    def choosing(value: Any) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, numbers.Number):  # NumPy's scalars too
            return bool(value != 0)
        if isinstance(value, Tensor):
            if value.device.type == "cpu" and value.numel() == 1:  # read without a sync
                return bool(value.item() != 0)
            # By identity alone: a schedule fills a GPU lr in place each step, and reading
            # it would sync
            return id(value)
        if isinstance(value, tuple):
            return tuple(choosing(v) for v in value)
        return _hashable(value)

    return tuple((k, choosing(v)) for k, v in group.items() if k not in ("params", "param_names"))


def _hashable(value: Any) -> Any:
    if isinstance(value, Tensor):  # by identity and version: its value, read off a GPU, syncs
        return (id(value), version(value))
    try:
        hash(value)
    except TypeError:  # a list, or a tuple holding one
        return repr(value)
    return value


def _meta_dry_run(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    local: Tensor,
    grad_dtype: torch.dtype,
    over_state: bool = False,
) -> tuple[StateLayout, frozenset[str]]:
    """One step of `optimizer`'s type on a meta copy of the param: the state tensors it
    keeps (ndim >= 1), and every key of its state. With `over_state`, the param's state
    holds a placeholder entry first, and the keys are those the step made beside it (none
    where it raised)."""
    meta_param = torch.nn.Parameter(torch.empty_like(local, device="meta"))
    if grad_dtype != local.dtype:
        meta_param.grad_dtype = None
    meta_param.grad = torch.empty_like(meta_param, dtype=grad_dtype)
    options = {k: v for k, v in group.items() if k != "params"}
    options.update({k: v for k, v in _IMPLEMENTATION_OPTIONS.items() if k in options})
    shadow = type(optimizer)([{"params": [meta_param], **options}])
    placeholder = "_dry_run_placeholder"
    if over_state:
        shadow.state[meta_param][placeholder] = None
    # Scalar state (`step`) is made on the default device: under `with torch.device("meta")`
    # torch 2.11's single-tensor Adam then read it with `.item()` and raised.
    with torch.device("cpu"):
        if over_state:
            try:
                step_without_hooks(shadow)
            except Exception:  # a KeyError: it reads what it did not make
                return {}, frozenset()
            return {}, frozenset(k for k in shadow.state[meta_param] if k != placeholder)
        step_without_hooks(shadow)
    made = shadow.state[meta_param]
    layout = {
        key: (value.shape, value.dtype)
        for key, value in made.items()
        if isinstance(value, Tensor) and value.ndim >= 1
    }
    return layout, frozenset(made)


def subset_step_for(optimizer: torch.optim.Optimizer) -> SupportsSubsetStep | None:
    """The optimizer's own subset step, else an adapter, else None (serial path)."""
    if isinstance(optimizer, SupportsSubsetStep):
        return optimizer
    if type(optimizer) in PER_PARAM_OPTIMIZERS:
        return GroupSubsetStep(optimizer)
    return None
