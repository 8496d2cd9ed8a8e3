"""The Muon plan before the run: buckets, owners, bytes and peak memory per rank.

    python -m muon.plan --preset qwen3-30b-a3b --fsdp 64 --ep 8
    python -m muon.plan --config config.json --fsdp 32 --replicate 4 --offload --json
    python -m muon.plan --preset qwen3-8b --sweep-fsdp 8,16,32,64

The plan is the optimizer's own: params are grouped by `muon_param_groups`,
each rank's `ParamLayout`s are what `Muon` derives from the DTensors of the
mesh described by `MeshSpec`, and `MuonPlan` assigns buckets and owners. Per
bucket the table shows the busiest and the idlest rank with `ExchangePlan`'s
numbers, under `BucketMetrics`' field names, so a run's `Muon.metrics` can be
held against it.

Memory of the step, per rank (what `Muon.step` allocates, in order):
- state (persistent): fp32 momentum of the local shards, AdamW's two moments;
- exchange buffers (allocated on the first step, then held): `max_inflight`
  slots of (send, receive, full matrices), each at the largest bucket;
- transient: per bucket, the momentum step's fp32 results (Nesterov) while it
  packs (none with the fused kernel on CUDA), then Newton-Schulz's temporaries
  (`ExchangePlan.ns_numel`); after the buckets, AdamW's foreach
  `sqrt(exp_avg_sq)` copy of its group.
The step's peak is buffers + the largest transient; `torch.cuda.max_memory_allocated`
around a step, minus what was allocated before it (buffers not counted), measures it.

Every rank's totals come from the owners in closed form (no pieces are built),
so a 64-rank plan takes well under a second; the per-bucket table builds the
real `ExchangePlan` for the two ranks it shows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from muon.model_shapes import (
    PRESETS,
    ParamShape,
    from_config,
    from_preset,
    load_config,
    meta_module,
)
from muon.newton_schulz import ns_flops
from muon.optimizer import DEFAULT_MAX_INFLIGHT
from muon.param_groups import muon_param_groups
from muon.planning import (
    DEFAULT_BUCKET_CAP_BYTES,
    ExchangePlan,
    MuonPlan,
    ParamLayout,
    chunk_range,
    ns_workspace_numel,
)

EXPERT_SHARDS = ("auto", "experts", "rows")
# offload.CPUOffloadOptimizer's defaults (muon must not import offload): GPU state
# with offload is `staging_slots` chunks of about `chunk_bytes` (a larger unit alone).
OFFLOAD_CHUNK_BYTES = 256 * 2**20
OFFLOAD_STAGING_SLOTS = 4
MOMENTUM_ITEMSIZE = 4  # Muon keeps fp32 momentum whatever the param dtype
# `ExchangeBuffers` allocates each of these at its largest bucket, per in-flight slot.
BUFFER_FIELDS = ("send_numel", "recv_numel", "full_numel")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """The device mesh as FSDP2 (+ HSDP, + EP) lays params out, torchtitan style.

    Dense params: Shard(0) over `fsdp` ranks (mesh (replicate, fsdp) for HSDP).
    Expert stacks (E, out, in): Shard(0) over `ep`, then over the `fsdp // ep`
    ranks of each EP group on the expert dim ("experts": whole matrices, no
    exchange) or on rows ("rows": exchanged); "auto" takes rows only when the
    experts are fewer than `fsdp` (torchtitan's rule). Global rank r of a replica
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

    def _axes(self, sizes: tuple[int, ...], dims: tuple[int | None, ...], coord: tuple[int, ...]):
        if self.replicate == 1:
            return sizes, dims, coord
        return (self.replicate, *sizes), (None, *dims), (0, *coord)

    def layout(self, shape: tuple[int, ...], row_blocks: Sequence[int], group: int, rank: int):
        """The `ParamLayout` `Muon` derives for a Muon param at fsdp index `rank`."""
        if len(shape) == 3:
            rows = self.expert_shard == "rows" or (
                self.expert_shard == "auto" and shape[0] < self.fsdp
            )
            dim = 1 if rows else 0
            if self.ep > 1:
                inner = self.fsdp // self.ep
                axes = self._axes((self.ep, inner), (0, dim), (rank // inner, rank % inner))
                return ParamLayout(shape, tuple(row_blocks), *axes, "experts", group)
            axes = self._axes((self.fsdp,), (dim,), (rank,))
            return ParamLayout(shape, tuple(row_blocks), *axes, "dense", group)
        axes = self._axes((self.fsdp,), (0,), (rank,))
        return ParamLayout(shape, tuple(row_blocks), *axes, "dense", group)

    def local_numel(self, shape: tuple[int, ...], rank: int) -> int:
        """Elements of a dense (AdamW) param's Shard(0) shard at fsdp index `rank`."""
        start, stop = chunk_range(shape[0], self.fsdp, rank)
        return (stop - start) * math.prod(shape[1:])


@dataclass(frozen=True, slots=True)
class StepSettings:
    """Muon's bucket and dtype settings, and the offload wrapper's, as the run will use them."""

    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    ns_itemsize: int = 2
    """Bytes per element on the wire and in Newton-Schulz (bf16: 2)."""
    param_itemsize: int = 4
    """Bytes per element of params and grads (and so of AdamW's moments)."""
    nesterov: bool = True
    fused_elementwise: bool = True
    """The fused momentum kernel (`muon.elementwise`, chosen on CUDA with Triton) writes the
    Newton-Schulz input straight into the exchange buffers; the torch path (CPU) keeps
    fp32 results alive while it packs."""
    offload_chunk_bytes: int = OFFLOAD_CHUNK_BYTES
    offload_slots: int = OFFLOAD_STAGING_SLOTS

    def __post_init__(self) -> None:
        if self.bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes should be > 0 but is: {self.bucket_cap_bytes}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight should be >= 1 but is: {self.max_inflight}")


@dataclass(frozen=True, slots=True)
class BucketLoad:
    """One bucket on one rank, with every param active: `ExchangePlan`'s totals."""

    bucket: int
    rank: int
    matrices: int
    owned: int
    bytes_sent: int
    bytes_received: int
    workspace_bytes: int
    """Send + receive + full views and Newton-Schulz temporaries (= `ExchangePlan`'s)."""
    send_numel: int
    recv_numel: int
    full_numel: int
    ns_numel: int
    momentum_bytes: int
    """fp32 momentum-step results alive while the bucket packs (Nesterov)."""
    ns_flops: int


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Optimizer memory of one rank, in bytes."""

    rank: int
    state_bytes: int
    """Muon momentum + AdamW moments: on the GPU without offload, on the host with it."""
    offload_gpu_bytes: int
    """GPU staging for state with offload (at most `offload_slots` chunks)."""
    buffer_bytes: int
    muon_transient_bytes: int
    adamw_transient_bytes: int
    ns_flops: int
    bytes_sent: int
    """Bytes this rank puts on the wire in one step (all buckets)."""

    @property
    def step_peak_bytes(self) -> int:
        """Exchange buffers + the largest transient: what the step adds to params, grads, state."""
        return self.buffer_bytes + max(self.muon_transient_bytes, self.adamw_transient_bytes)


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


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """The plan of every rank of one replica (the replicas are identical)."""

    mesh: MeshSpec
    settings: StepSettings
    names: tuple[str, ...]
    """Muon params in the optimizer's order (`MuonPlan` indices)."""
    plans: tuple[MuonPlan, ...]
    """Per fsdp index, the `MuonPlan` `Muon` builds on that rank."""
    loads: tuple[tuple[BucketLoad, ...], ...]
    """Per rank, per bucket."""
    ranks: tuple[RankMemory, ...]
    padded: tuple[PaddedAlternative | None, ...]
    """Per bucket; None for a local bucket."""

    def exchange(self, rank: int, bucket: int) -> ExchangePlan:
        """The real `ExchangePlan` of `rank` for `bucket`, every param active."""
        plan = self.plans[rank]
        return plan.exchange(bucket, frozenset(plan.buckets[bucket].params))

    @property
    def busiest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: (r.step_peak_bytes, -r.rank))

    @property
    def idlest(self) -> RankMemory:
        return min(self.ranks, key=lambda r: (r.step_peak_bytes, -r.rank))

    @property
    def imbalance(self) -> float:
        """Max over mean of the ranks' Newton-Schulz FLOPs (1.0 is perfect)."""
        flops = [r.ns_flops for r in self.ranks]
        mean = sum(flops) / len(flops)
        return max(flops) / mean if mean else 1.0

    @property
    def padding_fraction(self) -> float:
        """Share of a padded all-to-all's matrix bytes that are zeros, over all buckets."""
        padded = sum(p.padded_bytes for p in self.padded if p is not None)
        zeros = sum(p.padding_bytes for p in self.padded if p is not None)
        return zeros / padded if padded else 0.0


def _split(
    module: nn.Module, row_blocks: Mapping[str, Sequence[int]] | None
) -> tuple[list[tuple[str, tuple[int, ...], tuple[int, ...], int]], list[tuple[int, ...]]]:
    """Muon params as (name, shape, row_blocks, group) in the optimizer's order, and the
    shapes of the AdamW params, as `muon_param_groups` groups them."""
    names = {id(p): name for name, p in module.named_parameters()}
    muon, adamw = [], []
    for index, group in enumerate(muon_param_groups(module, row_blocks=row_blocks)):
        for p in group["params"]:
            if group.get("algorithm") == "adamw":
                adamw.append(tuple(p.shape))
            else:
                blocks = tuple(group.get("row_blocks") or ())
                muon.append((names[id(p)], tuple(p.shape), blocks, index))
    return muon, adamw


def _momentum_bytes(numels: Sequence[int], settings: StepSettings) -> int:
    """Peak of the bucket's momentum step: results kept (Nesterov), a grad cast if not fp32."""
    if settings.fused_elementwise:
        return 0
    cast = settings.param_itemsize != MOMENTUM_ITEMSIZE
    alive = peak = 0
    for n in numels:  # params in index order, as `MuonStep._start` updates them
        result = n * MOMENTUM_ITEMSIZE if settings.nesterov else 0
        peak = max(peak, alive + result + (n * MOMENTUM_ITEMSIZE if cast else 0))
        alive += result
    return peak


def _bucket_loads(
    plan: MuonPlan,
    by_owner: Sequence[dict[int, list[int]]],
    local_numels: Sequence[int],
    rank: int,
    settings: StepSettings,
) -> tuple[BucketLoad, ...]:
    """Every bucket's `ExchangePlan` totals on one rank, from the owners (no pieces built)."""
    itemsize = plan.itemsize
    loads = []
    for b, bucket in enumerate(plan.buckets):
        local = [local_numels[i] for i in bucket.params]
        if bucket.axis is None:
            owned = list(range(len(plan.matrices[b])))
            send = 0
        else:
            me = plan.layouts[bucket.params[0]].coord[bucket.axis]
            owned = by_owner[b].get(me, [])
            send = sum(local)
        matrices = [plan.matrices[b][i] for i in owned]
        full = sum(m.rows * m.cols for m in matrices)
        recv = 0 if bucket.axis is None else full
        batches: dict[tuple[int, int, int], int] = {}  # (group, rows, cols), first seen first
        for m in matrices:
            key = (plan.layouts[m.param].group, m.rows, m.cols)
            batches[key] = batches.get(key, 0) + 1
        ns = ns_workspace_numel([(n, rows, cols) for (_, rows, cols), n in batches.items()])
        kept = 0  # elements of owned matrices this rank holds itself: no wire
        if bucket.axis is not None:
            for m in matrices:
                layout = plan.layouts[m.param]
                r0, r1 = layout.dim_range(layout.ndim - 2)
                c0, c1 = layout.dim_range(layout.ndim - 1)
                kept += max(0, min(r1, m.row0 + m.rows) - max(r0, m.row0)) * (c1 - c0)
        wire = (send + recv - 2 * kept) * itemsize
        loads.append(
            BucketLoad(
                bucket=b,
                rank=rank,
                matrices=len(plan.matrices[b]),
                owned=len(matrices),
                bytes_sent=wire,
                bytes_received=wire,
                workspace_bytes=(send + recv + full + ns) * itemsize,
                send_numel=send,
                recv_numel=recv,
                full_numel=full,
                ns_numel=ns,
                momentum_bytes=_momentum_bytes(local, settings),
                ns_flops=sum(ns_flops(m.rows, m.cols) for m in matrices),
            )
        )
    return tuple(loads)


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


def build_plan(
    shapes: Sequence[ParamShape] | nn.Module,
    mesh: MeshSpec,
    settings: StepSettings | None = None,
    row_blocks: Mapping[str, Sequence[int]] | None = None,
) -> ModelPlan:
    """Plan a model (shapes or a live module) on `mesh` for every rank of one replica."""
    settings = settings or StepSettings()
    module = shapes if isinstance(shapes, nn.Module) else meta_module(shapes)
    muon, adamw = _split(module, row_blocks)

    base: dict[tuple[int, ...], tuple[MuonPlan, list[dict[int, list[int]]]]] = {}
    plans, loads, ranks = [], [], []
    for rank in range(mesh.fsdp):
        layouts = [mesh.layout(shape, blocks, g, rank) for _, shape, blocks, g in muon]
        # ranks holding as many experts of each exchanged stack share one owner assignment
        key = tuple(
            layout.local_shape()[0]
            for layout in layouts
            if layout.ndim == 3 and layout.exchange_axis is not None
        )
        if key not in base:
            plan = MuonPlan.build(layouts, settings.bucket_cap_bytes, settings.ns_itemsize)
            by_owner = []
            for matrices in plan.matrices:
                owners: dict[int, list[int]] = {}
                for i, m in enumerate(matrices):
                    owners.setdefault(m.owner, []).append(i)
                by_owner.append(owners)
            base[key] = (plan, by_owner)
        else:
            plan = base[key][0].seen_from(layouts)
        local_numels = [math.prod(layout.local_shape()) for layout in layouts]
        mine = _bucket_loads(plan, base[key][1], local_numels, rank, settings)
        plans.append(plan)
        loads.append(mine)
        ranks.append(_rank_memory(plan, mine, local_numels, adamw, mesh, settings, rank))
    padded = tuple(padded_alternative(plans[0], b) for b in range(len(plans[0].buckets)))
    names = tuple(name for name, _, _, _ in muon)
    return ModelPlan(mesh, settings, names, tuple(plans), tuple(loads), tuple(ranks), padded)


def _rank_memory(
    plan: MuonPlan,
    loads: Sequence[BucketLoad],
    local_numels: Sequence[int],
    adamw: Sequence[tuple[int, ...]],
    mesh: MeshSpec,
    settings: StepSettings,
    rank: int,
) -> RankMemory:
    size = settings.ns_itemsize
    largest = [max((getattr(x, f) for x in loads), default=0) for f in BUFFER_FIELDS]
    momentum = [n * MOMENTUM_ITEMSIZE for n in local_numels]
    adamw_bytes = sum(mesh.local_numel(shape, rank) for shape in adamw) * settings.param_itemsize
    state = sum(momentum) + 2 * adamw_bytes
    # offload's units: each bucket's momentum, the AdamW group's two moments
    units = [sum(momentum[i] for i in bucket.params) for bucket in plan.buckets]
    chunk = min(state, max(settings.offload_chunk_bytes, 2 * adamw_bytes, *units))
    return RankMemory(
        rank=rank,
        state_bytes=state,
        offload_gpu_bytes=settings.offload_slots * chunk,
        buffer_bytes=settings.max_inflight * sum(largest) * size,
        muon_transient_bytes=max(
            (max(x.momentum_bytes, x.ns_numel * size) for x in loads), default=0
        ),
        adamw_transient_bytes=adamw_bytes,
        ns_flops=sum(x.ns_flops for x in loads),
        bytes_sent=sum(x.bytes_sent for x in loads),
    )


# -- report ----------------------------------------------------------------------------------------

LAYER = re.compile(r"layers\.(\d+)\.")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def _layers(names: Sequence[str]) -> str:
    found = sorted({int(m.group(1)) for name in names if (m := LAYER.search(name))})
    if not found:
        return "-"
    return str(found[0]) if found[0] == found[-1] else f"{found[0]}-{found[-1]}"


def _shapes(plan: MuonPlan, bucket: int) -> str:
    counts: dict[tuple[int, int], int] = {}
    for m in plan.matrices[bucket]:
        counts[(m.rows, m.cols)] = counts.get((m.rows, m.cols), 0) + 1
    parts = [f"{r}x{c}*{n}" for (r, c), n in counts.items()]
    return ",".join(parts[:3]) + (",..." if len(parts) > 3 else "")


def bucket_rows(plan: ModelPlan) -> list[dict[str, Any]]:
    """Per bucket: what it holds, and its busiest and idlest rank (`BucketMetrics` names)."""
    rows = []
    for b, bucket in enumerate(plan.plans[0].buckets):
        loads = [rank[b] for rank in plan.loads]
        busy = max(loads, key=lambda x: (x.workspace_bytes, -x.rank))
        idle = min(loads, key=lambda x: (x.workspace_bytes, -x.rank))
        sides = {}
        for side, load in (("busy", busy), ("idle", idle)):
            ex = plan.exchange(load.rank, b)  # the real plan, pieces and all
            sides[side] = {
                "rank": load.rank,
                "matrices": len(ex.matrices),
                "owned": ex.owned,
                "bytes_sent": ex.bytes_sent,
                "bytes_received": ex.bytes_received,
                "workspace_bytes": ex.workspace_bytes,
                "buffer_bytes": (ex.send_numel + ex.recv_numel + ex.full_numel) * ex.itemsize,
                "ns_bytes": ex.ns_numel * ex.itemsize,
                "send_splits": list(ex.send_splits),
                "recv_splits": list(ex.recv_splits),
            }
        padded = plan.padded[b]
        rows.append(
            {
                "bucket": b,
                "kind": "local" if bucket.axis is None else "exchange",
                "layers": _layers([plan.names[i] for i in bucket.params]),
                "params": len(bucket.params),
                "shapes": _shapes(plan.plans[busy.rank], b),
                "nbytes": bucket.nbytes,
                "owners": None if bucket.axis is None else len({x.rank for x in loads if x.owned}),
                "busy": sides["busy"],
                "idle": sides["idle"],
                "padded": None if padded is None else asdict(padded),
            }
        )
    return rows


def summary(plan: ModelPlan) -> dict[str, Any]:
    busy, idle = plan.busiest, plan.idlest
    return {
        "mesh": asdict(plan.mesh),
        "settings": asdict(plan.settings),
        "world": plan.mesh.world,
        "muon_params": len(plan.names),
        "buckets": len(plan.plans[0].buckets),
        "busy": {**asdict(busy), "step_peak_bytes": busy.step_peak_bytes},
        "idle": {**asdict(idle), "step_peak_bytes": idle.step_peak_bytes},
        "state_bytes_max": max(r.state_bytes for r in plan.ranks),
        "offload_gpu_bytes_max": max(r.offload_gpu_bytes for r in plan.ranks),
        "bytes_sent_max": max(r.bytes_sent for r in plan.ranks),
        "imbalance": plan.imbalance,
        "padded_wire_bytes": sum(p.wire_bytes for p in plan.padded if p is not None),
        "padded_buffer_bytes": plan.settings.max_inflight
        * max((p.buffer_bytes for p in plan.padded if p is not None), default=0),
        "padding_bytes": sum(p.padding_bytes for p in plan.padded if p is not None),
        "padding_fraction": plan.padding_fraction,
    }


def print_plan(plan: ModelPlan, rows: Sequence[dict[str, Any]], offload: bool) -> None:
    mesh = plan.mesh
    print(
        f"mesh: fsdp {mesh.fsdp} x replicate {mesh.replicate} (world {mesh.world}), ep {mesh.ep}, "
        f"experts sharded on {mesh.expert_shard}; bucket cap "
        f"{_mib(plan.settings.bucket_cap_bytes)} MiB, max_inflight {plan.settings.max_inflight}"
    )
    head = (
        f"{'bkt':>3} {'kind':<8} {'layers':>7} {'mats':>5} {'owners':>6} {'shapes':<34} "
        f"{'wire MiB':>9} {'buf busy':>9} {'buf idle':>9} {'NS busy':>8} {'NS idle':>8} "
        f"{'pad wire':>9}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        busy, idle, padded = row["busy"], row["idle"], row["padded"]
        print(
            f"{row['bucket']:>3} {row['kind']:<8} {row['layers']:>7} {busy['matrices']:>5} "
            f"{'-' if row['owners'] is None else row['owners']:>6} {row['shapes'][:34]:<34} "
            f"{_mib(busy['bytes_sent']):>9} "
            f"{_mib(busy['buffer_bytes']):>9} {_mib(idle['buffer_bytes']):>9} "
            f"{_mib(busy['ns_bytes']):>8} {_mib(idle['ns_bytes']):>8} "
            f"{'-' if padded is None else _mib(padded['wire_bytes']):>9}"
        )
    s = summary(plan)
    busy, idle = s["busy"], s["idle"]
    print("(MiB per rank; busy/idle: the rank with the most/least workspace in that bucket)")
    print()
    busiest, idlest = f"busiest (rank {busy['rank']})", f"idlest (rank {idle['rank']})"
    print(f"{'per rank (GiB)':<23} {busiest:>18} {idlest:>18}")
    for label, key in (
        ("exchange buffers", "buffer_bytes"),
        ("Muon transient", "muon_transient_bytes"),
        ("AdamW transient", "adamw_transient_bytes"),
        ("step peak", "step_peak_bytes"),
        ("optimizer state", "state_bytes"),
    ):
        print(f"  {label:<21} {_gib(busy[key]):>18} {_gib(idle[key]):>18}")
    if offload:
        print(
            f"  with offload: state on host {_gib(busy['state_bytes'])} GiB, on GPU "
            f"{_gib(busy['offload_gpu_bytes'])} GiB ({plan.settings.offload_slots} staging slots)"
        )
    print(
        f"wire per step: {_mib(s['bytes_sent_max'])} MiB max per rank; NS imbalance "
        f"(max/mean FLOPs) {s['imbalance']:.3f}"
    )
    print(
        f"padded all-to-all instead: {_mib(s['padded_wire_bytes'])} MiB wire per rank, "
        f"{_mib(s['padded_buffer_bytes'])} MiB buffers, {_mib(s['padding_bytes'])} MiB zeros "
        f"per rank ({100 * s['padding_fraction']:.1f}% of what it moves)"
    )


def sweep_rows(plans: Sequence[ModelPlan], budget_bytes: int | None) -> list[dict[str, Any]]:
    """One row per FSDP size; `best` marks the least padding waste (then imbalance, then
    memory) among the sizes whose busiest rank fits `budget_bytes`."""
    rows = []
    for plan in plans:
        busy = plan.busiest
        rows.append(
            {
                "fsdp": plan.mesh.fsdp,
                "world": plan.mesh.world,
                "state_bytes": max(r.state_bytes for r in plan.ranks),
                "step_peak_busy": busy.step_peak_bytes,
                "step_peak_idle": plan.idlest.step_peak_bytes,
                "bytes_sent": max(r.bytes_sent for r in plan.ranks),
                "imbalance": plan.imbalance,
                "padding_fraction": plan.padding_fraction,
                "fits": budget_bytes is None
                or busy.state_bytes + busy.step_peak_bytes <= budget_bytes,
                "best": False,
            }
        )
    fitting = [row for row in rows if row["fits"]]
    if fitting:
        best = min(
            fitting,
            key=lambda r: (
                round(r["padding_fraction"], 3),
                round(r["imbalance"], 3),
                r["state_bytes"] + r["step_peak_busy"],
            ),
        )
        best["best"] = True
    return rows


def print_sweep(rows: Sequence[dict[str, Any]]) -> None:
    head = (
        f"{'fsdp':>5} {'world':>6} {'state GiB':>10} {'peak busy':>10} {'peak idle':>10} "
        f"{'wire MiB':>9} {'imbalance':>9} {'pad waste':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['fsdp']:>5} {r['world']:>6} {_gib(r['state_bytes']):>10} "
            f"{_gib(r['step_peak_busy']):>10} {_gib(r['step_peak_idle']):>10} "
            f"{_mib(r['bytes_sent']):>9} {r['imbalance']:>9.3f} "
            f"{100 * r['padding_fraction']:>8.1f}%"
            + ("  <- best" if r["best"] else "")
            + ("" if r["fits"] else "  (over budget)")
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muon.plan",
        description="Muon's buckets, owners, bytes and peak step memory for a model and a mesh.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS))
    source.add_argument("--config", help="a Hugging Face config.json")
    p.add_argument("--fsdp", type=int, default=8, help="FSDP (shard) size")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicas")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --fsdp)")
    p.add_argument("--expert-shard", choices=EXPERT_SHARDS, default="auto")
    p.add_argument("--bucket-cap-mib", type=float, default=DEFAULT_BUCKET_CAP_BYTES / 2**20)
    p.add_argument("--max-inflight", type=int, default=DEFAULT_MAX_INFLIGHT)
    p.add_argument("--ns-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--fused-elementwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fused CUDA momentum kernel (default on CUDA with Triton; off on CPU)",
    )
    p.add_argument("--offload", action="store_true", help="show state on host vs GPU")
    p.add_argument("--offload-chunk-mib", type=float, default=OFFLOAD_CHUNK_BYTES / 2**20)
    p.add_argument("--offload-slots", type=int, default=OFFLOAD_STAGING_SLOTS)
    p.add_argument("--sweep-fsdp", help="comma-separated FSDP sizes, e.g. 8,16,32,64")
    p.add_argument("--budget-gib", type=float, help="per-rank budget for state + step peak")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shapes = from_preset(args.preset) if args.preset else from_config(load_config(args.config))
    settings = StepSettings(
        bucket_cap_bytes=int(args.bucket_cap_mib * 2**20),
        max_inflight=args.max_inflight,
        ns_itemsize=DTYPES[args.ns_dtype].itemsize,
        param_itemsize=DTYPES[args.param_dtype].itemsize,
        nesterov=args.nesterov,
        fused_elementwise=args.fused_elementwise,
        offload_chunk_bytes=int(args.offload_chunk_mib * 2**20),
        offload_slots=args.offload_slots,
    )
    try:
        if args.sweep_fsdp:
            sizes = [int(size) for size in args.sweep_fsdp.split(",")]
            plans = [
                build_plan(
                    shapes, MeshSpec(size, args.replicate, args.ep, args.expert_shard), settings
                )
                for size in sizes
            ]
            budget = None if args.budget_gib is None else int(args.budget_gib * 2**30)
            rows = sweep_rows(plans, budget)
            print(json.dumps({"sweep": rows}, indent=1)) if args.json else print_sweep(rows)
            return 0
        mesh = MeshSpec(args.fsdp, args.replicate, args.ep, args.expert_shard)
        plan = build_plan(shapes, mesh, settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = bucket_rows(plan)
    if args.json:
        print(json.dumps({"summary": summary(plan), "buckets": rows}, indent=1))
    else:
        print_plan(plan, rows, args.offload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
