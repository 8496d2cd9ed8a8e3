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
  views), enqueues on the current stream and never syncs the host.
- `state_layout(param)` names the state tensors (ndim >= 1) the step keeps for
  `param`, with their local shapes and dtypes, before any step has run, so the
  host slabs can be sized and allocated once. On the first step `step_params`
  may create that state; afterwards it never creates state.

An optimizer implements `begin_subset_step` and `state_layout` itself (duck
typing, see `muon.Muon`), or `subset_step_for` wraps it in `GroupSubsetStep`
when its per-param updates are independent.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

StateLayout = Mapping[str, tuple[torch.Size, torch.dtype]]


@runtime_checkable
class SubsetStep(Protocol):
    units: list[list[Tensor]]

    def step_params(self, params: Collection[Tensor]) -> None: ...


@runtime_checkable
class SupportsSubsetStep(Protocol):
    def begin_subset_step(self) -> SubsetStep: ...

    def state_layout(self, param: Tensor) -> StateLayout: ...


# torch optimizers whose update of one param reads only that param's grad and
# state, so stepping a subset of a group equals the full step on that subset.
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
if hasattr(torch.optim, "Muon"):  # torch.optim.Muon orthogonalizes each param on its own
    ELEMENTWISE_OPTIMIZERS += (torch.optim.Muon,)

# Options that change how a torch optimizer computes, never which state it keeps;
# the meta-device dry run in `GroupSubsetStep.state_layout` turns them off.
_IMPLEMENTATION_OPTIONS = {"foreach": False, "fused": None, "capturable": False}


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, else `t` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class GroupStep:
    """One step of a `GroupSubsetStep`: hyperparameters and grads captured at its start."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        # Tensor hyperparameters are copied: a scheduler updates them in place.
        self._groups = [
            {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in group.items()
                if k != "params"
            }
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
        groups = self._optimizer.param_groups
        narrowed: list[list[Tensor]] = [[] for _ in groups]
        for p in params:
            narrowed[self._group_of[p]].append(p)
        saved_groups = [dict(group) for group in groups]
        saved_grads = {p: p.grad for p in params}
        try:
            for group, captured, chosen in zip(groups, self._groups, narrowed, strict=True):
                group.update(captured)
                group["params"] = chosen
            for p in params:
                p.grad = self._grads[p]
            self._optimizer.step()
        finally:
            for group, saved in zip(groups, saved_groups, strict=True):
                group.clear()
                group.update(saved)
            for p, grad in saved_grads.items():
                p.grad = grad


class GroupSubsetStep:
    """Adapter: a torch optimizer with independent per-param updates, one param per unit.

    `step_params` narrows each param group to the requested params around one
    `optimizer.step()` call, so the update runs the optimizer's own code.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group_of = {
            p: index for index, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        self._layouts: dict[tuple[int, torch.Size, torch.dtype], StateLayout] = {}

    def begin_subset_step(self) -> GroupStep:
        return GroupStep(self.optimizer)

    def state_layout(self, param: Tensor) -> StateLayout:
        """State the optimizer will keep for `param`, found by a dry run on the meta device."""
        group_index = self._group_of[param]
        local = local_tensor(param)
        key = (group_index, local.shape, local.dtype)
        if key not in self._layouts:
            self._layouts[key] = _meta_state_layout(
                self.optimizer, self.optimizer.param_groups[group_index], local
            )
        return self._layouts[key]


def _meta_state_layout(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], local: Tensor
) -> StateLayout:
    meta_param = torch.nn.Parameter(torch.empty_like(local, device="meta"))
    meta_param.grad = torch.empty_like(meta_param)
    options = {k: v for k, v in group.items() if k != "params"}
    options.update({k: v for k, v in _IMPLEMENTATION_OPTIONS.items() if k in options})
    shadow = type(optimizer)([{"params": [meta_param], **options}])
    shadow.step()
    return {
        key: (value.shape, value.dtype)
        for key, value in shadow.state[meta_param].items()
        if isinstance(value, Tensor) and value.ndim >= 1
    }


def subset_step_for(optimizer: torch.optim.Optimizer) -> SupportsSubsetStep | None:
    """The optimizer's own subset step, else an adapter, else None (serial path)."""
    if isinstance(optimizer, SupportsSubsetStep):
        return optimizer
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return GroupSubsetStep(optimizer)
    return None
