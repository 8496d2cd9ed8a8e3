"""Muon for plain and FSDP2 (DTensor) params, with AdamW groups and the subset-step protocol.

On one device, with matching settings, `Muon` computes what torch.optim.Muon
computes, in the same order. On DTensor params it keeps those semantics
exactly: momentum is updated on the local shard in fp32, each logical matrix is
sent (in `ns_dtype`) to one owner rank, orthogonalized whole there, and each
rank applies its piece of the result. See `muon.planning` for how matrices,
buckets and owners are chosen and `muon.exchange` for how bytes move. On CUDA
the elementwise work (momentum, the cast into the exchange or Newton-Schulz
buffer, weight decay and update) runs as two fused Triton kernels with torch's
arithmetic (`muon.fused`; `muon.elementwise` selects them).

Differences from torch.optim.Muon, by design:
- 3-D params (E, out, in) are E matrices, and `row_blocks` splits a fused param
  into logical matrices; the "original" / "match_rms_adamw" lr adjustment uses
  the logical matrix's shape, so for a fused or stacked param the result
  differs from torch.optim.Muon (which sees the whole tensor).
- The momentum buffer is fp32 whatever the param dtype.
- Hyperparameters are checked by `muon.options`: momentum must be in [0, 1) and
  lr, weight_decay, eps finite, where torch.optim.Muon takes momentum 1.5 or lr inf;
  a matrix with no elements is left alone where torch's "original" lr adjustment
  divides by its zero columns.
- Same-shape matrices are orthogonalized as one batch (`baddbmm`); on CPU this
  is bitwise equal to torch's per-matrix `addmm`; on GPU cuBLAS may pick other
  kernels for a batch, so agreement there is to rounding.

Batch invariance: a matrix's update depends only on its own momentum, gradient
and hyperparameters. Everything elementwise here (momentum, the cast into the
Newton-Schulz input, weight decay, update) runs per param or per matrix
rectangle, never over a tensor that spans other matrices, so bucket cap,
`max_inflight`, offload chunking, world size and the launch's other matrices
change no bit of it; `zeropower` keeps the same promise for its batches.

Memory: between steps Muon holds its state and nothing else of size. A bucket's
exchange buffers (send, receive, full matrices: exactly its `ExchangePlan`
sizes) and Newton-Schulz workspace come from the caching allocator when the
bucket starts and go back when it finishes (`muon.planning.launch_order`,
`transient_peak_numel`). A local bucket (no exchange) allocates only the
Newton-Schulz input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adamw import adamw

from muon import elementwise, newton_schulz
from muon.exchange import (
    assemble,
    local_rect,
    return_results,
    send_slots,
    send_to_owners,
    share_across_replicas,
)
from muon.newton_schulz import every_matrix_alone, zeropower
from muon.ns_schedules import (
    DEFAULT_EPS,
    DEFAULT_NS_STEPS,
    KELLER_JORDAN_COEFFICIENTS,
    NewtonSchulzSchedule,
)
from muon.options import (
    CHECKS,
    check_adamw_flag,
    check_betas,
    check_bucket_cap_bytes,
    check_collect_timings,
    check_max_inflight,
    check_ns_coefficients,
    check_ns_steps,
    check_ns_steps_of_schedule,
    check_row_blocks,
    check_spread_model,
    ns_dtype_from,
)
from muon.planning import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_SPREAD_MODEL,
    ExchangePlan,
    Matrix,
    MuonPlan,
    ParamLayout,
    SpreadModel,
    check_matrix_sharding,
    launch_order,
)
from muon.rank_agreement import PlanDescription, check_ranks_agree

# torch.optim.AdamW defaults, used by `algorithm="adamw"` groups that do not set them.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
# Two buckets alive: bucket k+1's exchange in flight while bucket k orthogonalizes.
DEFAULT_MAX_INFLIGHT = 2


@dataclass(frozen=True, slots=True)
class BucketMetrics:
    """What one bucket did on this rank in the last step (field names shared with the planner)."""

    bucket: int
    matrices: int
    """Logical matrices in the bucket on this rank's exchange group (active this step)."""
    owned: int
    """Matrices this rank orthogonalized."""
    bytes_sent: int
    bytes_received: int
    workspace_bytes: int
    exchange_s: float | None
    """Seconds packing, exchanging and unpacking; None unless `collect_timings`."""
    ns_s: float | None
    apply_s: float | None


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's lr adjustment for one logical rows x cols matrix.

    A matrix with no elements has nothing to update: its lr is `lr`, where torch's
    "original" formula would divide by zero columns."""
    if rows == 0 or cols == 0:
        return lr
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * (0.2 * math.sqrt(max(rows, cols)))  # torch's order: the same float


@cache
def _schedule(coefficients: Any, steps: int | None) -> NewtonSchulzSchedule:
    if isinstance(coefficients, NewtonSchulzSchedule):
        return coefficients
    return NewtonSchulzSchedule.repeat(
        tuple(coefficients), DEFAULT_NS_STEPS if steps is None else steps
    )


def _placed_as(value: Tensor, p: Tensor) -> Tensor:
    """A loaded state tensor placed as its param, which the step reads shard by shard: a
    full tensor (a single-process checkpoint, torch.optim.Muon's, loaded on every rank)
    cut to this rank's shard; a DTensor placed otherwise (the model sharded another way
    since the save) redistributed; a DTensor given a plain param gathered whole. As
    they were, a shard's grad was broadcast into a whole buffer, or shapes clashed at
    the step. (A DTensor on another mesh is refused before the load.)"""
    if not isinstance(p, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if not isinstance(value, DTensor):
        return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
    if value.placements != p.placements:
        return value.redistribute(p.device_mesh, p.placements)
    return value


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(p: Tensor) -> Tensor | None:
    return None if p.grad is None else _local(p.grad)


def _stack(t: Tensor) -> Tensor:
    """A 2-D tensor as a stack of one matrix; a 3-D tensor as is."""
    return t.unsqueeze(0) if t.ndim == 2 else t


def _rect(t: Tensor, m: Matrix, origin: tuple[int, int], like: Tensor) -> Tensor:
    """The `like`-shaped rectangle at local `origin` of `t`'s local 2-D block holding `m`."""
    row0, col0 = origin
    rows, cols = like.shape
    return _stack(_local(t))[m.expert][row0 : row0 + rows, col0 : col0 + cols]


def _zeros_like_local(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeros shaped like `p`'s local shard; a DTensor on `p`'s mesh and placements if `p` is one."""
    local = torch.zeros(_local(p).shape, dtype=dtype, device=_local(p).device)
    if not isinstance(p, DTensor):
        return local
    # Wrap where the shard lies: DTensor.from_local would move a host shard (FSDP2's
    # CPUOffloadPolicy) to the mesh's device.
    meta = TensorMeta(p.shape, p.stride(), dtype)
    return DTensor(
        local,
        DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=meta),
        requires_grad=False,
    )


def _shard_dims(p: DTensor) -> tuple[int | None, ...]:
    """Per mesh axis, the tensor dim `p` is sharded on, or None (`_check_placements` lets
    only Shard, Replicate and a stack's expert-dim `_StridedShard` through)."""
    return tuple(
        q.dim % p.ndim if isinstance(q, (Shard, _StridedShard)) else None for q in p.placements
    )


def _blocks(row_blocks: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if row_blocks is None else tuple(row_blocks)


def _layout(p: Tensor, row_blocks: Sequence[int] | None, group: int) -> ParamLayout:
    blocks = tuple(row_blocks or ())
    if not isinstance(p, DTensor):
        return ParamLayout(tuple(p.shape), blocks, group=group)
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not in the mesh of a param of shape {tuple(p.shape)}")
    layout = ParamLayout(
        tuple(p.shape),
        blocks,
        tuple(mesh.shape),
        _shard_dims(p),
        tuple(coord),
        mesh_key=_mesh_key(mesh),
        group=group,
    )
    if layout.local_shape() != tuple(p.to_local().shape):
        strided = any(isinstance(q, _StridedShard) for q in p.placements)
        raise ValueError(
            f"local shard {tuple(p.to_local().shape)} of a param of shape {tuple(p.shape)} is not "
            f"torch.chunk's {layout.local_shape()} for placements {p.placements}"
            + (
                # the plan counts each rank's experts as torch.chunk's pieces hold them
                ": strided over the expert dim, the experts must divide evenly among the "
                "ranks (or shard the stack with FSDP2 on another dim: shard_placement_fn)"
                if strided
                else ""
            )
        )
    return layout


# What `Muon.__getstate__` keeps beyond torch's (defaults, state, groups).
_PICKLED_SETTINGS = (
    "ns_dtype",
    "bucket_cap_bytes",
    "max_inflight",
    "collect_timings",
    "spread_model",
    "_momentum_when_added",
    "_warned_adamw_momentum",
)


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan) with exact semantics on FSDP2 DTensor params.

    Args:
        params: params or param groups. Groups default to Muon (2-D and 3-D
            params); a group with `algorithm="adamw"` is stepped with AdamW
            (`betas`, `eps`, `lr`, `weight_decay`, `amsgrad`, `maximize`, as in
            torch.optim.AdamW; `foreach`, `fused`, `capturable` and `differentiable`
            are refused in every group). `muon.muon_param_groups`
            builds both from a model. A Muon group may set `row_blocks`: the
            rows of each logical matrix of a fused param (e.g. (q, k, v)).
        lr, weight_decay, momentum, nesterov, eps, adjust_lr_fn: as in
            torch.optim.Muon, with its defaults.
        ns_coefficients: one (a, b, c) repeated `ns_steps` times, as in
            torch.optim.Muon, or a `NewtonSchulzSchedule` (e.g. `POLAR_EXPRESS`).
        ns_steps: iterations of an (a, b, c) triple; None means 5, torch's
            default. Must be None or the schedule's length with a schedule.
        ns_algorithm: Newton-Schulz algorithm, also a group key: "standard"
            iterates on the matrix, "gram" on its small Gram matrix (cheaper for
            rectangular matrices), "auto" (default) picks per matrix shape, never
            per launch, so a matrix's result does not depend on its batch.
        ns_dtype: dtype on the wire and in Newton-Schulz: torch.bfloat16 (default) or
            torch.float32, or their names "bfloat16", "float32" (for TOML and JSON). The
            step runs with autocast off, so an enclosing autocast region changes nothing.
        bucket_cap_bytes: cap on one bucket's full-matrix bytes (in `ns_dtype`).
            A bucket's buffers and Newton-Schulz workspace live only while the
            bucket runs, so the cap bounds the step's transient memory; nothing
            is kept between steps but the state.
        max_inflight: exchanged buckets alive at once (exchange of k+1 overlaps
            Newton-Schulz of k).
        collect_timings: fill the `*_s` fields of `metrics`. This synchronizes
            the device around each phase, so it costs the overlap; off by default.
        replica_owners: under HSDP (params replicated over a mesh axis), who
            orthogonalizes a matrix, also a group key: "spread" one owner over the
            whole mesh, its result gathered across replicas; "per_replica" one per
            replica; "auto" (default) spread where `spread_model` says it pays, per
            bucket. Spread assumes the replicas hold the same gradients (HSDP
            all-reduces them); then the results are the same bits either way (a
            matrix's update does not depend on its batch).
        spread_model: the cost model of "auto" (`muon.planning.SpreadModel`: the
            Newton-Schulz FLOP/s and the bandwidth between replicas, settable).

    `load_state_dict` takes a `torch.optim.Muon` state dict too: group keys it
    lacks (`algorithm`, `row_blocks`, `ns_algorithm`, `replica_owners`) get their defaults.
    Groups are validated again at every step, so a hyperparameter or `algorithm`
    changed by hand or by a load takes effect (or raises) there. A step refuses, before
    it changes anything, sparse grads and a DTensor param's grad placed unlike the param.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] | NewtonSchulzSchedule = (
            KELLER_JORDAN_COEFFICIENTS
        ),
        eps: float = DEFAULT_EPS,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        *,
        ns_algorithm: str = "auto",
        ns_dtype: torch.dtype | str = torch.bfloat16,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        collect_timings: bool = False,
        replica_owners: str = "auto",
        spread_model: SpreadModel = DEFAULT_SPREAD_MODEL,
    ) -> None:
        ns_dtype = ns_dtype_from(ns_dtype)
        check_bucket_cap_bytes(bucket_cap_bytes)
        check_max_inflight(max_inflight)
        check_spread_model(spread_model)
        check_collect_timings(collect_timings)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_algorithm": ns_algorithm,
            "row_blocks": None,
            "algorithm": "muon",
            "replica_owners": replica_owners,
        }
        _validate_hyperparameters(defaults)
        self.ns_dtype = ns_dtype
        self.bucket_cap_bytes = bucket_cap_bytes
        self.max_inflight = max_inflight
        self.collect_timings = collect_timings
        self.spread_model = spread_model
        self.metrics: list[BucketMetrics] = []
        self._plan: MuonPlan | None = None
        self._plan_params: tuple[Tensor, ...] = ()
        self._plan_key: tuple[Any, ...] = ()
        # Each group's `momentum` when it was added (by index), to notice a scheduler
        # cycling it in AdamW groups, which do not read it (`_warn_adamw_momentum`).
        self._momentum_when_added: list[Any] = []
        self._warned_adamw_momentum = False
        self._steps_without_grads = 0  # in a row (`_warn_if_no_grads_again`)
        # id(param) -> (group index, index in the group), checked at each use (`_group_of`)
        self._positions: dict[int, tuple[int, int]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        index = len(self.param_groups)
        given = set(param_group)  # the caller's keys, before torch fills in the defaults
        _refuse_misspelled_keys(param_group, index, self.defaults)
        if param_group.get("algorithm", "muon") == "muon" and "betas" in param_group:
            raise ValueError(  # else ignored: the group's matrices would be orthogonalized
                f"param group {index} sets betas, which only AdamW groups read, but is a Muon "
                "group (algorithm defaults to 'muon'): add algorithm='adamw', or drop betas"
            )
        params = param_group["params"]
        if not isinstance(params, set):  # torch refuses a set, unordered
            params = [params] if isinstance(params, Tensor) else list(params)
            _check_listed_once(params, index, self.param_groups)
            param_group["params"] = params
        _set_group_defaults(param_group, self.defaults)
        super().add_param_group(param_group)
        try:
            _validate_group(self.param_groups[-1], index)
            _check_sharded_matrices(self.param_groups[-1], index)
            if self.param_groups[-1]["algorithm"] == "adamw":  # its values valid, now
                _refuse_muon_settings(self.param_groups[-1], given, index, self.defaults)
        except BaseException:
            self.param_groups.pop()  # refused: not added, as torch refuses a group
            raise
        self._momentum_when_added.append(self.param_groups[-1].get("momentum"))

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, groups) and this optimizer's own settings, so a copy
        (`copy.deepcopy`, pickle, `torch.save(optimizer)`) steps as the original; the plan
        is built anew by the copy."""
        return {**super().__getstate__(), **{k: getattr(self, k) for k in _PICKLED_SETTINGS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch's optimizers do for keys added after a checkpoint was written: a
        # torch.optim.Muon state dict has no `algorithm`, `row_blocks`, `ns_algorithm`.
        super().__setstate__(state)
        # A copy (`__getstate__`) builds its own plan; a load (torch's load_state_dict
        # calls this too) keeps the plan.
        for name, value in (
            ("metrics", []),
            ("_plan", None),
            ("_plan_params", ()),
            ("_plan_key", ()),
        ):
            self.__dict__.setdefault(name, value)
        # An optimizer pickled before these existed: its groups' momentum as they are now.
        self.__dict__.setdefault(
            "_momentum_when_added", [g.get("momentum") for g in self.param_groups]
        )
        self.__dict__.setdefault("_warned_adamw_momentum", False)
        self.__dict__.setdefault("_steps_without_grads", 0)
        self.__dict__.setdefault("_positions", {})
        for group in self.param_groups:
            _set_group_defaults(group, self.defaults)
            if group["algorithm"] != "adamw":
                continue
            # A step counter saved as a number (torch < 1.12, a hand-made checkpoint)
            # becomes the tensor torch's AdamW keeps, as its own __setstate__ does.
            for p in group["params"]:
                entries = self.state.get(p, {})
                if "step" in entries and not torch.is_tensor(entries["step"]):
                    entries["step"] = torch.tensor(float(entries["step"]), dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with a `NewtonSchulzSchedule` in `ns_coefficients` written as
        its `to_json()` string (checkpoint code takes only plain types; see there), and an
        (a, b, c) triple's `ns_steps` of None as the 5 it means, which `torch.optim.Muon`
        needs to step after loading it."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:  # shallow copies of the live groups
            if isinstance(group.get("ns_coefficients"), NewtonSchulzSchedule):
                group["ns_coefficients"] = group["ns_coefficients"].to_json()
            elif group.get("ns_steps", DEFAULT_NS_STEPS) is None:
                group["ns_steps"] = DEFAULT_NS_STEPS
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with momentum buffers in fp32: torch casts floating state to the
        param's dtype, which for a bf16 param would round our fp32 momentum (and is what a
        torch.optim.Muon state holds). A schedule written by `state_dict()` becomes a
        `NewtonSchulzSchedule` again. Keys a saved group lacks (`algorithm`, `row_blocks`
        in a torch.optim.Muon or AdamW checkpoint) keep this optimizer's values. State
        shaped unlike its param (a checkpoint of another model) is refused, naming it,
        before anything is loaded. A sharded (DTensor) param's state given whole, as plain
        tensors (a single-process checkpoint, every rank loading all of it), is cut to this
        rank's shard. Load pre-hooks see the caller's dict and their result is what loads;
        post-hooks see the loaded state."""
        loaded: list[dict[str, Any]] = []

        def check(optimizer: Muon, hooked: dict[str, Any]) -> dict[str, Any]:
            hooked = optimizer._with_group_keys(hooked)
            optimizer._check_loaded_state(hooked)
            loaded.append(hooked)
            return hooked

        # Registered now, ours run after the caller's pre-hooks and before their post-hooks.
        pre_hook = self.register_load_state_dict_pre_hook(check)
        post_hook = self.register_load_state_dict_post_hook(
            lambda optimizer: optimizer._finish_load(loaded[-1]), prepend=True
        )
        before = dict(self.__dict__)  # the groups, state and what the load hooks set
        try:
            super().load_state_dict(state_dict)
        except BaseException:  # a bad schedule string, say: nothing loaded
            self.__setstate__(before)
            raise
        finally:
            pre_hook.remove()
            post_hook.remove()

    def _with_group_keys(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` with the keys torch's checkpoints lack (`_OWN_GROUP_KEYS`) taken, where
        a saved group lacks them, from the group it replaces, not the defaults: a
        torch.optim.AdamW checkpoint loaded into an AdamW group stays AdamW, a
        torch.optim.Muon one keeps the declared `row_blocks`. The declared
        `_DECLARED_GROUP_KEYS` are kept over a checkpoint's too (they describe the model or
        how this run computes, not the training state), with a warning where they differ.
        The caller's dict is not changed. Unchanged where the group counts differ: torch's
        load says how."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            return state_dict
        groups = [
            {**{k: group[k] for k in _OWN_GROUP_KEYS if k in group}, **saved}
            for group, saved in zip(self.param_groups, saved_groups, strict=True)
        ]
        for index, (group, loaded) in enumerate(zip(self.param_groups, groups, strict=True)):
            muon = group.get("algorithm", "muon") == "muon"
            for key, why in _DECLARED_GROUP_KEYS.items():
                declared, saved = group.get(key), loaded.get(key)
                differ = (
                    _blocks(saved) != _blocks(declared)
                    if key == "row_blocks"
                    else saved != declared
                )
                if differ and (muon or key == "row_blocks"):  # AdamW groups read neither
                    warnings.warn(
                        f"param group {index}: the checkpoint's {key} {saved!r} differs from "
                        f"this optimizer's {declared!r}, which is kept: {why}",
                        UserWarning,
                        stacklevel=_user_stacklevel(),
                    )
                loaded[key] = declared
        return {**state_dict, "param_groups": groups}

    def _finish_load(self, state_dict: dict[str, Any]) -> None:
        # The loaded groups' momentum is where a scheduler would cycle it from: a resume
        # with another momentum in its config warned that a scheduler had cycled it.
        self._momentum_when_added = [g.get("momentum") for g in self.param_groups]
        for group in self.param_groups:
            if isinstance(group.get("ns_coefficients"), str):
                group["ns_coefficients"] = NewtonSchulzSchedule.from_json(group["ns_coefficients"])
        saved = state_dict["state"]
        ids = (i for g in state_dict["param_groups"] for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for i, p in zip(ids, params, strict=True):
            buf = saved.get(i, {}).get("momentum_buffer")
            if buf is not None:
                self.state[p]["momentum_buffer"] = buf.to(dtype=torch.float32, device=p.device)
            entries = self.state.get(p, {})
            for key, value in entries.items():
                if isinstance(value, Tensor) and value.ndim >= 1:
                    entries[key] = _placed_as(value, p)

    def _check_loaded_state(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in saved_groups] != [
            len(g["params"]) for g in self.param_groups
        ]:
            return  # torch's load says how the groups differ
        for index, group in enumerate(saved_groups):
            missing = [
                key
                for key in (*_MUON_KEYS, "ns_coefficients", "ns_steps")
                if group.get("algorithm", "muon") == "muon" and key not in group
            ]
            if missing:  # the first step raised a bare KeyError
                raise ValueError(
                    f"param group {index} of the state_dict loads into a Muon group but "
                    f"lacks {missing}, which Muon reads: it was saved by another optimizer "
                    "(torch.optim.AdamW's has none). Load it into an optimizer whose group is "
                    "algorithm='adamw', or do not load it (Muon starts from zero momentum)"
                )
        ids = (i for g in saved_groups for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for index, (i, p) in enumerate(zip(ids, params, strict=True)):
            for key, value in state_dict["state"].get(i, {}).items():
                if not isinstance(value, Tensor) or value.ndim == 0:
                    continue
                if value.shape != p.shape:
                    raise ValueError(
                        f"state {key!r} of param {index} has shape {tuple(value.shape)}, "
                        f"expected {tuple(p.shape)} (load a state_dict saved for these params)"
                    )
                if (
                    isinstance(value, DTensor)
                    and isinstance(p, DTensor)
                    and value.device_mesh != p.device_mesh
                ):
                    raise ValueError(
                        f"state {key!r} of param {index} is a DTensor on {value.device_mesh} "
                        f"but the param is on {p.device_mesh}; load a full (unsharded) state "
                        "dict, or save and load with torch.distributed.checkpoint, which reshards"
                    )

    # -- subset-step protocol ------------------------------------------------------------------

    def state_layout(self, param: Tensor) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """State tensors (ndim >= 1) the step keeps for `param`: local shard shape and dtype."""
        group = self._group_of(param)
        local = _local(param)
        if group["algorithm"] == "adamw":
            keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if group.get("amsgrad") else 2]
            return {key: (local.shape, local.dtype) for key in keys}
        return {"momentum_buffer": (local.shape, torch.float32)}

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        """`param`'s group as the groups are now, in O(1) amortized: the offload wrapper asks
        for every param. A cached position is used only if the live groups still hold `param`
        there, so a group added, loaded (torch's load replaces the group dicts) or edited by
        hand is never answered from the old groups; a miss rebuilds the map, O(params)."""
        groups = self.param_groups
        position = self._positions.get(id(param))
        if position is None or not _holds(groups, position, param):
            self._positions = {
                id(p): (g, k)
                for g, group in enumerate(groups)
                for k, p in enumerate(group["params"])
            }
            position = self._positions.get(id(param))
            if position is None:
                raise ValueError(
                    f"a param of shape {tuple(param.shape)} is not in this optimizer's param "
                    "groups; pass it to the optimizer (or add_param_group) first"
                )
        return groups[position[0]]

    def begin_subset_step(self) -> MuonStep:
        """Validate the groups, capture hyperparameters and gradients for one step; see
        `MuonStep`."""
        for index, group in enumerate(self.param_groups):
            _set_group_defaults(group, self.defaults)
            _validate_group(group, index)
        # Settings may be changed between steps (checked as the constructor checks them;
        # a dtype's name becomes the dtype).
        self.ns_dtype = ns_dtype_from(self.ns_dtype)
        check_bucket_cap_bytes(self.bucket_cap_bytes)
        check_max_inflight(self.max_inflight)
        check_spread_model(self.spread_model)
        check_collect_timings(self.collect_timings)
        _check_each_param_once(self.param_groups)
        _check_memory_apart(self.param_groups)
        # Every group's grads and momentum before any group steps: a refused step changes
        # nothing.
        try:
            for index, group in enumerate(self.param_groups):
                _check_grads(group, index)
                if group["algorithm"] == "muon":
                    self._check_momentum(group, index)
                else:
                    self._check_adamw_state(group, index)
            refused = None
        except Exception as error:  # this rank's grads or state: its peers' may pass
            refused = error
        plan = self._muon_plan(refused)
        self._warn_adamw_momentum()
        return MuonStep(self, plan)

    def _check_momentum(self, group: dict[str, Any], index: int) -> None:
        """A momentum buffer assigned by hand: of the param's shape and placements, or
        refused naming the param (the step failed partway, the earlier params' momentum
        updated); of another float dtype, taken in fp32 as a load takes it; None, taken as
        no buffer (zeros). Its device is not checked: offloaded, it lives in host memory."""
        for k, p in enumerate(group["params"]):
            if p not in self.state or "momentum_buffer" not in self.state[p]:
                continue
            buf = self.state[p]["momentum_buffer"]
            if buf is None:  # the reset idiom: from zeros, as a deleted entry
                del self.state[p]["momentum_buffer"]
                continue
            if not (_shaped_as(buf, p) and buf.is_floating_point()):
                raise ValueError(
                    f"param group {index}: {_param_text(group, k)} has a momentum_buffer "
                    f"{_described(buf)}, where the step keeps a float32 tensor of the "
                    f"param's shape, placed as the param ({_placements_text(p)}); assign one "
                    "such, or delete the entry to start from zeros"
                )
            if buf.dtype != torch.float32:
                self.state[p]["momentum_buffer"] = buf.to(torch.float32)

    def _check_adamw_state(self, group: dict[str, Any], index: int) -> None:
        """The state an AdamW group's step reads, present for each param with a grad and
        state (`amsgrad` turned on later, an entry deleted, a `step` assigned as a number),
        or refused naming the param: found mid-step, the Muon groups would have stepped."""
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if group.get("amsgrad") else 2]
        for k, p in enumerate(group["params"]):
            state = self.state.get(p)
            if p.grad is None or not state or "step" not in state:
                continue  # a param without state starts afresh
            missing = [key for key in keys if key not in state]
            if missing == ["max_exp_avg_sq"]:
                raise ValueError(
                    f"param group {index}: amsgrad was turned on after the state of "
                    f"{_param_text(group, k)} was created (it has no max_exp_avg_sq); set "
                    "amsgrad when the group is made, or delete the param's state to start "
                    "afresh"
                )
            if missing:
                raise ValueError(
                    f"param group {index}: {_param_text(group, k)} has AdamW state without "
                    f"{', '.join(map(repr, missing))}; restore it, or delete the param's "
                    "state (del opt.state[param]) to start afresh"
                )
            if not isinstance(state["step"], Tensor):
                raise ValueError(
                    f"param group {index}: {_param_text(group, k)} has a 'step' of type "
                    f"{type(state['step']).__name__} where the step keeps a float32 tensor; "
                    "assign torch.tensor(float(step))"
                )
            for key in keys:
                value = state[key]
                if not (_shaped_as(value, p) and value.dtype == p.dtype):
                    raise ValueError(
                        f"param group {index}: {_param_text(group, k)} has an {key} "
                        f"{_described(value)}, "
                        f"where the step keeps a tensor of the param's shape and dtype "
                        f"({p.dtype}), placed as the param ({_placements_text(p)}); assign one "
                        "such, or delete the param's state (del opt.state[param]) to start "
                        "afresh"
                    )

    def _warn_adamw_momentum(self) -> None:
        """Warn once if an AdamW group's `momentum` changed since the group was added: OneCycleLR
        and CyclicLR (cycle_momentum=True, their default) cycle `betas[0]` only for optimizers
        with `betas` in their defaults, and `momentum` (which Muon groups read) otherwise, so
        on this optimizer they write `momentum` into every group, and AdamW groups ignore it."""
        if self._warned_adamw_momentum:
            return
        # strict=False: a group appended to param_groups by hand has no entry; it is skipped.
        added_momentum = zip(self.param_groups, self._momentum_when_added, strict=False)
        for index, (group, added) in enumerate(added_momentum):
            # a group loaded from torch's AdamW has no `momentum`: nothing cycled it
            cycled = "momentum" in group and bool(group["momentum"] != added)
            if group["algorithm"] == "adamw" and cycled:
                self._warned_adamw_momentum = True
                warnings.warn(
                    f"param group {index} (algorithm='adamw') has momentum "
                    f"{group.get('momentum')} where it had {added}, but AdamW groups do not "
                    "read momentum: their beta1 is betas[0], which OneCycleLR and CyclicLR "
                    "cycle only for optimizers with 'betas' in their defaults (Muon groups "
                    "do read the cycled momentum); pass cycle_momentum=False to silence this, "
                    "or set the AdamW groups' betas yourself",
                    UserWarning,
                    stacklevel=3,
                )
                return

    # Compiled (torch.compile(opt.step)), the step runs eagerly: its launches are already
    # fused where it pays, and a traced step rounds differently from the eager one.
    @torch.no_grad()
    @torch.compiler.disable
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._warn_if_no_grads_again()
        subset = self.begin_subset_step()
        subset.step_params([p for unit in subset.units for p in unit])
        return loss

    def _warn_if_no_grads_again(self) -> None:
        """Warn at a second step in a row with no grad on any param: one is a step before
        training (for a scheduler's sake), two an optimizer whose params no backward
        reaches (built before `fully_shard`, which replaces them), stepping nothing. Not
        where only some params are stale (`fully_shard` on part of the model): a param
        without grads may as well be unused by design."""
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.grad is not None for p in params):
            self._steps_without_grads = 0
            return
        self._steps_without_grads += 1
        if self._steps_without_grads == 2:
            warnings.warn(
                f"{type(self).__name__}.step() found no grad on any of its {len(params)} params "
                "two steps in a row, so it updates nothing. Unless they are frozen: an "
                "optimizer built before fully_shard holds params the model no longer uses "
                "(fully_shard replaces them): build it after fully_shard; otherwise call "
                "backward() before step()",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    # -- internals -----------------------------------------------------------------------------

    def _muon_params(self) -> tuple[tuple[Tensor, int], ...]:
        return tuple(
            (p, index)
            for index, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
            for p in group["params"]
        )

    def _muon_plan(self, refused: Exception | None = None) -> MuonPlan:
        """The plan for the current Muon params, rebuilt only when they or what shapes the
        plan (groups, row blocks, the params' shapes, dtypes, devices and placements,
        ns_dtype, bucket cap, groups forced to Gram Newton-Schulz and their schedules)
        change. `refused`: this rank's error from checking its grads and state, raised
        after the ranks agree where the plan is built (its peers wait there)."""
        entries = self._muon_params()
        params = tuple(p for p, _ in entries)
        gram = tuple(
            (g, _schedule(group["ns_coefficients"], group["ns_steps"]))
            for g, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon" and group["ns_algorithm"] == "gram"
        )
        replica_owners = {
            g: group["replica_owners"]
            for g, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
        }
        # the plain path on CPU launches per matrix (`ns_path`): its workspace is smaller
        ns_per_matrix = any(every_matrix_alone(p.device.type) for p in params)
        description = PlanDescription(
            # row blocks as a copy: a list edited in place must not equal the key it was
            # stored in; a param's data may be replaced (p.data = ...): the layouts follow
            # its shape, dtype and placements
            tuple(
                (
                    g,
                    _blocks(self.param_groups[g]["row_blocks"]),
                    tuple(p.shape),
                    p.dtype,
                    p.device.type,
                    getattr(p, "placements", None),
                )
                for p, g in entries
            ),
            (
                ("ns_per_matrix", ns_per_matrix),
                ("ns_dtype", self.ns_dtype),
                ("bucket_cap_bytes", self.bucket_cap_bytes),
                ("gram schedules", gram),
                ("replica_owners", tuple(replica_owners.items())),
                ("spread_model", self.spread_model),
            ),
        )
        key = (description, tuple(p.device for p in params))
        if (
            self._plan is None
            or key != self._plan_key
            or any(a is not b for a, b in zip(params, self._plan_params, strict=True))
        ):
            try:
                layouts = [_layout(p, self.param_groups[g]["row_blocks"], g) for p, g in entries]
            except ValueError as error:  # this rank's shards: its peers' may pass
                layouts, refused = [], refused or error
            try:
                self._check_ranks_agree(description, entries, refused)
            except ValueError:
                if refused is None:
                    raise
            if refused is not None:  # this rank's own error, whatever its peers said
                refused.raised_on_every_rank = True  # its peers raise with it (RanksDisagree)
                raise refused
            itemsize = self.ns_dtype.itemsize
            self._plan = MuonPlan.build(
                layouts,
                self.bucket_cap_bytes,
                itemsize,
                gram_schedules=gram,
                replica_owners=replica_owners,
                spread_model=self.spread_model,
                ns_per_matrix=ns_per_matrix,
            )
            self._plan_params = params
            self._plan_key = key
        if refused is not None:  # planned before: no agreement runs to tell the peers
            raise refused
        return self._plan

    def _check_ranks_agree(
        self,
        description: PlanDescription,
        entries: Sequence[tuple[Tensor, int]],
        refused: Exception | None,
    ) -> None:
        """Refuse, on every rank at once, a plan the ranks of a mesh of its params do not
        all build alike (`rank_agreement`), or that some refuse (`refused`: a shard laid
        out unlike torch.chunk's, a grad or momentum buffer refused, on some ranks only).
        Each mesh's axes in an order every rank shares (by mesh, not by where its params
        are in this rank's groups)."""
        laid_out = "no, see the error on that rank" if refused is not None else "yes"
        refusal = ("local shards, grads and momentum accepted", laid_out)
        # Not the plan's (its key), but the step's: the order of the exchanges, and the
        # settings each matrix's owner updates it with for every rank.
        agreed = (("max_inflight", self.max_inflight), *self._muon_group_settings(), refusal)
        description = dataclasses.replace(description, settings=(*description.settings, *agreed))
        axes, meshes = _agreement_axes(entries)
        if not axes:
            return
        labels = tuple(  # in `_muon_params`' order
            names[i] if (names := group.get("param_names")) else f"param {i} of group {g}"
            for g, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
            for i in range(len(group["params"]))
        )
        check_ranks_agree(dataclasses.replace(description, labels=labels), axes, meshes)

    def check_ranks_agree_on(self, settings: Sequence[tuple[str, Any]]) -> None:
        """Refuse, on every rank of this optimizer's meshes at once, `settings` (name,
        value) that differ between ranks: a caller's that order this optimizer's exchanges
        (the offload wrapper's chunks). A collective over the Muon params' meshes: every
        rank of them calls it at the same point."""
        axes, meshes = _agreement_axes(self._muon_params())
        if axes:
            check_ranks_agree(PlanDescription((), tuple(settings)), axes, meshes)

    def _muon_group_settings(self) -> tuple[tuple[str, Any], ...]:
        """(name, value) of each setting a Muon group's update reads (numbers, flags,
        names, schedules: the groups are validated, no tensor among them)."""
        return tuple(
            (f"param group {g}'s {key}", group.get(key))
            for g, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
            for key in _MUON_STEP_KEYS
        )


def _agreement_axes(
    entries: Sequence[tuple[Tensor, int]],
) -> tuple[list[tuple[list[dist.ProcessGroup], torch.device]], int]:
    """Per mesh of the Muon params `entries` this rank is in (in an order every rank shares:
    by mesh, not by where its params are in this rank's groups), the groups of its axes
    that hold several ranks and its device; and how many meshes the params have."""
    meshes = {_mesh_key(p.device_mesh): p for p, _ in entries if isinstance(p, DTensor)}
    axes = []
    for _, p in sorted(meshes.items(), key=lambda item: item[0]):
        mesh = p.device_mesh
        if mesh.get_coordinate() is None:  # not this rank's: `_layout` said so
            continue
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]
        if groups:
            axes.append((groups, p.to_local().device))
    return axes, len(meshes)


def _mesh_key(mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A mesh as every rank of it names it: its ranks and shape."""
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape))


def _holds(groups: list[dict[str, Any]], position: tuple[int, int], param: Tensor) -> bool:
    """Whether `param` is at (group index, index in the group) of `groups`."""
    g, k = position
    return g < len(groups) and k < len(groups[g]["params"]) and groups[g]["params"][k] is param


# This optimizer's own group keys' defaults where the optimizer's `defaults` lack them.
_OWN_KEY_FALLBACKS = {"row_blocks": None, "ns_algorithm": "auto", "replica_owners": "auto"}


def _set_group_defaults(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Keys a group may lack (added by hand, or loaded from torch.optim.Muon): defaults."""
    group.setdefault("algorithm", "muon")
    for key, fallback in _OWN_KEY_FALLBACKS.items():
        group.setdefault(key, defaults.get(key, fallback))
    if group["algorithm"] == "adamw":
        group.setdefault("betas", ADAMW_BETAS)
        group.setdefault("eps", ADAMW_EPS)


# Group keys of this optimizer that torch's optimizers do not have.
_OWN_GROUP_KEYS = ("algorithm", "row_blocks", "ns_algorithm", "replica_owners")
# Of those, what a load keeps of the groups it loads into, and why.
_DECLARED_GROUP_KEYS = {
    "row_blocks": "they describe the model (the momentum does not depend on them)",
    "ns_algorithm": "it says how this run orthogonalizes, as ns_dtype does",
    "replica_owners": "it says how this run's mesh shares the work (the update is the same)",
}
# Hyperparameters every group has, and those only a Muon group reads.
_COMMON_KEYS = ("lr", "weight_decay", "eps")
_MUON_KEYS = ("momentum", "nesterov", "adjust_lr_fn", "ns_algorithm", "replica_owners")
# What a Muon group's update reads (`_MUON_KEYS` but the plan's own, which it checks).
# `ns_algorithm` too: the plan takes only "gram" groups, and "auto" on one rank against
# "standard" on another ran Gram or not by which rank owned a matrix (on CUDA).
_MUON_STEP_KEYS = (
    *_COMMON_KEYS,
    "momentum",
    "nesterov",
    "adjust_lr_fn",
    "ns_coefficients",
    "ns_steps",
    "ns_algorithm",
)


def _validate_hyperparameters(values: dict[str, Any]) -> None:
    """`muon.options`' check of each Muon hyperparameter in `values` (Muon's defaults)."""
    for key in (*_COMMON_KEYS, *_MUON_KEYS):
        CHECKS[key](values[key], key)


# torch.optim.AdamW options the step does not implement: a group may carry only torch's
# default (or False), never have one silently ignored. AdamW groups honour `maximize`.
_UNSUPPORTED_OPTIONS = ("foreach", "fused", "capturable", "differentiable")
# torch.optim.AdamW options AdamW groups honour; torch.optim.Muon has neither.
_ADAMW_OPTIONS = ("amsgrad", "maximize")


# Group keys torch's optimizers and schedulers read or write that `defaults` lacks.
_TORCH_GROUP_KEYS = ("params", "param_names", "initial_lr", "betas")


# Other libraries' names of a group setting (transformers', optax's): as typos are.
_OTHER_NAMES = {"learning_rate": "lr", "beta1": "betas", "beta2": "betas"}


def _refuse_misspelled_keys(
    group: Mapping[str, Any], index: int, defaults: Mapping[str, Any]
) -> None:
    """A key no group reads, this close to one that some group reads, is a typo (`beta`,
    `weight_decy`): kept, as torch keeps a group's own keys, the setting it meant would
    silently stay at its default. A key of the user's own (`name`, `lr_mult`) is kept."""
    known = {*defaults, *_TORCH_GROUP_KEYS, *_ADAMW_OPTIONS, *_UNSUPPORTED_OPTIONS}
    for key in group:
        if not isinstance(key, str) or key in known:
            continue
        close = [_OTHER_NAMES[key]] if key in _OTHER_NAMES else []
        close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            raise ValueError(
                f"param group {index} sets {key!r}, which no group reads: did you mean "
                f"{close[0]!r}? (a key of your own is kept, as torch keeps it, unless it "
                "spells a setting nearly or by another library's name)"
            )


# Group keys only a Muon group reads.
_MUON_ONLY_KEYS = (*_MUON_KEYS, "ns_coefficients", "ns_steps", "row_blocks")


def _refuse_muon_settings(
    group: Mapping[str, Any], given: set[str], index: int, defaults: Mapping[str, Any]
) -> None:
    """An AdamW group given a Muon setting of its own (`momentum=0.5`, meant as AdamW's
    beta1) would keep it unread until the group is switched to Muon, as a Muon group's
    `betas` is refused. Only the keys the caller wrote (`given`), and not where it gave
    every Muon setting there is a default of (a group of an optimizer's `param_groups`,
    handed back: torch filled them in, a load rewrote `ns_steps`, a scheduler cycled
    `momentum`); a value equal to the default passes."""
    if set(defaults).intersection(_MUON_ONLY_KEYS) <= given:  # every one: handed back
        return
    own = {}
    for key in _MUON_ONLY_KEYS:
        if key not in given:
            continue
        value, default = group[key], defaults.get(key, _OWN_KEY_FALLBACKS.get(key))
        if isinstance(value, list):  # as the group keeps a Muon group's coefficients
            value = tuple(value)
        try:
            same = bool(value == default)
        except (TypeError, RuntimeError, ValueError):  # a tensor, say: not the default
            same = False
        if not same:
            own[key] = group[key]
    if own:
        settings = ", ".join(f"{key}={value!r}" for key, value in own.items())
        raise ValueError(
            f"param group {index} sets {settings}, which only Muon groups read, but is an "
            "AdamW group (algorithm='adamw'; AdamW's momentum is betas[0]): drop them (or "
            "set them once the group is switched to algorithm='muon')"
        )


def _check_listed_once(params: list[Any], index: int, groups: list[dict[str, Any]]) -> None:
    """Each param once in all groups: torch only warns within a group, and the step would
    update a param listed twice twice."""
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if isinstance(p, tuple):  # named params, (name, param): torch takes them since 2.6
            p = p[1]
        if id(p) in seen:
            raise ValueError(
                f"param group {index} lists a param twice (params {seen[id(p)]} and {i}, "
                f"shape {tuple(p.shape)}); list each param once"
            )
        seen[id(p)] = i
    for other, group in enumerate(groups):
        for q in group["params"]:
            if id(q) in seen:
                raise ValueError(
                    f"param {seen[id(q)]} of param group {index} (shape {tuple(q.shape)}) is "
                    f"in param group {other} already; list each param in one group"
                )


def _check_memory_apart(groups: list[dict[str, Any]]) -> None:
    """No param shares memory with another or with itself (an expanded view): the step
    decays and updates a batch of params at once, torch's one param after the other, so
    where they overlap the result would depend on the batching. Refused, naming them.
    Views of one tensor whose elements are apart (rows, columns, interleaved) pass."""
    spans = []
    for index, group in enumerate(groups):
        for k, p in enumerate(group["params"]):
            # the local tensor without to_local() (10 us a DTensor, every step)
            t = p._local_tensor if isinstance(p, DTensor) else p
            if t.numel() == 0 or t.data_ptr() == 0:  # empty, meta, a wrapper subclass
                continue
            dense = t.is_contiguous()
            extent = t.numel() if dense else _extent(t.shape, t.stride())
            start = t.data_ptr()
            end = start + extent * t.element_size()
            spans.append((t.get_device(), start, end, index, k, t, dense))
    spans.sort(key=lambda span: span[:3])
    clusters: list[list[tuple[Any, ...]]] = []  # spans reaching into each other
    reach = (None, 0)  # the last cluster's device and the furthest its spans reach
    for span in spans:
        if clusters and reach[0] == span[0] and span[1] < reach[1]:
            clusters[-1].append(span)
        else:
            clusters.append([span])
        reach = (span[0], max(span[2], reach[1]) if reach[0] == span[0] else span[2])
    for cluster in clusters:
        if len(cluster) == 1 and (cluster[0][6] or _apart_in_itself(cluster[0][5])):
            continue
        if not _bytes_overlap(_layouts(cluster)):
            continue
        alone = next(
            (
                s
                for s in cluster
                if not _apart_in_itself(s[5]) and _bytes_overlap.__wrapped__(_layouts([s]))
            ),
            None,
        )
        if alone is not None:
            raise ValueError(
                f"param group {alone[3]}: {_param_text(groups[alone[3]], alone[4])} shares "
                "memory with itself (an expanded or unfolded view), so its update would "
                "overwrite itself: give it its own memory (.clone())"
            )
        one, other = _first_shared(cluster)
        raise ValueError(
            f"param group {one[3]}: {_param_text(groups[one[3]], one[4])} and param group "
            f"{other[3]}: {_param_text(groups[other[3]], other[4])} share memory (views of "
            "one tensor), so the update of one would change the other, in an order that "
            "depends on how the step batches them: tie them as one Parameter, or give each "
            "its own memory (.clone())"
        )


def _extent(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a non-empty strided view's first to its last, both included."""
    return sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1


def _apart_in_itself(t: Tensor) -> bool:
    """Whether no two of `t`'s elements share memory, for sure: its dims, by stride, each
    step past all the smaller ones (as a dense or sliced tensor's do)."""
    reach = 0
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size == 1:
            continue
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _layouts(spans: Sequence[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
    """The views of `spans` (as `_check_memory_apart` lists them) as `_bytes_overlap` takes
    them: byte offset from the first, shape, strides, element size."""
    first = min(span[1] for span in spans)
    return tuple(
        (span[1] - first, tuple(span[5].shape), span[5].stride(), span[5].element_size())
        for span in spans
    )


def _first_shared(cluster: Sequence[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
    """Two spans of `cluster` (none overlapping itself) that share a byte: each marked
    with its number on a host scratch, the first to find another's mark names both."""
    views = _layouts(cluster)
    marks = torch.zeros(max(o + _extent(sh, st) * e for o, sh, st, e in views), dtype=torch.int32)
    for n, (offset, shape, strides, size) in enumerate(views):
        region = marks.as_strided((*shape, size), (*(s * size for s in strides), 1), offset)
        seen = int(region.max())
        if seen:
            return cluster[seen - 1], cluster[n]
        region.fill_(n + 1)
    raise AssertionError("no two views share a byte")


@functools.lru_cache(maxsize=64)
def _bytes_overlap(views: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether strided views of one memory (byte offset, shape, strides in elements,
    element size) share a byte: each marked on a host scratch over their bytes, once per
    set of layouts (only params that are views of one tensor get here, at every step)."""
    marks = torch.zeros(max(o + _extent(sh, st) * e for o, sh, st, e in views), dtype=torch.uint8)
    for offset, shape, strides, size in views:
        marks.as_strided((*shape, size), (*(s * size for s in strides), 1), offset).fill_(1)
    return int(marks.sum()) < sum(math.prod(shape) * size for _, shape, _, size in views)


def _check_each_param_once(groups: list[dict[str, Any]]) -> None:
    """No param in two groups: `add_param_group` refuses that, a group appended to
    `param_groups` by hand is seen here (torch would step the param once per group; the
    plan holds one unit per param)."""
    if len({id(p) for g in groups for p in g["params"]}) == sum(len(g["params"]) for g in groups):
        return
    for index, group in enumerate(groups):
        _check_listed_once(list(group["params"]), index, groups[:index])


def _validate_group(group: dict[str, Any], index: int) -> None:
    """One error per bad hyperparameter, naming the group, the key and the value."""
    try:
        _check_group(group)
    except (TypeError, ValueError) as error:
        raise type(error)(f"param group {index}: {error}") from None


# Settings of the whole optimizer (its constructor's keywords), which a group cannot set.
_OPTIMIZER_SETTINGS = ("ns_dtype", "bucket_cap_bytes", "max_inflight", "collect_timings")


def _check_group(group: dict[str, Any]) -> None:
    for key in _COMMON_KEYS:
        CHECKS[key](group[key], key)
    for key in _OPTIMIZER_SETTINGS:
        if key in group:
            raise ValueError(
                f"{key} is a setting of the whole optimizer, not of a group (the group's "
                f"{key}={group[key]!r} would be unused); pass it to Muon(...), or set "
                f"optimizer.{key} between steps"
            )
    for key in _UNSUPPORTED_OPTIONS:
        if group.get(key) not in (None, False):
            raise ValueError(
                f"{key}={group[key]!r} is not supported (the step runs as torch's "
                f"{key}=False); remove it"
            )
    # torch.optim.Adam's L2 decay (its groups carry the key, and a load keeps it)
    if group.get("decoupled_weight_decay") not in (None, True):
        raise ValueError(
            f"decoupled_weight_decay={group['decoupled_weight_decay']!r} is not supported: "
            "every group decays decoupled, as torch.optim.AdamW and torch.optim.Muon do; "
            "remove it (for L2 decay, use torch.optim.Adam)"
        )
    algorithm = group["algorithm"]
    if algorithm == "adamw":
        check_betas(group["betas"])
        for key in _ADAMW_OPTIONS:
            check_adamw_flag(group.get(key, False), key)
        # Unread here, but read once the group is switched to Muon: valid values only (a
        # group loaded from a torch.optim.AdamW checkpoint has none of them).
        for key in _MUON_KEYS:
            if key in group:
                CHECKS[key](group[key], key)
        return
    if algorithm != "muon":
        raise ValueError(f"algorithm should be 'muon' or 'adamw' but is: {algorithm!r}")
    for key in _ADAMW_OPTIONS:
        if group.get(key) not in (None, False):
            raise ValueError(
                f"{key}={group[key]!r} is not supported by a Muon group (torch.optim.Muon "
                f"has no {key}); it applies to algorithm='adamw' groups"
            )
    # switched from AdamW, as loaded from a torch.optim.AdamW checkpoint
    missing = [key for key in _MUON_STEP_KEYS if key not in group]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} missing, which a Muon group reads (a group switched to "
            "algorithm='muon' from one loaded from a torch AdamW checkpoint has none): set "
            "them in the group"
        )
    for key in _MUON_KEYS:
        CHECKS[key](group[key], key)
    coefficients, steps = group["ns_coefficients"], group["ns_steps"]
    check_ns_coefficients(coefficients)
    if isinstance(coefficients, NewtonSchulzSchedule):
        check_ns_steps_of_schedule(steps, coefficients)
    else:
        check_ns_steps(steps)
        group["ns_coefficients"] = tuple(coefficients)
        try:  # what the step builds from them (a != 0, ...), refused here, named
            _schedule(group["ns_coefficients"], steps)
        except ValueError as error:
            raise ValueError(f"ns_coefficients={group['ns_coefficients']!r}: {error}") from None
    row_blocks = group["row_blocks"]
    for k, p in enumerate(group["params"]):
        where = _param_text(group, k)
        if p.ndim not in (2, 3):
            raise ValueError(
                f"{where}: Muon supports 2-D and 3-D params; put it in "
                "an algorithm='adamw' group, as muon_param_groups(model) does for biases, "
                "norms, embeddings and the output head"
            )
        if p.is_complex():
            raise ValueError(
                f"{where}: Muon does not support complex params but got {p.dtype}; put it "
                "in an algorithm='adamw' group or use real views"
            )
        try:
            check_row_blocks(row_blocks, p.shape[-2])
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        _check_placements(p, where)


def _described(value: Any) -> str:
    """A state entry as an error names it: a tensor's type, shape and dtype, else its type."""
    if isinstance(value, Tensor):
        return f"{type(value).__name__} {tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _shaped_as(value: Any, param: Tensor) -> bool:
    """A tensor of `param`'s global shape and placements: read without to_local() (10 us
    a DTensor, every step)."""
    return isinstance(value, Tensor) and _placed_alike(value, param) and value.shape == param.shape


def _placed_alike(t: Tensor, p: Tensor) -> bool:
    """Whether `t` is a DTensor where `p` is one, on its mesh and placements."""
    return isinstance(t, DTensor) == isinstance(p, DTensor) and (
        not isinstance(p, DTensor)
        or (t.device_mesh == p.device_mesh and t.placements == p.placements)
    )


def _check_placements(p: Tensor, where: str) -> None:
    """A DTensor param sharded in torch.chunk pieces (Shard) or replicated: the layouts
    the planner cuts matrices by; or an expert stack sharded on its expert dim alone,
    strided too (FSDP2's default dim-0 shard over expert parallelism makes
    `_StridedShard`): every rank holds whole matrices, updated where they are, and which
    experts a rank holds changes no matrix's update. Private API (`_StridedShard`; a
    subclass of `Shard` in some torch releases, not in 2.13, the one checked)."""
    placements = tuple(getattr(p, "placements", ()))
    experts_only = p.ndim == 3 and all(
        q.dim % p.ndim == 0 for q in placements if isinstance(q, (Shard, _StridedShard))
    )
    for placement in placements:
        strided = isinstance(placement, _StridedShard)
        if isinstance(placement, (Shard, Replicate)) and not strided or strided and experts_only:
            continue
        why = "Muon supports Shard and Replicate placements"
        if strided:
            why += (
                "; strided sharding (FSDP2 over tensor parallelism, or over expert parallelism "
                "on another dim than the experts') is supported only on a 3-D expert stack "
                "sharded on its expert dim alone"
            )
        raise ValueError(
            f"{where} has placements {placements}: {why}; shard "
            "it with FSDP2 alone (an expert stack: on its expert dim), or put it in an "
            "algorithm='adamw' group"
        )


def _check_sharded_matrices(group: dict[str, Any], index: int) -> None:
    """When a group is added: a Muon param's matrices cut by the mesh as the step's planning
    can cut them (`check_matrix_sharding`; planning refuses the rest too, but by shape
    only, and at the first step), on a mesh whose ranks ascend along each axis (a
    `DeviceMesh` built from a permuted rank list; found by a hostile audit). Not at each
    step: a host cost per param."""
    if group["algorithm"] != "muon":
        return
    in_order: dict[int, bool] = {}  # per mesh
    for k, p in enumerate(group["params"]):
        if isinstance(p, DTensor):
            where = f"param group {index}: {_param_text(group, k)}"
            try:
                check_matrix_sharding(p.shape, p.device_mesh.shape, _shard_dims(p))
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            ranks = p.device_mesh.mesh
            if id(p.device_mesh) not in in_order:
                in_order[id(p.device_mesh)] = all(
                    bool((ranks.diff(dim=axis) > 0).all()) for axis in range(ranks.ndim)
                )
            if not in_order[id(p.device_mesh)]:
                raise ValueError(
                    f"{where}: its mesh lists ranks out of order along an axis "
                    f"({ranks.tolist()}): Muon's exchanges number a mesh axis's ranks by "
                    "their coordinate, its process group by their rank, and would pair the "
                    "wrong pieces. Build the mesh with ranks ascending along each axis "
                    "(init_device_mesh does)"
                )


def _param_text(group: dict[str, Any], k: int) -> str:
    """How an error names a group's param `k`: its index, its name where the group has
    names (`model.named_parameters()` given), and its shape."""
    names = group.get("param_names")
    name = f"{names[k]!r}, " if names else ""
    return f"param {k} ({name}shape {tuple(group['params'][k].shape)})"


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, called from a warning's site, that points at the
    first caller outside this library and torch (as offload.forward_overlap's: muon
    imports nothing of offload)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "offload",
        "muon",
        "muon_offload",
        "torch",
    ):
        level, frame = level + 1, frame.f_back
    return level


def _placements_text(t: Tensor) -> str:
    return str(tuple(t.placements)) if isinstance(t, DTensor) else "a plain tensor"


def _grad_placement_fix(grad: Tensor, p: Tensor) -> str:
    """How to give `p` a grad the step reads, where `grad`'s placements are not `p`'s."""
    if not isinstance(p, DTensor):
        return "give it the whole grad (p.grad = p.grad.full_tensor())"
    if not isinstance(grad, DTensor):
        return (
            "give it a DTensor grad of the param's placements: this rank's shard as "
            "p.grad = DTensor.from_local(shard, p.device_mesh, p.placements), or the whole "
            "grad as distribute_tensor(grad, p.device_mesh, p.placements)"
        )
    return (
        "reduce or redistribute the grad to the param's placements first "
        "(p.grad = p.grad.redistribute(p.device_mesh, p.placements))"
    )


def _check_grads(group: dict[str, Any], index: int) -> None:
    """Grads the step can read as they are: dense, as torch.optim.Muon and AdamW require,
    and on a DTensor param of the param's mesh and placements. The step reads the grad's
    local shard as the param's: a Partial grad (tensor parallelism can leave one on a
    replicated param) would be used unreduced, each rank its own."""
    algorithm = "Muon" if group["algorithm"] == "muon" else "AdamW"
    for k, p in enumerate(group["params"]):
        grad = p.grad
        if grad is None:
            continue
        # named only when refused: this runs for every param at every step
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"param group {index}: {_param_text(group, k)} has a {grad.layout} grad, "
                f"but {algorithm} does not support sparse gradients; make it dense "
                "(nn.Embedding(sparse=False)) or step that param with torch.optim.SparseAdam"
            )
        same = isinstance(p, DTensor) == isinstance(grad, DTensor) and (
            not isinstance(p, DTensor)
            or (grad.device_mesh == p.device_mesh and grad.placements == p.placements)
        )
        if not same:
            raise ValueError(
                f"param group {index}: {_param_text(group, k)} has "
                + (
                    f"a grad with placements {_placements_text(grad)}"
                    if isinstance(grad, DTensor)
                    else "a plain-tensor grad"
                )
                + (
                    f" but the param has {_placements_text(p)}; "
                    if isinstance(p, DTensor)
                    else " but the param is a plain tensor; "
                )
                + _grad_placement_fix(grad, p)
            )
        if grad.shape != p.shape:  # set through `.data`, which torch's grad setter misses
            raise ValueError(
                f"param group {index}: {_param_text(group, k)} has a grad of shape "
                f"{tuple(grad.shape)}; a grad must have its param's shape"
            )
        if algorithm == "AdamW" and grad.dtype != p.dtype:
            # torch's AdamW refuses it too, but mid-step: the Muon groups had stepped
            raise ValueError(
                f"param group {index}: {_param_text(group, k)} has a {grad.dtype} grad for "
                f"a {p.dtype} param, which AdamW (as torch.optim.AdamW) does not step; give "
                "it a grad of the param's dtype, or keep the param in the grad's dtype"
            )


def _transient(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A buffer of one bucket's step, from the caching allocator; the only place the
    Muon step allocates exchange or Newton-Schulz input buffers."""
    return torch.empty(numel, dtype=dtype, device=device)


_REDUCED = (torch.bfloat16, torch.float16)


class _TorchElementwise:
    """The elementwise step in plain torch ops, in torch.optim.Muon's order."""

    @staticmethod
    def momentum(
        step: MuonStep,
        params: Sequence[int],
        plan: ExchangePlan,
        targets: Sequence[tuple[int, tuple[int, int], Tensor]],
    ) -> None:
        updates = {i: step._momentum_update(i) for i in params}
        for matrix, origin, dest in targets:
            m = plan.matrices[matrix]
            dest.copy_(_rect(updates[m.param], m, origin, dest))

    @staticmethod
    def apply(
        step: MuonStep, plan: ExchangePlan, targets: Sequence[tuple[int, Tensor, Tensor]]
    ) -> None:
        for param in sorted({m.param for m in plan.matrices}):
            hp = step._hp(param)
            _local(step._params[param]).mul_(1 - hp["lr"] * hp["weight_decay"])
        for i, target, update in targets:
            m = plan.matrices[i]
            update, alpha = update.to(step._ns_dtype), -step._adjusted_lr(m)
            if target.device.type == "cpu" and target.dtype in _REDUCED:
                # The CPU's bf16 / fp16 add_ rounds `alpha * update` by the operands' layout
                # (vectorized or not), so a shard's bits would differ from the whole matrix's:
                # in fp32, one rounding per op, then once to the param's dtype.
                target.copy_(target.float().add_(update.float() * alpha))
            else:
                target.add_(update, alpha=alpha)


class _FusedElementwise:
    """The elementwise step in `muon.fused`'s two Triton kernels (torch's arithmetic)."""

    @staticmethod
    def momentum(
        step: MuonStep,
        params: Sequence[int],
        plan: ExchangePlan,
        targets: Sequence[tuple[int, tuple[int, int], Tensor]],
    ) -> None:
        from muon import fused

        bufs = {i: step._momentum_buffer(i) for i in params}  # state even for empty shards
        for matrix, origin, dest in targets:
            m = plan.matrices[matrix]
            hp = step._hp(m.param)
            fused.momentum_(
                _rect(step._grads[m.param], m, origin, dest),
                _rect(bufs[m.param], m, origin, dest),
                dest,
                hp["momentum"],
                hp["nesterov"],
            )

    @staticmethod
    def apply(
        step: MuonStep, plan: ExchangePlan, targets: Sequence[tuple[int, Tensor, Tensor]]
    ) -> None:
        from muon import fused

        for i, target, update in targets:
            m = plan.matrices[i]
            hp = step._hp(m.param)
            decay = 1 - hp["lr"] * hp["weight_decay"]
            fused.apply_(target, update, decay, -step._adjusted_lr(m), step._ns_dtype)


def _elementwise_for(device: torch.device) -> type[_TorchElementwise] | type[_FusedElementwise]:
    """The one place the elementwise implementation is chosen (see `muon.elementwise`)."""
    return _FusedElementwise if elementwise.use_fused(device) else _TorchElementwise


@dataclass(slots=True)
class _InFlight:
    """A bucket between `_start` and `_finish`, holding its buffers."""

    plan: ExchangePlan
    kernels: type[_TorchElementwise] | type[_FusedElementwise]
    work: dist.Work | None
    send: Tensor | None
    recv: Tensor | None
    full: Tensor
    views: dict[int, Tensor]
    """Each owned matrix's view of `full`."""
    exchange_s: float | None


def _captured(option: Any) -> Any:
    """A group option as a later `step_params` reads it: tensors copied, also inside a tuple
    or list (`betas=[0.9, 0.95]` from a config file, raised in place by a warmup), which
    the trainer may change while an overlapped offload's chunks are pending. (offload's
    adapter does the same for torch optimizers; the packages do not import each other.)"""
    if isinstance(option, Tensor):
        return option.clone()
    if type(option) in (tuple, list):
        return type(option)(map(_captured, option))
    return option


class MuonStep:
    """One step of `Muon`, to be run unit by unit (the subset-step protocol).

    Units, identical on every rank: each exchanged bucket (its params exchange
    together), each param of a local bucket (a local matrix needs no other
    rank, and batch invariance makes any cut of a launch give the same bits),
    and each param of the AdamW groups (AdamW's update of a param reads only its
    own grad and state). `step_params` updates a union of whole units with the
    same result, bit for bit, as `Muon.step`; it batches the local matrices of
    all the units it is handed by shape (under the bucket cap), so an offload
    chunk of many small units still makes large Newton-Schulz launches. Every
    rank must call it with the same units, in the same order, each unit once; it
    drops a unit's grads once the unit has stepped.
    """

    def __init__(self, optimizer: Muon, plan: MuonPlan) -> None:
        self._opt = optimizer
        self._plan = plan
        groups = optimizer.param_groups
        self._groups = [{k: _captured(v) for k, v in g.items() if k != "params"} for g in groups]
        self._params = [p for p, _ in optimizer._muon_params()]
        self._grads = [_local_grad(p) for p in self._params]
        self._active = frozenset(i for i, g in enumerate(self._grads) if g is not None)
        # (group index, param, grad) per AdamW param, one unit each.
        self._adamw: list[tuple[int, Tensor, Tensor | None]] = [
            (i, p, _local_grad(p))
            for i, g in enumerate(groups)
            if g["algorithm"] == "adamw"
            for p in g["params"]
        ]
        self._kinds = plan.step_units(len(self._adamw))
        # the subset-step protocol's flag: exchanged buckets (and spread ones) communicate
        self.runs_collectives = any(
            what == "bucket"
            and (plan.buckets[index].axis is not None or plan.buckets[index].spread)
            for what, index in self._kinds
        )
        self.units: list[list[Tensor]] = [self._unit_params(kind) for kind in self._kinds]
        self._unit_of = {id(p): index for index, unit in enumerate(self.units) for p in unit}
        self._stepped: set[int] = set()  # units done this step
        # What the step reads beyond its groups and grads, captured now: an overlapped offload
        # runs `step_params` after `step()` returned, and a setting changed in between takes
        # effect from the next step, as it does for a plain step.
        self._ns_dtype = optimizer.ns_dtype
        self._max_inflight = optimizer.max_inflight
        self._collect_timings = optimizer.collect_timings
        self._ns_backend = newton_schulz.get_backend()
        devices = {g.device for g in self._grads if g is not None}
        self._kernels = {device: _elementwise_for(device) for device in devices}
        self._metrics: list[BucketMetrics] = []
        optimizer.metrics = self._metrics
        # Autocast would round the step's matmuls below `ns_dtype`; lazily run offload chunks
        # run with it off, so every step does (for each device type the params live on).
        self._device_types = sorted({device.type for device in devices})

    def _unit_params(self, kind: tuple[str, int]) -> list[Tensor]:
        what, index = kind
        if what == "bucket":
            return [self._params[i] for i in self._plan.buckets[index].params]
        if what == "local":
            return [self._params[index]]
        return [self._adamw[index][1]]

    def step_params(self, params: Collection[Tensor]) -> None:
        # Checked whole before any unit is marked: a refused call steps nothing. Units are
        # looked up by param (an offloaded step calls this once per chunk).
        wanted = {id(p) for p in params}
        indices = sorted({self._unit_of.get(key, -1) for key in wanted})
        if indices and indices[0] < 0:
            raise ValueError("step_params got params that are not in this optimizer's units")
        for index in indices:
            if not all(id(p) in wanted for p in self.units[index]):
                raise ValueError(f"step_params needs whole units; unit {index} is split")
            if index in self._stepped:
                raise ValueError(f"unit {index} has already stepped this step")
        self._stepped.update(indices)
        chosen = [self._kinds[index] for index in indices]
        with torch.no_grad(), _autocast_off(self._device_types):
            self._run_muon(
                [i for what, i in chosen if what == "bucket"],
                sorted(i for what, i in chosen if what == "local"),
            )
            by_group: dict[int, tuple[list[Tensor], list[Tensor | None]]] = {}
            for what, k in chosen:
                if what == "adamw":
                    group, p, grad = self._adamw[k]
                    params_, grads = by_group.setdefault(group, ([], []))
                    params_.append(p)
                    grads.append(grad)
            for group, (params_, grads) in by_group.items():
                self._adamw_group(group, params_, grads)
        self._release(chosen)

    def _release(self, kinds: Sequence[tuple[str, int]]) -> None:
        """Drop the grads of stepped units: nothing reads them again this step, and a trainer
        that let go of them after an overlapped step gets their memory back chunk by chunk."""
        for what, k in kinds:
            if what == "adamw":
                group, p, _ = self._adamw[k]
                self._adamw[k] = (group, p, None)
            else:
                for i in self._plan.buckets[k].params if what == "bucket" else (k,):
                    self._grads[i] = None

    # -- Muon buckets ----------------------------------------------------------------------------

    def _run_muon(self, buckets: Sequence[int], local: Sequence[int]) -> None:
        """Exchanged buckets and local launches in bucket order, as `launch_order` says."""
        plans = self._plan.step_plans(buckets, local, self._active)
        # A bucket with nothing on this rank keeps its place (None), so every rank
        # finishes bucket k at the same point and the collectives stay in order.
        alive: dict[int, _InFlight | None] = {}
        for start, i in launch_order(plans, self._max_inflight):
            if start:
                alive[i] = self._start(plans[i])
            else:
                flight = alive.pop(i)
                if flight is not None:
                    self._finish(flight)

    def _hp(self, param: int) -> dict[str, Any]:
        return self._groups[self._plan.layouts[param].group]

    def _adjusted_lr(self, m: Matrix) -> float:
        hp = self._hp(m.param)
        return adjusted_lr(hp["lr"], hp["adjust_lr_fn"], m.rows, m.cols)

    def _start(self, plan: ExchangePlan) -> _InFlight | None:
        """Momentum of the plan's active params, packed into a fresh send buffer (exchanged)
        or the Newton-Schulz input (local), and the exchange started."""
        if not plan.params:
            return None
        device = self._grads[plan.params[0]].device
        kernels = self._kernels[device]
        if not plan.matrices:  # e.g. an expert stack with no expert here: state, no work
            kernels.momentum(self, plan.params, plan, [])
            return None
        clock = _Clock(self._collect_timings, device)
        dtype = self._ns_dtype
        full = _transient(plan.full_numel, dtype, device)
        views: dict[int, Tensor] = {}
        for batch in plan.batches:
            size = batch.rows * batch.cols
            for k, matrix in enumerate(batch.matrices):
                start = batch.offset + k * size
                views[matrix] = full[start : start + size].view(batch.rows, batch.cols)
        send = recv = None
        if plan.axis is None:  # each matrix goes whole into its full view
            targets = [(i, (m.row0, 0), views[i]) for i, m in enumerate(plan.matrices)]
        else:  # each local piece goes into its send slot
            send = _transient(plan.send_numel, dtype, device)
            recv = _transient(plan.recv_numel, dtype, device)
            targets = [
                (piece.matrix, (piece.local_row0, piece.local_col0), view)
                for piece, view in send_slots(plan, send)
            ]
        kernels.momentum(self, plan.params, plan, targets)
        work = None
        if plan.axis is not None:
            work = send_to_owners(plan, send, recv, self._exchange_group(plan))
        return _InFlight(plan, kernels, work, send, recv, full, views, clock.lap())

    def _exchange_group(self, plan: ExchangePlan) -> dist.ProcessGroup:
        return self._params[plan.matrices[0].param].device_mesh.get_group(plan.axis)

    def _replica_group(self, plan: ExchangePlan) -> dist.ProcessGroup:
        return self._params[plan.matrices[0].param].device_mesh.get_group(plan.replica_axis)

    def _momentum_buffer(self, param: int) -> Tensor:
        """The local fp32 momentum buffer of `param`, created (zeros) on first use."""
        p = self._params[param]
        state = self._opt.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = _zeros_like_local(p, torch.float32)
        return _local(state["momentum_buffer"])

    def _momentum_update(self, param: int) -> Tensor:
        """fp32 momentum on the local shard; returns the Newton-Schulz input (local, fp32)."""
        hp = self._hp(param)
        buf = self._momentum_buffer(param)
        grad = self._grads[param].to(torch.float32)
        buf.lerp_(grad, 1 - hp["momentum"])
        return grad.lerp(buf, hp["momentum"]) if hp["nesterov"] else buf

    def _finish(self, flight: _InFlight) -> None:
        """Assemble, orthogonalize, return the results and apply them; the buffers go."""
        plan = flight.plan
        device = flight.full.device
        clock = _Clock(self._collect_timings, device)
        if flight.work is not None:
            flight.work.wait()
            assemble(plan, flight.recv, flight.views)
        exchange_s = clock.lap()

        results: dict[int, Tensor] = {}
        for batch in plan.batches:
            count = len(batch.matrices)
            stack = flight.full[batch.offset : batch.offset + count * batch.rows * batch.cols]
            hp = self._groups[batch.group]
            out = zeropower(
                stack.view(count, batch.rows, batch.cols),
                _schedule(hp["ns_coefficients"], hp["ns_steps"]),
                hp["eps"],
                self._ns_backend,
                algorithm=hp["ns_algorithm"],
                cast=False,  # rounded to ns_dtype by the apply (or the return exchange's copy)
            )
            results.update(zip(batch.matrices, out.unbind(0), strict=True))
            del out  # `results` alone holds it: clearing it frees the results before a gather
        ns_s = clock.lap()

        if flight.work is not None:
            group = self._exchange_group(plan)
            return_results(plan, results, flight.send, flight.recv, group).wait()
            results.clear()  # the owned results are in `recv` now; this rank's come in `send`
            if plan.gather_numel:  # a spread bucket: the other replicas' results
                gathered = _transient(plan.gather_buffers_numel, flight.send.dtype, device)
                share_across_replicas(plan, flight.send, gathered, self._replica_group(plan))
                del gathered
        exchange_s = _add(exchange_s, clock.lap())

        flight.kernels.apply(self, plan, self._result_targets(plan, flight.send, results))
        apply_s = clock.lap()

        self._metrics.append(
            BucketMetrics(
                plan.bucket,
                len(plan.matrices),
                plan.owned,
                plan.bytes_sent,
                plan.bytes_received,
                plan.workspace_bytes,
                _add(flight.exchange_s, exchange_s),
                ns_s,
                apply_s,
            )
        )

    def _result_targets(
        self, plan: ExchangePlan, send: Tensor | None, results: dict[int, Tensor]
    ) -> list[tuple[int, Tensor, Tensor]]:
        """(matrix, the param rectangle it updates, its result there) for this rank's pieces."""
        if send is None:
            return [
                (i, self._block(m)[m.row0 : m.row0 + m.rows], results[i])
                for i, m in enumerate(plan.matrices)
            ]
        return [
            (piece.matrix, local_rect(self._block(plan.matrices[piece.matrix]), piece), view)
            for piece, view in send_slots(plan, send)
        ]

    def _block(self, m: Matrix) -> Tensor:
        """This rank's local 2-D block of the param slice (expert) holding `m`."""
        return _stack(_local(self._params[m.param]))[m.expert]

    # -- AdamW groups ----------------------------------------------------------------------------

    def _adamw_group(self, index: int, params: list[Tensor], grads: list[Tensor | None]) -> None:
        hp = self._groups[index]
        with_grad = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        if not with_grad:
            return
        amsgrad = hp.get("amsgrad", False)
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        for p, _ in with_grad:
            state = self._opt.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = _zeros_like_local(p, _local(p).dtype)
                state["exp_avg_sq"] = _zeros_like_local(p, _local(p).dtype)
                if amsgrad:
                    state["max_exp_avg_sq"] = _zeros_like_local(p, _local(p).dtype)
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            if amsgrad:
                max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
            steps.append(state["step"])
        beta1, beta2 = hp["betas"]
        adamw(
            [_local(p) for p, _ in with_grad],
            [g for _, g in with_grad],
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=hp["lr"],
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            maximize=hp.get("maximize", False),
        )


def _autocast_off(device_types: Iterable[str]) -> contextlib.AbstractContextManager[Any]:
    """Autocast disabled for each of `device_types`, so `ns_dtype` decides the step's dtypes
    (entered only where it is on: a step runs this once per chunk when offloaded)."""
    stack = contextlib.ExitStack()
    for device_type in device_types:
        # the meta device has no autocast (asking raises): a dry run steps as torch's Muon
        if device_type != "meta" and torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


class _Clock:
    """Seconds between laps, with the device synchronized; does nothing unless enabled."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self._enabled = enabled
        self._device = device
        self._last = self._now() if enabled else 0.0

    def _now(self) -> float:
        if self._device.type != "cpu":
            torch.accelerator.synchronize(self._device)
        return time.perf_counter()

    def lap(self) -> float | None:
        if not self._enabled:
            return None
        now = self._now()
        elapsed, self._last = now - self._last, now
        return elapsed
