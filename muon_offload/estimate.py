"""Muon's memory, wire bytes and Newton-Schulz work per rank, estimated before the run.

Every figure comes from the planning code the optimizer runs: params are grouped
by `muon_param_groups`; each rank's `ParamLayout`s are what `Muon` derives from
the DTensors of the mesh `MeshSpec` describes; `MuonPlan.build` (or `seen_from`
for a rank with the same exchanged matrices) assigns buckets and owners; the
step's launches are `MuonPlan.exchange` (exchanged buckets) and
`MuonPlan.local_exchanges` (local params, re-bucketed as `MuonStep` does), walked
in `launch_order`; with offload, `offload.step_plan.plan_offloaded_step` plans the
step `CPUOffloadOptimizer` runs (its chunks, residency, the backward's loads and
schedule) over the units exactly as `MuonStep` makes them (each exchanged bucket,
each param of a local bucket, each AdamW param; none sliced: `MuonStep` has no
`step_slices`).

Which ranks: every rank of one replica (of the whole mesh when a bucket spreads its
owners over the HSDP replicas) is screened (`screen_ranks`: shard
sizes by arithmetic on all ranks at once, owners from one plan per exchange
group), which finds the busiest and idlest rank and the top-peak candidates
without planning each rank; only those (`ModelEstimate.picked`) and any asked
for are planned in full, so the time grows with the ranks plus the matrices,
not their product. A mesh not planned within `time_limit_s` is refused.

Memory model of the step, per rank (GPU bytes; what `Muon.step` allocates):
- kept between steps: the state (fp32 momentum of the local shards, AdamW's two
  moments); with offload only the GPU-resident state (`gpu_resident_bytes`,
  default none): the rest lives on the host, and the staging ring is allocated
  for the step and given back after it;
- step transient: with offload the ring (`staging_slots` x the largest chunk it takes, fewer
  slots when fewer chunks are left to it) and, with `offload_backward_load_bytes`, an
  extra slot per chunk the backward loads (held from the backward on), and on top of
  them the compute's peak over the
  chunks. The compute, following `launch_order`: each launch's send, receive and full
  buffers of exactly its `send_numel`, `recv_numel`, `full_numel` (in `ns_dtype`) from
  its start to its finish (a local launch holds only `full` and finishes as it
  starts), its `ns_numel` on top while it finishes (`transient_peak_numel`: the
  standard iteration's workspace, which bounds what "auto" takes on any device; Gram's
  with `StepSettings.ns_algorithm="gram"`, as the optimizer's plan counts it for
  groups that force it), and on the torch momentum path (CPU) its fp32 momentum-step
  results while it packs. After the launches, torch's AdamW on CUDA (foreach) copies
  `sqrt(exp_avg_sq)` of every param of the call; on CPU (single tensor) one param at a
  time.
The step's peak is kept + the step transient. Not modelled: the caching
allocator's rounding and fragmentation, the first step's creation of state
(with offload, one more chunk then), and cuBLAS workspaces. With `overlap_forward`
(`StepSettings.offload_overlap_forward`) the chunks follow the forward's first use of
their units, which `estimate`'s `fsdp_modules` (the run's wrap) decides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache

import torch
from torch import nn
from torch.distributed.tensor import Shard

from muon.model_shapes import ParamShape, meta_module
from muon.newton_schulz import every_matrix_alone, ns_flops, ns_workspace_numel
from muon.ns_schedules import SCHEDULES, NewtonSchulzSchedule
from muon.optimizer import DEFAULT_MAX_INFLIGHT
from muon.options import (
    check_bucket_cap_bytes,
    check_max_inflight,
    check_ns_algorithm,
    check_ns_schedule,
    check_replica_bytes_per_s,
    check_replica_owners,
)
from muon.param_groups import muon_param_groups
from muon.planning import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_SPREAD_MODEL,
    ExchangePlan,
    MuonPlan,
    ParamLayout,
    SpreadModel,
    buffer_timeline,
    chunk_range,
    held_numel,
    launch_order,
)

# What CPUOffloadOptimizer stages comes from its own pure chunk planner and defaults
# (one source of truth); this module joins muon and offload, so it lives in muon_offload.
from offload.chunk_plan import OffloadPlan, ParamSpec, StateSpec
from offload.cpu_offload import DEFAULT_CHUNK_BYTES, DEFAULT_STAGING_SLOTS
from offload.forward_overlap import (
    in_forward_order,
    is_fsdp_module,
    param_owners,
    waited_params,
)
from offload.options import check_bytes, check_chunk_bytes, check_staging_slots
from offload.step_plan import BackwardLoads, plan_offloaded_step
from offload.step_schedule import StepSchedule, update_runs

EXPERT_SHARDS = ("auto", "experts", "rows")
DEVICES = ("cuda", "cpu")
MOMENTUM_DTYPE = torch.float32  # Muon keeps fp32 momentum whatever the param dtype


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """The device mesh as FSDP2 (+ HSDP, + EP) lays params out, torchtitan style.

    Dense params: Shard(0) over `fsdp` ranks (mesh (replicate, fsdp) for HSDP).
    Expert stacks (E, out, in): Shard(0) over `ep`, then over the `fsdp // ep`
    ranks of each EP group on the expert dim ("experts": whole matrices, no
    exchange) or on rows ("rows": exchanged); "auto" takes rows only when the
    experts are fewer than `fsdp` (torchtitan's rule; plain `fully_shard` shards the
    expert dim, and `estimate` of a live FSDP2 module reads it). Global rank r of a replica
    sits at fsdp index r, EP coordinate r // (fsdp // ep).
    """

    fsdp: int
    replicate: int = 1
    ep: int = 1
    expert_shard: str = "auto"

    def __post_init__(self) -> None:
        for name in ("fsdp", "replicate", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} should be >= 1 but is: {getattr(self, name)}")
        if self.fsdp % self.ep:
            raise ValueError(f"fsdp {self.fsdp} should be a multiple of ep {self.ep}")
        if self.expert_shard not in EXPERT_SHARDS:
            raise ValueError(
                f"expert_shard should be one of {EXPERT_SHARDS} but is: {self.expert_shard!r}"
            )

    @property
    def world(self) -> int:
        return self.replicate * self.fsdp

    def _axes(self, sizes: tuple[int, ...], dims: tuple[int | None, ...], rank: int):
        index, inner = rank % self.fsdp, self.fsdp // self.ep
        coord = (index,) if len(sizes) == 1 else (index // inner, index % inner)
        if self.replicate == 1:
            return sizes, dims, coord
        return (self.replicate, *sizes), (None, *dims), (rank // self.fsdp, *coord)

    def layout(self, shape: tuple[int, ...], row_blocks: Sequence[int], group: int, rank: int):
        """The `ParamLayout` `Muon` derives for a Muon param at global rank `rank` (replica
        `rank // fsdp`, fsdp index `rank % fsdp`)."""
        if len(shape) == 3:
            rows = self.expert_shard == "rows" or (
                self.expert_shard == "auto" and shape[0] < self.fsdp
            )
            dim = 1 if rows else 0
            if self.ep > 1:
                axes = self._axes((self.ep, self.fsdp // self.ep), (0, dim), rank)
                return ParamLayout(shape, tuple(row_blocks), *axes, "experts", group)
            axes = self._axes((self.fsdp,), (dim,), rank)
            return ParamLayout(shape, tuple(row_blocks), *axes, "dense", group)
        axes = self._axes((self.fsdp,), (0,), rank)
        return ParamLayout(shape, tuple(row_blocks), *axes, "dense", group)

    def coords(self, mesh_key: str, ranks: int) -> torch.Tensor:
        """Per global rank below `ranks`, its coordinate on the mesh `mesh_key` ("dense" or
        "experts") as `layout` places it: a (ranks, axes) int64 tensor."""
        rank = torch.arange(ranks, dtype=torch.int64)
        index = rank % self.fsdp
        columns = [index]
        if mesh_key == "experts":
            inner = self.fsdp // self.ep
            columns = [index // inner, index % inner]
        if self.replicate > 1:
            columns.insert(0, rank // self.fsdp)
        return torch.stack(columns, dim=1)

    def leaders(self, mesh_key: str, ranks: int) -> range:
        """The first global rank of each exchange group on `mesh_key` below `ranks` (its
        members are the next `fsdp // groups` ranks: owner index o of leader g is rank g + o)."""
        step = self.fsdp // self.ep if mesh_key == "experts" else self.fsdp
        return range(0, ranks, step)

    def local_shape(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """A dense (AdamW) param's Shard(0) shard at global rank `rank`."""
        start, stop = chunk_range(shape[0], self.fsdp, rank % self.fsdp)
        return (stop - start, *shape[1:])


@dataclass(frozen=True, slots=True)
class StepSettings:
    """Muon's bucket and dtype settings, and the offload wrapper's, as the run will use them."""

    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    ns_dtype: torch.dtype = torch.bfloat16
    """On the wire and in Newton-Schulz."""
    param_dtype: torch.dtype | None = None
    """Of params and grads, and so of AdamW's moments. None: `estimate`'s live module's
    (its trainable params', one dtype), float32 for shapes."""
    nesterov: bool = True
    device: str = "cuda"
    """"cuda": the fused momentum kernel (Triton) packs straight into the buffers and
    torch's AdamW runs foreach; "cpu": the torch momentum path and single-tensor AdamW."""
    offload_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    offload_slots: int = DEFAULT_STAGING_SLOTS
    offload_resident_bytes: int = 0
    """`CPUOffloadOptimizer`'s `gpu_resident_bytes` (an int: "auto" decides at run time)."""
    offload_overlap_forward: bool = False
    """`CPUOffloadOptimizer` given `overlap_forward`: the chunks follow the forward's first
    use of their units (`estimate`'s `fsdp_modules`), and the resident state is the units
    the forward needs first."""
    offload_backward_load_bytes: int | None = None
    """`CPUOffloadOptimizer`'s `load_in_backward` as a byte count (it implies
    `offload_overlap_forward`): the most state the backward loads, the leading whole
    chunks within it, in an extra slot per chunk. 0: no loads in the backward
    (`load_in_backward=False`). None (the default, as the wrapper's), with overlap: the
    chunks holding what the forward waits for first, at least the ring's; on CUDA the
    wrapper also loads more while they fit under the activations' peak, and over its first
    steps more where the forward stalls for its loads, within the device's free memory
    (`offload.backward_tuning`), which this estimate cannot see (it plans the optimizer's
    memory alone), so it plans the first-wait chunks: a floor on the GPU."""
    offload_gpu_budget_bytes: int | None = None
    """`CPUOffloadOptimizer`'s `gpu_budget_bytes` with the default backward loads (overlap,
    nothing resident, `offload_backward_load_bytes` None): the first-wait chunks are cut to
    what the step may hold within it, as planned here, and the wrapper's growth on CUDA
    stays within it: the state the step holds on the GPU is at most the budget (or the
    ring, where the ring alone holds more)."""
    ns_algorithm: str = "auto"
    """Muon's `ns_algorithm` for every Muon group: "gram" plans Gram Newton-Schulz's
    workspace; "auto" and "standard" the standard iteration's, which bounds "auto"'s."""
    ns_schedule: str = "keller_jordan"
    """The Newton-Schulz schedule (a key of `muon.SCHEDULES`): Gram's workspace follows
    its restart segments."""
    replica_owners: str = "auto"
    """Muon's `replica_owners` for every Muon group (HSDP: `muon.planning.REPLICA_OWNERS`)."""
    replica_bytes_per_s: float = DEFAULT_SPREAD_MODEL.replica_bytes_per_s
    """`SpreadModel.replica_bytes_per_s`: the bandwidth between replicas "auto" assumes."""

    def __post_init__(self) -> None:
        # muon.options' and offload.options' checks, under this class's names
        check_bucket_cap_bytes(self.bucket_cap_bytes)
        check_max_inflight(self.max_inflight)
        if self.device not in DEVICES:
            raise ValueError(f"device should be one of {DEVICES} but is: {self.device!r}")
        check_chunk_bytes(self.offload_chunk_bytes, "offload_chunk_bytes")
        check_staging_slots(self.offload_slots, "offload_slots")
        check_bytes(self.offload_resident_bytes, "offload_resident_bytes")
        if self.offload_backward_load_bytes is not None:
            check_bytes(self.offload_backward_load_bytes, "offload_backward_load_bytes")
        if self.offload_gpu_budget_bytes is not None:
            check_bytes(self.offload_gpu_budget_bytes, "offload_gpu_budget_bytes")
            if not (
                self.offload_overlap_forward
                and self.offload_resident_bytes == 0
                and self.offload_backward_load_bytes is None
            ):
                raise ValueError(
                    "offload_gpu_budget_bytes bounds the default backward loads: it needs "
                    "offload_overlap_forward, offload_resident_bytes 0 and "
                    "offload_backward_load_bytes None (the wrapper refuses it otherwise)"
                )
        check_ns_algorithm(self.ns_algorithm)
        check_ns_schedule(self.ns_schedule)
        check_replica_owners(self.replica_owners)
        check_replica_bytes_per_s(self.replica_bytes_per_s)

    def as_dict(self) -> dict[str, object]:
        def plain(value: object) -> object:
            return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value

        return {name: plain(getattr(self, name)) for name in self.__slots__}

    @property
    def moment_dtype(self) -> torch.dtype:
        """AdamW's moments', the params' dtype (float32 where `param_dtype` is None)."""
        return self.param_dtype or torch.float32


@dataclass(frozen=True, slots=True)
class BucketLoad:
    """One bucket on one rank with every param active: its `ExchangePlan`'s numbers
    (`BucketMetrics` names where they overlap)."""

    bucket: int
    rank: int
    matrices: int
    owned: int
    bytes_sent: int
    bytes_received: int
    workspace_bytes: int
    send_numel: int
    recv_numel: int
    full_numel: int
    ns_numel: int
    itemsize: int
    ns_flops: int

    @classmethod
    def of(cls, plan: ExchangePlan, rank: int) -> BucketLoad:
        return cls(
            bucket=plan.bucket,
            rank=rank,
            matrices=len(plan.matrices),
            owned=plan.owned,
            bytes_sent=plan.bytes_sent,
            bytes_received=plan.bytes_received,
            workspace_bytes=plan.workspace_bytes,
            send_numel=plan.send_numel,
            recv_numel=plan.recv_numel,
            full_numel=plan.full_numel,
            ns_numel=plan.ns_numel,
            itemsize=plan.itemsize,
            ns_flops=sum(len(b.matrices) * ns_flops(b.rows, b.cols) for b in plan.batches),
        )

    @property
    def buffer_bytes(self) -> int:
        """Send, receive and full buffers while the bucket is in flight."""
        return (self.send_numel + self.recv_numel + self.full_numel) * self.itemsize

    @property
    def ns_bytes(self) -> int:
        return self.ns_numel * self.itemsize


@dataclass(frozen=True, slots=True)
class Transient:
    """What a step allocates on top of what is kept, at its peak, by kind."""

    buffer_bytes: int = 0
    """Exchange buffers (send, receive, full) of the buckets alive."""
    ns_bytes: int = 0
    """Newton-Schulz temporaries of the bucket finishing."""
    other_bytes: int = 0
    """Momentum-step results of the bucket starting (torch path), or AdamW's temporaries."""

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes + self.ns_bytes + self.other_bytes


def _larger(a: Transient, b: Transient) -> Transient:
    return b if b.total_bytes > a.total_bytes else a


def muon_transient(
    plans: Sequence[ExchangePlan],
    max_inflight: int,
    momentum_bytes: Callable[[ExchangePlan], int] = lambda plan: 0,
) -> Transient:
    """Peak of `MuonStep._run_muon` over `plans` (bucket order), walking `launch_order`.

    Buffers and Newton-Schulz are `muon.planning.buffer_timeline`'s, by kind; a start
    adds `momentum_bytes(plan)` (the torch path's momentum results) on top of the
    buffers alive, its own included (they are allocated before it packs).
    """
    peak = Transient()
    for start, plan, live in buffer_timeline(plans, max_inflight):
        if start:
            peak = _larger(peak, Transient(live * plan.itemsize, 0, momentum_bytes(plan)))
        else:
            peak = _larger(peak, Transient(live * plan.itemsize, plan.ns_numel * plan.itemsize, 0))
            # then a spread bucket's replica gather, after Newton-Schulz's workspace went
            gather = (live + plan.gather_buffers_numel) * plan.itemsize
            peak = _larger(peak, Transient(gather, 0, 0))
    return peak


def adamw_transient(group_bytes: Mapping[int, Sequence[int]], device: str) -> Transient:
    """Temporaries of `MuonStep`'s AdamW calls (one per group): a `sqrt(exp_avg_sq)` copy
    of the whole call on CUDA (foreach), of one param at a time on CPU (single tensor:
    the root and its quotient)."""
    if device == "cuda":
        other = max((sum(sizes) for sizes in group_bytes.values()), default=0)
    else:
        other = 2 * max((max(sizes, default=0) for sizes in group_bytes.values()), default=0)
    return Transient(other_bytes=other)


@dataclass(frozen=True, slots=True)
class StepMemory:
    """GPU bytes of one rank's optimizer: kept between steps, and what the step adds."""

    state_bytes: int
    """State on the GPU between steps: all of it without offload; with offload the
    GPU-resident state only."""
    staging_bytes: int
    """Offload's staging ring and the backward's extra slots, allocated for the step only
    (with backward loads, from the backward on; 0 without offload)."""
    transient: Transient
    """The compute's peak (over the chunks with offload), on top of the ring."""

    @property
    def kept_bytes(self) -> int:
        return self.state_bytes

    @property
    def step_bytes(self) -> int:
        """What the step allocates on top of what is kept, at its peak."""
        return self.staging_bytes + self.transient.total_bytes

    @property
    def peak_bytes(self) -> int:
        return self.kept_bytes + self.step_bytes


@dataclass(frozen=True, slots=True)
class RankEstimate:
    """One rank of one replica."""

    rank: int
    loads: tuple[BucketLoad, ...]
    """Per bucket."""
    muon_state_bytes: int
    adamw_state_bytes: int
    units: tuple[tuple[int, ...], ...]
    """`MuonStep.units` as indices: Muon params (`MuonPlan` order), then AdamW params."""
    no_offload: StepMemory
    offload: StepMemory
    offload_plan: OffloadPlan
    """The chunks `CPUOffloadOptimizer` builds (`plan`): param indices as `units`'."""
    offload_schedule: StepSchedule
    """How `CPUOffloadOptimizer` runs the offloaded step's chunks."""

    @property
    def offload_chunks(self) -> int:
        return len(self.offload_schedule.slots)

    @property
    def offload_forward_load_bytes(self) -> int:
        """With forward overlap, the state bytes the forward after a step loads."""
        chunks = self.offload_plan.chunks
        return self.offload_schedule.forward_load_bytes([c.invariant_bytes for c in chunks])

    @property
    def state_bytes(self) -> int:
        """All optimizer state, wherever it lives."""
        return self.muon_state_bytes + self.adamw_state_bytes

    @property
    def ns_flops(self) -> int:
        return sum(load.ns_flops for load in self.loads)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank puts on the wire in one step (all buckets)."""
        return sum(load.bytes_sent for load in self.loads)


@dataclass(frozen=True, slots=True)
class PaddedAlternative:
    """A padded all-to-all (XTuner style) for one bucket: per shape, matrices padded to a
    multiple of the ranks, rows to a multiple of the ranks, equal splits."""

    wire_bytes: int
    """Per rank, out and back."""
    buffer_bytes: int
    """Per rank: padded send buffer + received and full matrices."""
    padding_bytes: int
    """Zeros among the matrices the ranks exchange, per rank."""
    padded_bytes: int
    """All matrix bytes the padded exchange holds, per rank (real + zeros)."""


def padded_alternative(plan: MuonPlan, bucket: int) -> PaddedAlternative | None:
    """What a padded all-to-all would cost for `bucket` of `plan`; None for a local bucket."""
    b = plan.buckets[bucket]
    if b.axis is None:
        return None
    world = plan.layouts[b.params[0]].mesh_shape[b.axis]
    counts: dict[tuple[int, int], int] = {}
    for m in plan.matrices[bucket]:
        counts[(m.rows, m.cols)] = counts.get((m.rows, m.cols), 0) + 1
    wire = buffer = padding = padded_total = 0
    for (rows, cols), count in counts.items():
        per_rank = math.ceil(count / world)  # padded matrices each rank owns
        shard = math.ceil(rows / world) * cols
        wire += 2 * per_rank * (world - 1) * shard
        buffer += per_rank * world * shard + 2 * per_rank * shard * world
        padded = per_rank * world * shard * world
        padded_total += padded
        padding += padded - count * rows * cols
    size = plan.itemsize
    return PaddedAlternative(
        wire * size, buffer * size, padding * size // world, padded_total * size // world
    )


@dataclass(frozen=True, slots=True)
class RankScreen:
    """Every rank of one replica (of the whole mesh when a bucket spreads its owners over
    the replicas), counted from shard sizes and the owner assignment without planning an
    exchange: what picks the ranks `estimate` plans. Per bucket and
    rank it equals the planned ranks' `BucketLoad`s (a test holds every rank to that)."""

    ns_flops: torch.Tensor
    """(buckets, ranks) int64: Newton-Schulz FLOPs of the matrices each rank owns per bucket
    (ranks: one replica's, or the whole mesh's when a bucket spreads over the replicas)."""
    bytes_sent: torch.Tensor
    """(buckets, ranks) int64: bytes each rank puts on the wire per bucket."""
    buffer_bytes: torch.Tensor
    """(buckets, ranks) int64: send, receive and full buffers per bucket."""
    state_bytes: torch.Tensor
    """(ranks,) int64: optimizer state (Muon momentum, AdamW moments)."""
    muon_transient_bytes: torch.Tensor
    """(ranks,) int64: the Muon launches' peak over a whole step (`transient_peak_numel`;
    without the torch path's momentum results): what finds the top-peak candidates."""

    @property
    def flops(self) -> torch.Tensor:
        """(ranks,): Newton-Schulz FLOPs per rank in the step."""
        return self.ns_flops.sum(0)

    @staticmethod
    def most(values: torch.Tensor) -> int:
        """The rank with the largest value (the lowest such rank)."""
        return int(torch.argmax(values))  # torch returns the first maximal index

    @staticmethod
    def fewest(values: torch.Tensor) -> int:
        """The rank with the smallest value (the highest such rank, so that with balanced
        values it is not `most`'s)."""
        return len(values) - 1 - int(torch.argmin(values.flip(0)))


@dataclass(frozen=True, slots=True)
class ModelEstimate:
    """One replica (the whole mesh when a bucket spreads): every rank screened (`screen`),
    a few planned in full (`ranks`). Ranks are global: replica `rank // fsdp`."""

    mesh: MeshSpec
    settings: StepSettings
    names: tuple[str, ...]
    """Muon params in the optimizer's order (`MuonPlan` indices)."""
    screen: RankScreen
    ranks: tuple[RankEstimate, ...]
    """The planned ranks, in rank order: the `picked` ones and any `estimate` was asked for."""
    picked: tuple[tuple[str, int], ...]
    """(why, rank) of each representative rank, found from `screen`."""
    padded: tuple[PaddedAlternative | None, ...]
    """Per bucket; None for a local bucket."""
    plan_of: Callable[[int], MuonPlan] = field(compare=False, repr=False)
    """The `MuonPlan` `Muon` builds at an fsdp index (cached)."""
    param_names: tuple[str, ...] = ()
    """Every param the optimizer steps, by the index `RankEstimate.units` uses."""

    def plan(self, rank: int) -> MuonPlan:
        return self.plan_of(rank)

    def rank(self, rank: int) -> RankEstimate:
        """The planned estimate of fsdp index `rank`."""
        for planned in self.ranks:
            if planned.rank == rank:
                return planned
        raise ValueError(
            f"rank {rank} was not planned; pass ranks=[{rank}] to estimate() to plan it"
        )

    def muon_step_transient(self, rank: int) -> Transient:
        """The Muon launches of a whole step on `rank`, without AdamW."""
        plan = self.plan(rank)
        return launches_transient(plan, plan.step_units(0), self.settings)

    def exchange(self, rank: int, bucket: int) -> ExchangePlan:
        """The `ExchangePlan` of `rank` for `bucket`, every param active."""
        plan = self.plan(rank)
        return plan.exchange(bucket, frozenset(plan.buckets[bucket].params))

    @property
    def busiest(self) -> RankEstimate:
        """The rank with the most Newton-Schulz FLOPs (the lowest such rank)."""
        return self.rank(RankScreen.most(self.screen.flops))

    @property
    def idlest(self) -> RankEstimate:
        """The rank with the fewest Newton-Schulz FLOPs (the highest such rank, so that with
        balanced FLOPs it is not the busiest)."""
        return self.rank(RankScreen.fewest(self.screen.flops))

    def largest_peak(self, offload: bool) -> RankEstimate:
        """Of the planned ranks, the one whose step peaks highest (the one a memory budget
        must fit; `picked` says which ranks were candidates)."""
        return max(self.ranks, key=lambda r: (_memory(r, offload).peak_bytes, -r.rank))

    @property
    def imbalance(self) -> float:
        """Max over mean of the ranks' Newton-Schulz FLOPs (1.0 is perfect), over all ranks."""
        flops = self.screen.flops
        total = int(flops.sum())
        return int(flops.max()) * len(flops) / total if total else 1.0

    @property
    def padding_fraction(self) -> float:
        """Share of a padded all-to-all's matrix bytes that are zeros, over all buckets."""
        padded = sum(p.padded_bytes for p in self.padded if p is not None)
        zeros = sum(p.padding_bytes for p in self.padded if p is not None)
        return zeros / padded if padded else 0.0


def _memory(rank: RankEstimate, offload: bool) -> StepMemory:
    return rank.offload if offload else rank.no_offload


def _resolved(
    shapes: Sequence[ParamShape] | nn.Module,
    mesh: MeshSpec,
    settings: StepSettings | None,
    check: Callable[[], None] | None = None,
) -> tuple[nn.Module, MeshSpec, StepSettings]:
    """The module to plan (a live one, or shapes on the meta device, built calling `check`
    as it goes), and `mesh` and `settings` with what a live module says of itself: its
    expert stacks' sharding and its params' dtype."""
    if isinstance(shapes, nn.Module):
        return shapes, _with_live_expert_shard(mesh, shapes), _with_param_dtype(settings, shapes)
    return meta_module(shapes, check), mesh, _with_param_dtype(settings, None)


def _with_live_expert_shard(mesh: MeshSpec, module: nn.Module) -> MeshSpec:
    """`mesh` with `expert_shard` "auto" resolved from a live FSDP2 module's expert stacks
    (3-D DTensor params): plain `fully_shard` shards the expert dim whatever the expert
    count, where "auto" takes torchtitan's rows for fewer experts than ranks (planned
    so, a rank's state came out 12% off). Only without expert parallelism: the last
    Shard placement is FSDP's."""
    if mesh.expert_shard != "auto" or mesh.ep > 1:
        return mesh
    for p in module.parameters():
        shards = [pl.dim for pl in getattr(p, "placements", ()) if isinstance(pl, Shard)]
        if p.ndim == 3 and shards:
            return replace(mesh, expert_shard="experts" if shards[-1] == 0 else "rows")
    return mesh


def _with_param_dtype(settings: StepSettings | None, module: nn.Module | None) -> StepSettings:
    """`settings` (default: `StepSettings()`) with `param_dtype` set: a live `module`'s own
    (a bf16 model's AdamW moments are bf16: planned as fp32 they came out 22% too large),
    else float32."""
    settings = settings or StepSettings()
    if settings.param_dtype is not None:
        return settings
    dtypes = set()
    if module is not None:
        dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
    if len(dtypes) > 1:
        raise ValueError(
            f"the module's trainable params have several dtypes ({sorted(map(str, dtypes))}): "
            "say which the run steps, StepSettings(param_dtype=...)"
        )
    return replace(settings, param_dtype=dtypes.pop() if dtypes else torch.float32)


def _split(
    module: nn.Module, row_blocks: Mapping[str, Sequence[int]] | None
) -> tuple[
    list[tuple[str, tuple[int, ...], tuple[int, ...], int]],
    list[tuple[int, tuple]],
    list[nn.Parameter],
]:
    """Muon params as (name, shape, row_blocks, group) in the optimizer's order, the
    AdamW params as (group, shape), as `muon_param_groups` groups them, and the params
    by index (the Muon ones, then the AdamW ones: `RankEstimate.units`' numbering).
    `row_blocks`: as `muon_param_groups` takes them, which adds the module's own
    declarations (`model_row_blocks`; a `meta_module`'s come from its shapes)."""
    names = {id(p): name for name, p in module.named_parameters()}
    muon, adamw, muon_params, adamw_params = [], [], [], []
    for index, group in enumerate(muon_param_groups(module, row_blocks=row_blocks)):
        for p in group["params"]:
            if group.get("algorithm") == "adamw":
                adamw.append((index, tuple(p.shape)))
                adamw_params.append(p)
            else:
                blocks = tuple(group.get("row_blocks") or ())
                muon.append((names[id(p)], tuple(p.shape), blocks, index))
                muon_params.append(p)
    return muon, adamw, muon_params + adamw_params


def launches_transient(
    plan: MuonPlan, units: Sequence[tuple[str, int]], settings: StepSettings
) -> Transient:
    """The Muon launches of `MuonStep.step_params` over these (`MuonPlan.step_units`)
    units, every param active; AdamW units are left out."""
    plans = plan.step_plans(
        [i for what, i in units if what == "bucket"],
        [i for what, i in units if what == "local"],
        frozenset(range(len(plan.layouts))),
    )
    local = [math.prod(layout.local_shape()) for layout in plan.layouts]
    return muon_transient(
        plans,
        settings.max_inflight,
        lambda launch: _momentum_bytes([local[i] for i in launch.params], settings),
    )


def _momentum_bytes(numels: Sequence[int], settings: StepSettings) -> int:
    """Peak of a launch's momentum step on the torch path: results kept (Nesterov) while
    it packs, and a grad's fp32 cast if the params are not fp32. None with the fused kernel."""
    if settings.device == "cuda":
        return 0
    size = MOMENTUM_DTYPE.itemsize
    cast = settings.moment_dtype != MOMENTUM_DTYPE
    alive = peak = 0
    for n in numels:  # params in index order, as `_TorchElementwise.momentum` updates them
        result = n * size if settings.nesterov else 0
        peak = max(peak, alive + result + (n * size if cast else 0))
        alive += result
    return peak


def _shards(layout: ParamLayout) -> int:
    """Mesh ranks a param is sharded over (`offload.cpu_offload.shard_count` of it)."""
    sizes = zip(layout.mesh_shape, layout.shard_dims, strict=True)
    return math.prod(n for n, dim in sizes if dim is not None)


# How long `estimate` may plan before it refuses the mesh (seconds); qwen3-30b-a3b on
# 8192 ranks plans in about a second on a 2-core machine (bench/measured/plan_scale_cpu.log).
DEFAULT_TIME_LIMIT_S = 60.0


class PlanTooLarge(ValueError):
    """The mesh could not be planned within the time limit."""


class _Deadline:
    def __init__(self, mesh: MeshSpec, limit_s: float, params: int) -> None:
        self._mesh, self._limit, self._params = mesh, limit_s, params
        self._end = time.monotonic() + limit_s

    def check(self, doing: str) -> None:
        if time.monotonic() > self._end:
            raise PlanTooLarge(
                f"planning {self._params} params on fsdp {self._mesh.fsdp} x replicate "
                f"{self._mesh.replicate} did not finish within time_limit_s={self._limit:g} "
                f"(stopped {doing}); plan a smaller model or mesh, or raise the limit "
                "(--time-limit-s)"
            )


def _local_ranges(layout: ParamLayout, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layout.dim_range` of every dim at each of `coords` ((ranks, axes)): (start, stop),
    each a (ranks, ndim) tensor, by torch.chunk's arithmetic on all ranks at once."""
    starts, stops = [], []
    for dim in range(layout.ndim):
        start = torch.zeros(len(coords), dtype=torch.int64)
        stop = torch.full_like(start, layout.shape[dim])
        for axis, sharded in enumerate(layout.shard_dims):
            if sharded == dim:
                size, chunks = stop - start, layout.mesh_shape[axis]
                step = (size + chunks - 1) // chunks
                first = torch.minimum(coords[:, axis] * step, size)
                start, stop = start + first, start + torch.minimum(first + step, size)
        starts.append(start)
        stops.append(stop)
    return torch.stack(starts, dim=1), torch.stack(stops, dim=1)


def screen_ranks(
    mesh: MeshSpec,
    plan_of: Callable[[int], MuonPlan],
    adamw: Sequence[tuple[int, tuple[int, ...]]],
    settings: StepSettings,
    deadline: _Deadline | None = None,
) -> RankScreen:
    """`RankScreen` of every rank of one replica (of the whole mesh if a bucket spreads its
    owners over the replicas): shard sizes by arithmetic on all ranks at once, the owners
    of each exchange group's matrices from one plan per group (`MeshSpec.leaders`), each
    owner's own piece (what it does not send) by `held_numel`, and a spread bucket's
    regions (`ExchangePlan.replica_splits`) from each matrix's pieces on all ranks at once.
    Time linear in the ranks plus the matrices, not in their product."""
    first = plan_of(0)
    buckets, fsdp = first.buckets, mesh.fsdp
    ranks = mesh.world if any(b.spread for b in buckets) else fsdp
    itemsize = first.itemsize
    held: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    local: list[torch.Tensor] = []
    for layout in first.layouts:
        key = (layout.shape, layout.mesh_key, layout.shard_dims)
        if key not in held:
            held[key] = _local_ranges(layout, mesh.coords(layout.mesh_key, ranks))
        start, stop = held[key]
        local.append(stop - start)
    rows = torch.arange(ranks, dtype=torch.int64)
    state = sum((sizes.prod(1) for sizes in local), torch.zeros(ranks, dtype=torch.int64))
    state = state * MOMENTUM_DTYPE.itemsize
    for _, shape in adamw:  # Shard(0) over the fsdp ranks
        step, size = -(-shape[0] // fsdp), torch.tensor(shape[0])
        index = rows % fsdp
        chunk = torch.minimum(index * step + step, size) - torch.minimum(index * step, size)
        state += 2 * chunk * math.prod(shape[1:]) * settings.moment_dtype.itemsize

    flops = torch.zeros(len(buckets), ranks, dtype=torch.int64)
    send, full, own, region, width = (torch.zeros_like(flops) for _ in range(5))
    for bucket in buckets:
        for i in bucket.params:
            layout = first.layouts[i]
            if bucket.axis is not None:
                send[bucket.index] += local[i].prod(1)
                continue
            experts = local[i][:, 0] if layout.ndim == 3 else torch.ones_like(rows)
            cols = layout.shape[-1]
            flops[bucket.index] += experts * sum(ns_flops(r, cols) for r in layout.blocks)
            full[bucket.index] += experts * layout.shape[-2] * cols
    gram = dict(first.gram_schedules)
    workspace = torch.zeros_like(flops)  # Newton-Schulz's, per bucket and rank
    for bucket in buckets:
        if bucket.axis is not None:
            continue
        # ranks holding as many of each param's matrices batch alike (plan_exchange's order)
        counts = torch.stack(
            [local[i][:, 0] if first.layouts[i].ndim == 3 else torch.ones_like(rows)
             for i in bucket.params],
            dim=1,
        )  # fmt: skip
        kinds, which = torch.unique(counts, dim=0, return_inverse=True)
        for k, kind in enumerate(kinds.tolist()):
            shapes: dict[tuple[int, int, int], int] = {}
            for i, count in zip(bucket.params, kind, strict=True):
                layout = first.layouts[i]
                for block in layout.blocks if count else ():
                    key = (layout.group, block, layout.shape[-1])
                    shapes[key] = shapes.get(key, 0) + count
            workspace[bucket.index, which == k] = _ns_numel(shapes, gram, first.ns_per_matrix)
    # owned matrices of exchanged buckets, as flat (bucket * ranks + rank) indices
    where: list[int] = []
    owned: list[tuple[int, int, int]] = []
    # spread buckets: (bucket, leader, group size, param, row0, rows, owner replica) -> count
    pieces: dict[tuple[int, int, int, int, int, int, int], int] = {}
    # (bucket, owner rank in replica 0 or of a spread bucket) -> its batches' (group, rows,
    # cols) -> matrices, in plan order
    batched: dict[tuple[int, int], dict[tuple[int, int, int], int]] = {}
    copies = mesh.replicate if ranks == mesh.world else 1  # replicas screened
    for key in sorted({b.mesh_key for b in buckets if b.axis is not None}, key=str):
        # replica 0's groups: per replica, the other replicas' owners are theirs shifted
        for leader in mesh.leaders(key, fsdp):
            if deadline is not None:
                deadline.check(f"screening the exchange group of rank {leader}")
            plan = plan_of(leader)
            for bucket in buckets:
                if bucket.axis is None or bucket.mesh_key != key:
                    continue
                size = plan.layouts[bucket.params[0]].mesh_shape[bucket.axis]
                shifts = [0] if bucket.spread else [r * fsdp for r in range(copies)]
                for m in plan.matrices[bucket.index]:
                    layout = plan.layouts[m.param]
                    owner = leader + m.owner + (m.replica or 0) * fsdp
                    counts = (
                        ns_flops(m.rows, m.cols),
                        m.rows * m.cols,
                        held_numel(layout, m, layout.peer_coord(bucket.axis, m.owner)),
                    )
                    for shift in shifts:
                        where.append(bucket.index * ranks + owner + shift)
                        owned.append(counts)
                    if bucket.spread:
                        piece = (bucket.index, leader, size, m.param, m.row0, m.rows, m.replica)
                        pieces[piece] = pieces.get(piece, 0) + 1
                    batch = batched.setdefault((bucket.index, owner), {})
                    shape = (layout.group, m.rows, m.cols)
                    batch[shape] = batch.get(shape, 0) + 1
    if where:
        index = torch.tensor(where, dtype=torch.int64)
        values = torch.tensor(owned, dtype=torch.int64)
        for target, column in ((flops, 0), (full, 1), (own, 2)):
            target.view(-1).index_add_(0, index, values[:, column])
    regions = torch.zeros(len(buckets), mesh.replicate, fsdp, dtype=torch.int64)
    for (b, leader, size, param, row0, count_rows, replica), count in pieces.items():
        layout = first.layouts[param]
        start, stop = held[(layout.shape, layout.mesh_key, layout.shard_dims)]
        members = slice(leader, leader + size)
        row, col = layout.ndim - 2, layout.ndim - 1
        rows_held = stop[members, row].clamp(max=row0 + count_rows)
        rows_held = (rows_held - start[members, row].clamp(min=row0)).clamp(min=0)
        cols_held = stop[members, col] - start[members, col]
        regions[b, replica, members] += count * rows_held * cols_held
    if pieces:  # this rank's region is exchanged; the widest is gathered from every replica
        region = regions.reshape(len(buckets), ranks)
        width = regions.max(1).values.repeat(1, mesh.replicate)
    for (b, owner), shapes in batched.items():
        numel = _ns_numel(shapes, gram, first.ns_per_matrix)
        for shift in [0] if buckets[b].spread else range(0, ranks, fsdp):
            workspace[b, owner + shift] = numel
    exchanged = torch.tensor([b.axis is not None for b in buckets]).unsqueeze(1)
    spread = torch.tensor([b.spread for b in buckets]).unsqueeze(1)
    recv = torch.where(exchanged, full, 0)
    sent = torch.where(spread, region + (mesh.replicate - 1) * width, send)
    wire = torch.where(exchanged, sent + recv - 2 * own, 0)
    buffers = send + recv + full
    # the step's launches on every rank at once, as `transient_peak_numel` replays one rank's
    gather = torch.where(width > 0, (mesh.replicate + 1) * width, 0)
    finish = torch.maximum(workspace, torch.where(spread, gather, 0))
    live, peak = torch.zeros_like(rows), torch.zeros_like(rows)
    for start, i in launch_order(buckets, settings.max_inflight):  # reads only `.axis`
        if start:
            live = live + buffers[i]
            peak = torch.maximum(peak, live)
        else:
            peak = torch.maximum(peak, live + finish[i])
            live = live - buffers[i]
    return RankScreen(flops, wire * itemsize, buffers * itemsize, state, peak * itemsize)


def _ns_numel(
    shapes: Mapping[tuple[int, int, int], int],
    gram: Mapping[int, NewtonSchulzSchedule],
    per_matrix: bool,
) -> int:
    """`ExchangePlan.ns_numel` of batches {(group, rows, cols): matrices}, in that order."""
    return ns_workspace_numel(
        [(count, rows, cols) for (_, rows, cols), count in shapes.items()],
        gram=[gram.get(group) for group, _, _ in shapes],
        per_matrix=per_matrix,
    )


def _representatives(screen: RankScreen) -> tuple[tuple[str, int], ...]:
    """The ranks the report shows, found from the screen: the most and fewest Newton-Schulz
    FLOPs, and as top-peak candidates the most state (offload's staging follows it), the
    largest Muon step transient, and the most of both (the peak without offload, less
    AdamW's and the torch path's momentum temporaries)."""
    return (
        ("most Newton-Schulz FLOPs", RankScreen.most(screen.flops)),
        ("fewest Newton-Schulz FLOPs", RankScreen.fewest(screen.flops)),
        ("most state", RankScreen.most(screen.state_bytes)),
        ("largest Muon step transient", RankScreen.most(screen.muon_transient_bytes)),
        (
            "most state + Muon step transient",
            RankScreen.most(screen.state_bytes + screen.muon_transient_bytes),
        ),
    )


def _planner(
    muon: Sequence[tuple[str, tuple[int, ...], tuple[int, ...], int]],
    mesh: MeshSpec,
    settings: StepSettings,
) -> Callable[[int], MuonPlan]:
    """The `MuonPlan` `Muon` builds at a global rank of `mesh`, built lazily and cached."""
    itemsize = settings.ns_dtype.itemsize
    gram = ()
    if settings.ns_algorithm == "gram":  # as `Muon._muon_plan` keys the groups forcing it
        schedule = SCHEDULES[settings.ns_schedule]
        gram = tuple((g, schedule) for g in sorted({g for _, _, _, g in muon}))
    layout = cache(mesh.layout)
    built: dict[tuple[int, ...], MuonPlan] = {}

    @cache
    def plan_of(rank: int) -> MuonPlan:
        if not 0 <= rank < mesh.world:
            raise ValueError(f"rank should be in [0, {mesh.world}) but is: {rank}")
        layouts = [layout(shape, blocks, g, rank) for _, shape, blocks, g in muon]
        # ranks holding as many experts of each exchanged stack share one owner assignment
        key = tuple(
            layout.local_shape()[0]
            for layout in layouts
            if layout.ndim == 3 and layout.exchange_axis is not None
        )
        if key in built:
            return built[key].seen_from(layouts)
        plan = built[key] = MuonPlan.build(
            layouts,
            settings.bucket_cap_bytes,
            itemsize,
            gram_schedules=gram,
            replica_owners={g: settings.replica_owners for _, _, _, g in muon},
            spread_model=SpreadModel(replica_bytes_per_s=settings.replica_bytes_per_s),
            ns_per_matrix=every_matrix_alone(settings.device),
        )
        return plan

    return plan_of


@dataclass(frozen=True, slots=True)
class ReplicaOwnersFigures:
    """One way of choosing owners under HSDP (`replica_owners`), over every rank."""

    replica_owners: str
    spread_buckets: int
    """Buckets whose owners spread over the replicas."""
    ns_flops_max: int
    """Newton-Schulz FLOPs (one iteration, as `RankEstimate.ns_flops`) on the busiest rank."""
    ns_s_max: float
    """Its Newton-Schulz seconds per step at `SpreadModel.ns_flops_per_s`, all iterations."""
    bytes_sent_max: int
    """Wire bytes per step on the rank that sends the most (replica gather included)."""


def compare_replica_owners(
    shapes: Sequence[ParamShape] | nn.Module,
    mesh: MeshSpec,
    settings: StepSettings | None = None,
    row_blocks: Mapping[str, Sequence[int]] | None = None,
) -> tuple[ReplicaOwnersFigures, ...]:
    """Per-rank Newton-Schulz work and bytes with `replica_owners` "spread" and
    "per_replica", from `screen_ranks` (no rank planned in full). "auto" decides per
    bucket on the bucket's busiest owner (its latency), so it spreads only buckets whose
    busiest owner gains: these totals over the step can favour spread more."""
    module, mesh, settings = _resolved(shapes, mesh, settings)
    muon, adamw, _ = _split(module, row_blocks)
    steps = SCHEDULES[settings.ns_schedule].steps
    figures = []
    for choice in ("spread", "per_replica"):
        chosen = replace(settings, replica_owners=choice)
        plan_of = _planner(muon, mesh, chosen)
        screen = screen_ranks(mesh, plan_of, adamw, chosen)
        flops = int(screen.flops.max())
        figures.append(
            ReplicaOwnersFigures(
                choice,
                sum(b.spread for b in plan_of(0).buckets),
                flops,
                flops * steps / DEFAULT_SPREAD_MODEL.ns_flops_per_s,
                int(screen.bytes_sent.sum(0).max()),
            )
        )
    return tuple(figures)


def estimate(
    shapes: Sequence[ParamShape] | nn.Module,
    mesh: MeshSpec,
    settings: StepSettings | None = None,
    row_blocks: Mapping[str, Sequence[int]] | None = None,
    ranks: Iterable[int] = (),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    fsdp_modules: Collection[str] = (),
) -> ModelEstimate:
    """Estimate a model (shapes or a live module) on `mesh`: every rank of one replica
    screened, the representative ranks (`ModelEstimate.picked`) and `ranks` planned in full.

    `fsdp_modules`: the names of the modules the run gives `fully_shard` ("" the root;
    a live module's own FSDP2 modules count too). With forward overlap the offloaded
    step's chunks follow the forward's first use of each unit, as `CPUOffloadOptimizer`
    orders them, and that depends on the wrap.

    `row_blocks`: as `muon_param_groups` takes them, which adds the module's own
    declarations (`model_row_blocks`; shapes' `row_blocks`).

    Raises `PlanTooLarge` (a ValueError) when planning passes `time_limit_s` seconds.
    """
    if not isinstance(shapes, nn.Module):
        shapes = tuple(shapes)  # any iterable of shapes, counted and read once
    count = sum(1 for _ in shapes.parameters()) if isinstance(shapes, nn.Module) else len(shapes)
    deadline = _Deadline(mesh, time_limit_s, count)
    module, mesh, settings = _resolved(
        shapes, mesh, settings, lambda: deadline.check("building the model")
    )
    deadline.check("building the model")
    # Grouping, the longest part for a model of very many params, has no check inside: a
    # limit may be passed by as long as it takes.
    muon, adamw, params = _split(module, row_blocks)
    deadline.check("grouping the params")
    plan_of = _planner(muon, mesh, settings)
    screen = screen_ranks(mesh, plan_of, adamw, settings, deadline)
    picked = _representatives(screen)
    planned = []
    forward_use = _forward_use(module, params, fsdp_modules)
    for rank in sorted({r for _, r in picked} | set(ranks)):
        deadline.check(f"planning rank {rank}")
        plan = plan_of(rank)
        planned.append(_rank(plan, plan.layouts, adamw, mesh, settings, rank, forward_use))
    first = plan_of(0)
    padded = tuple(padded_alternative(first, b) for b in range(len(first.buckets)))
    names = tuple(name for name, _, _, _ in muon)
    return ModelEstimate(
        mesh,
        settings,
        names,
        screen,
        tuple(planned),
        picked,
        padded,
        plan_of,
        forward_use.param_names,
    )


Units = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _ForwardUse:
    """What an overlapped `CPUOffloadOptimizer` plans from the model's modules."""

    order: Callable[[Units], Units]
    """Units (param indices, as `RankEstimate.units`) in the forward's order of first use
    (`in_forward_order` over `param_owners`)."""
    first_wait: tuple[int, ...]
    """The params the forward waits for first (`ForwardOverlap.first_wait`, without
    prefetches set by hand)."""
    param_names: tuple[str, ...]
    """By index."""


def _forward_use(
    module: nn.Module, params: Sequence[nn.Parameter], fsdp_modules: Collection[str]
) -> _ForwardUse:
    """`_ForwardUse` of `module` (its `params` by index, as `_split` numbers them) with the
    modules named in `fsdp_modules` as FSDP2 units."""
    named = {m: name for name, m in module.named_modules()}
    unknown = set(fsdp_modules) - set(named.values())
    if unknown:
        raise ValueError(f"fsdp_modules names modules the model does not have: {sorted(unknown)}")
    wrapped = set(fsdp_modules)

    def is_unit(m: nn.Module) -> bool:
        return named[m] in wrapped or is_fsdp_module(m)

    owners = param_owners(module, is_unit)

    def order(units: Units) -> Units:
        as_params = [[params[i] for i in unit] for unit in units]
        ranked = {id(unit): k for k, unit in enumerate(as_params)}
        return tuple(units[ranked[id(unit)]] for unit in in_forward_order(as_params, owners))

    name_of = {p: name for name, p in module.named_parameters()}
    names = tuple(name_of[p] for p in params)
    index = {p: i for i, p in enumerate(params)}
    for owner, _ in owners:
        first = tuple(index[p] for p in waited_params(owner, is_unit) if p in index)
        if first:
            return _ForwardUse(order, first, names)
    return _ForwardUse(order, (), names)


# Ranks with the same shard shapes get the same chunks; 64 ranks plan in well under a second.
_plan_offloaded_step = lru_cache(maxsize=16)(plan_offloaded_step)


def _rank(
    plan: MuonPlan,
    layouts: Sequence[ParamLayout],
    adamw: Sequence[tuple[int, tuple[int, ...]]],
    mesh: MeshSpec,
    settings: StepSettings,
    rank: int,
    forward_use: _ForwardUse,
) -> RankEstimate:
    local_shapes = [layout.local_shape() for layout in layouts]
    local = [math.prod(shape) for shape in local_shapes]
    loads = tuple(
        BucketLoad.of(plan.exchange(b, frozenset(bucket.params)), rank)
        for b, bucket in enumerate(plan.buckets)
    )
    adamw_local = [math.prod(mesh.local_shape(shape, rank)) for _, shape in adamw]
    moment = settings.moment_dtype.itemsize
    muon_state = sum(local) * MOMENTUM_DTYPE.itemsize
    adamw_state = 2 * sum(adamw_local) * moment

    kinds = plan.step_units(len(adamw))
    units = tuple(
        tuple(plan.buckets[i].params)
        if what == "bucket"
        else (i,)
        if what == "local"
        else (len(layouts) + i,)
        for what, i in kinds
    )
    # As `CPUOffloadOptimizer._specs_of` describes a param to the step's plan: Muon's
    # step cannot slice, so no unit is splittable.
    specs = [
        ParamSpec(
            math.prod(layout.shape) // _shards(layout),
            (StateSpec("momentum_buffer", torch.Size(shape), MOMENTUM_DTYPE),),
        )
        for layout, shape in zip(layouts, local_shapes, strict=True)
    ] + [
        ParamSpec(
            math.prod(shape) // mesh.fsdp,
            tuple(
                StateSpec(k, torch.Size(mesh.local_shape(shape, rank)), settings.moment_dtype)
                for k in ("exp_avg", "exp_avg_sq")
            ),
        )
        for _, shape in adamw
    ]

    def step_transient(chosen: Sequence[int]) -> Transient:
        """`MuonStep.step_params` over these units: its launches, then AdamW per group."""
        picked = [kinds[u] for u in sorted(chosen)]
        muon = launches_transient(plan, picked, settings)
        groups: dict[int, list[int]] = {}
        for what, k in picked:
            if what == "adamw":
                groups.setdefault(adamw[k][0], []).append(adamw_local[k] * moment)
        return _larger(muon, adamw_transient(groups, settings.device))

    # As the wrapper plans (`step_plan`): overlap orders the units as the forward reads them.
    load_bytes = settings.offload_backward_load_bytes
    overlap = settings.offload_overlap_forward or bool(load_bytes)
    backward = None
    if overlap and load_bytes is None:
        backward = BackwardLoads(
            first_wait=forward_use.first_wait, most=settings.offload_gpu_budget_bytes
        )
    elif load_bytes:
        backward = BackwardLoads(budget=load_bytes)
    step = _plan_offloaded_step(
        forward_use.order(units) if overlap else units,
        tuple(specs),
        chunk_bytes=settings.offload_chunk_bytes,
        staging_slots=settings.offload_slots,
        resident_bytes=settings.offload_resident_bytes,
        overlap=overlap,
        backward=backward,
    )
    offload, schedule = step.plan, step.schedule
    unit_of = {param: u for u, unit in enumerate(units) for param in unit}
    offload_transient = Transient()
    # The chunks ready at the step's start update in runs of several, the others one a
    # call, as the wrapper's executor runs them (its state all created: a steady step).
    ready = schedule.ready
    runs = [
        [ready[i] for i in run]
        for run in update_runs(
            [offload.chunks[c].params for c in ready],
            [False] * len(ready),
            [offload.chunks[c].invariant_bytes for c in ready],
            [offload.chunks[c].resident for c in ready],
            slices_together=False,  # `MuonStep` slices no param
        )
    ]
    runs += [[c] for c in sorted(set(range(len(offload.chunks))) - set(ready))]
    for run in runs:
        chosen = {unit_of[param] for c in run for param in offload.chunks[c].params}
        offload_transient = _larger(offload_transient, step_transient(sorted(chosen)))
    return RankEstimate(
        rank=rank,
        loads=loads,
        muon_state_bytes=muon_state,
        adamw_state_bytes=adamw_state,
        units=units,
        no_offload=StepMemory(muon_state + adamw_state, 0, step_transient(range(len(units)))),
        offload=StepMemory(
            offload.resident_bytes,
            step.held_bytes - offload.resident_bytes,
            offload_transient,
        ),
        offload_plan=offload,
        offload_schedule=schedule,
    )
