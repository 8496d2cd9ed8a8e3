"""Pure planning for distributed Muon: logical matrices, buckets, owners, exchange splits.

Everything here is a function of shapes, mesh sizes and one rank's mesh
coordinate; nothing touches a tensor or a process group, so the same code
serves the optimizer (built once, cached) and an offline planner.

Vocabulary: a mesh *axis* is a dimension of a device mesh; a tensor *dim* is a
dimension of a tensor. A param of shape (out, in) or (E, out, in) holds
`row_blocks`-many logical matrices per leading index (a fused QKV has three).

Sharding (torch.chunk semantics, as FSDP2 / DTensor `Shard`): a dim of size n
over k shards gives ceil(n / k) to each rank in order; trailing ranks may be
short or empty. A param whose matrix dims (the last two) are sharded by one
mesh axis is *exchanged* over that axis: every logical matrix gets one owner
rank on the axis, which receives the other ranks' pieces, orthogonalizes the
whole matrix and sends each rank its piece of the result. A param whose matrix
dims are not sharded (plain tensors, replicated params, expert stacks sharded
only on the expert dim) is orthogonalized *locally*, with no communication.

Under HSDP (a mesh axis that replicates the param), a bucket may *spread* its owners
over replicas x exchange ranks (`MuonPlan.build`'s `replica_owners`): each matrix is
orthogonalized once, by a rank of one replica. Every rank packs all its pieces, in one
region per owner replica; its own replica's region makes the round trip over the
exchange axis, then a gather over the replica axis brings each rank the other
regions' results (`ExchangePlan.replica_splits`).

Worked example, 2 ranks on one axis, bucket = one (3, 4) matrix sharded Shard(0):
rank 0 holds rows [0, 2), rank 1 holds row [2, 3); the owner is rank 0. Rank 0
sends 8 elements to itself and receives 8 + 4 (splits send=[8, 0], recv=[8, 4]);
rank 1 sends [4, 0] and receives [0, 0]: it allocates no full matrix.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from muon.newton_schulz import (  # ns_flops and ns_workspace_numel re-exported for the planner
    NewtonSchulzSchedule,
    ns_flops,
    ns_workspace_numel,
)

_Plans = TypeVar("_Plans")  # what `MuonPlan._cached` keeps per set of stepping params

# Default cap on the bytes of full matrices a bucket holds on one exchange
# group (bf16): small enough to bound the workspace (512 MiB - 1 GiB
# per rank is the usual budget), large enough to batch many matrices per all-to-all.
DEFAULT_BUCKET_CAP_BYTES = 512 * 2**20
ACTIVE_SETS_KEPT = 4
"""`MuonPlan` keeps each bucket's exchange plans for this many latest sets of stepping
params."""
# Who orthogonalizes a matrix under HSDP (a group option of `Muon`): "spread" gives each
# matrix one owner over the whole mesh; "per_replica" one per replica, as plain FSDP
# over each replica; "auto" spreads a bucket where `SpreadModel` says it pays.
REPLICA_OWNERS = ("auto", "spread", "per_replica")


@dataclass(frozen=True, slots=True)
class SpreadModel:
    """The cost model "auto" uses to choose spread owners for a bucket under HSDP.

    Per bucket, on its busiest rank: per replica, Newton-Schulz over the replica's ranks;
    spread, Newton-Schulz over all ranks plus receiving the other replicas' results
    ((R - 1) / R of its share of the bucket) at `replica_bytes_per_s`. Spread also
    moves 1/R of the bytes within a replica; the model leaves that saving out. With
    the defaults spread pays where the busiest owner sheds whole matrices of about 1000
    rows or more; a bucket with fewer matrices than a replica has ranks gains little.
    """

    ns_flops_per_s: float = 400e12
    """Newton-Schulz throughput per rank, FLOP/s: below what `bench/newton_schulz.py`
    measures for large bf16 shapes, since smaller ones run slower; set it to yours."""
    replica_bytes_per_s: float = 25e9
    """Per-rank bandwidth between replicas (one 200 Gb/s inter-node link per GPU);
    set it to the cluster's."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix (torch's default schedule); owners are
    balanced on one iteration's FLOPs."""

    def spread_pays(
        self, per_replica_flops: int, spread_flops: int, bucket_bytes: int, shards: int,
        replicas: int,
    ) -> bool:  # fmt: skip
        """Whether the busiest rank finishes sooner with spread owners (FLOPs of one
        iteration, as owners are balanced)."""
        rate = self.ns_flops_per_s / self.ns_steps
        across = (replicas - 1) / replicas * bucket_bytes / shards
        return spread_flops / rate + across / self.replica_bytes_per_s < per_replica_flops / rate


DEFAULT_SPREAD_MODEL = SpreadModel()


def check_matrix_sharding(
    shape: Sequence[int], mesh_shape: Sequence[int], shard_dims: Sequence[int | None]
) -> None:
    """Refuse a param whose matrix dims (its last two) more than one mesh axis of size > 1
    shards (`shard_dims`: per mesh axis, the tensor dim it shards, or None): the planner
    cuts a matrix along one axis. An axis of size 1 shards nothing (its one index holds
    whole dims), whatever its placement."""
    cutting = [
        axis
        for axis, dim in enumerate(shard_dims)
        if dim is not None and dim >= len(shape) - 2 and mesh_shape[axis] > 1
    ]
    if len(cutting) > 1:
        raise ValueError(
            f"matrix dims of shape {tuple(shape)} sharded by more than one mesh axis of "
            f"size > 1 (tensor dims {tuple(shard_dims)} on mesh {tuple(mesh_shape)}); only "
            "one axis may shard a matrix dim: shard it over one axis (flatten those axes "
            "into one), or put it in an algorithm='adamw' group"
        )


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One param as one rank sees it: global shape and how a mesh shards it."""

    shape: tuple[int, ...]
    """Global shape, (out, in) or (E, out, in)."""
    row_blocks: tuple[int, ...] = ()
    """Rows of each logical matrix within `out` (fused QKV: (q, k, v)); () is one block."""
    mesh_shape: tuple[int, ...] = ()
    """Sizes of the mesh axes; () for a plain tensor."""
    shard_dims: tuple[int | None, ...] = ()
    """Per mesh axis: the tensor dim it shards (Shard(d)), or None (Replicate)."""
    coord: tuple[int, ...] = ()
    """This rank's coordinate on the mesh."""
    mesh_key: Hashable = None
    """Identifies the mesh; params on different meshes never share a bucket."""
    group: int = 0
    """Optimizer param group; only matrices of one group are orthogonalized in one batch."""

    def __post_init__(self) -> None:
        if len(self.shape) not in (2, 3):
            raise ValueError(f"Muon params must be 2-D or 3-D but got shape: {self.shape}")
        if self.row_blocks and sum(self.row_blocks) != self.shape[-2]:
            raise ValueError(f"row_blocks {self.row_blocks} must sum to the rows of {self.shape}")
        if not len(self.mesh_shape) == len(self.shard_dims) == len(self.coord):
            raise ValueError(
                f"mesh_shape {self.mesh_shape}, shard_dims {self.shard_dims} and coord "
                f"{self.coord} must have one entry per mesh axis"
            )
        check_matrix_sharding(self.shape, self.mesh_shape, self.shard_dims)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.row_blocks or (self.shape[-2],)

    @property
    def exchange_axis(self) -> int | None:
        """The mesh axis that shards a matrix dim, or None: orthogonalized locally.

        An axis of size 1 shards nothing: its one rank holds whole matrices.
        """
        for axis, dim in enumerate(self.shard_dims):
            if dim is not None and dim >= self.ndim - 2 and self.mesh_shape[axis] > 1:
                return axis
        return None

    @property
    def replica_axis(self) -> int | None:
        """The first mesh axis of size > 1 that replicates this param (HSDP's), or None."""
        for axis, dim in enumerate(self.shard_dims):
            if dim is None and self.mesh_shape[axis] > 1:
                return axis
        return None

    def dim_range(self, dim: int, coord: tuple[int, ...] | None = None) -> tuple[int, int]:
        """[start, stop) of tensor dim `dim` held at mesh coordinate `coord` (default: mine)."""
        coord = self.coord if coord is None else coord
        start, stop = 0, self.shape[dim]
        for axis, sharded in enumerate(self.shard_dims):
            if sharded == dim:  # nested shards chunk the previous chunk, as DTensor does
                start, stop = chunk_range(stop - start, self.mesh_shape[axis], coord[axis], start)
        return start, stop

    def holders(self, axis: int, dim: int, start: int, stop: int) -> range:
        """Indices on mesh `axis` whose part of matrix dim `dim` meets [start, stop), by
        torch.chunk's arithmetic (for `plan_exchange`'s receive side). Only one axis of
        size > 1 shards a matrix dim (one of size 1 keeps it whole), so `axis` cuts the
        whole dim."""
        if self.shard_dims[axis] != dim:
            return range(self.mesh_shape[axis])
        stop = min(stop, self.shape[dim])
        if stop <= start:
            return range(0)
        step = -(-self.shape[dim] // self.mesh_shape[axis])
        return range(start // step, -(-stop // step))

    def local_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in (self.dim_range(d) for d in range(self.ndim)))

    def peer_coord(self, axis: int, index: int) -> tuple[int, ...]:
        return self.coord[:axis] + (index,) + self.coord[axis + 1 :]

    def exchange_bytes(self, itemsize: int) -> int:
        """Bytes of full matrices this param puts on one exchange group (rank-invariant)."""
        shards = 1
        for axis, dim in enumerate(self.shard_dims):
            if dim is not None and axis != self.exchange_axis:
                shards *= self.mesh_shape[axis]
        return math.ceil(math.prod(self.shape) / shards) * itemsize


def chunk_range(size: int, chunks: int, index: int, base: int = 0) -> tuple[int, int]:
    """[start, stop) of chunk `index` when torch.chunk cuts `size` into `chunks` pieces."""
    step = -(-size // chunks)
    start = min(index * step, size)
    return base + start, base + min(start + step, size)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Params whose matrices are exchanged (or orthogonalized locally) together."""

    index: int
    params: tuple[int, ...]
    """Indices into the layouts, in layer order; a param is never split across buckets."""
    mesh_key: Hashable
    axis: int | None
    """Exchange mesh axis; None for a local bucket."""
    nbytes: int
    """Full-matrix bytes on one exchange group (rank-invariant; the byte cap applies to it)."""
    spread: bool = False
    """Owners spread over the replicas (`REPLICA_OWNERS`): each matrix is orthogonalized
    once over the whole mesh and its result shared across the replica axis."""


def plan_buckets(
    layouts: Sequence[ParamLayout],
    cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    itemsize: int = 2,
    replica_owners: Mapping[int, str] | None = None,
) -> tuple[Bucket, ...]:
    """Group params into buckets in layer order under `cap_bytes`, one open bucket per domain.

    A domain is (mesh, exchange axis, replica axis, and under HSDP the group's
    `replica_owners`, group -> `REPLICA_OWNERS`, default "per_replica"): a bucket's params
    exchange over one axis and are replicated (HSDP) over the same one or none, so whether
    the bucket spreads its owners over the replicas holds for all of them (an expert stack
    sharded over the axis that replicates a dense matrix shared a bucket with it, and took
    another expert's update), as their groups chose (a "spread" group beside a
    "per_replica" one ran per replica). A param larger than the cap gets a bucket of its
    own. Depends only on global shapes, mesh sizes and groups, so every rank builds the
    same buckets. Buckets are numbered by their first param.
    """
    replica_owners = replica_owners or {}
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap should be > 0 bytes but is: {cap_bytes}")
    Domain = tuple[Hashable, int | None, int | None, str | None]
    open_buckets: dict[Domain, tuple[list[int], int]] = {}
    closed: list[tuple[list[int], Domain, int]] = []
    for index, layout in enumerate(layouts):
        replicated = layout.replica_axis is not None and layout.exchange_axis is not None
        choice = replica_owners.get(layout.group, "per_replica") if replicated else None
        domain = (layout.mesh_key, layout.exchange_axis, layout.replica_axis, choice)
        nbytes = layout.exchange_bytes(itemsize)
        members, total = open_buckets.get(domain, ([], 0))
        if members and total + nbytes > cap_bytes:
            closed.append((members, domain, total))
            members, total = [], 0
        open_buckets[domain] = (members + [index], total + nbytes)
    closed.extend((members, domain, total) for domain, (members, total) in open_buckets.items())
    closed.sort(key=lambda entry: entry[0][0])
    return tuple(
        Bucket(i, tuple(members), key, axis, total)
        for i, (members, (key, axis, _, _), total) in enumerate(closed)
    )


def assign_owners(
    costs: Sequence[int], world: int, prior_load: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Greedy longest-processing-time owners: the costliest matrix first, to the least loaded rank.

    Ties: equal costs keep their input order; equal loads go to the rank with
    the least `prior_load` (work owned in earlier buckets), then the lowest rank.
    Deterministic, so every rank computes the same owners. A heap keyed by
    (load, prior, rank) pops exactly that rank: O(matrices log world + world).
    """
    prior = list(prior_load) if prior_load is not None else [0] * world
    heap = [(0, prior[rank], rank) for rank in range(world)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, before, rank = heap[0]
        owners[i] = rank
        heapq.heapreplace(heap, (load + costs[i], before, rank))
    return tuple(owners)


@dataclass(frozen=True, slots=True)
class Matrix:
    """A logical matrix: rows [row0, row0 + rows) of leading index `expert` of a param."""

    param: int
    expert: int
    """Index into this rank's local leading dim (0 for a 2-D param)."""
    row0: int
    rows: int
    cols: int
    owner: int
    """Owner's index on the exchange axis; this rank's own index for a local bucket."""
    replica: int | None = None
    """In a spread bucket, the owner's index on the replica axis; None: every replica
    orthogonalizes the matrix (its owner on the exchange axis of each replica)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangle of one matrix travelling between this rank and `peer`.

    `rows`/`cols` are [start, stop) in matrix coordinates; the sender holds it at
    local rows `local_row0 + ...` and local cols `local_col0 + ...` of leading index
    `Matrix.expert`. `offset` is the position in the send (or receive) buffer.
    """

    matrix: int
    peer: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    local_row0: int
    local_col0: int
    offset: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True, slots=True)
class Batch:
    """Same-shape matrices of one param group, contiguous in the full-matrix workspace."""

    matrices: tuple[int, ...]
    rows: int
    cols: int
    group: int
    offset: int


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """One rank's part of one bucket for one step's active params."""

    bucket: int
    axis: int | None
    params: tuple[int, ...]
    """The active params (momentum steps even for a shard with no matrix on this rank)."""
    matrices: tuple[Matrix, ...]
    """Every active logical matrix of the bucket on this rank's exchange group."""
    send_splits: tuple[int, ...]
    """Elements this rank sends to each peer (and receives back from it with the result)."""
    recv_splits: tuple[int, ...]
    """Elements this rank receives from each peer as owner (and sends back)."""
    send_pieces: tuple[Piece, ...]
    """This rank's pieces, in (owner, matrix) order: the forward send layout."""
    recv_pieces: tuple[Piece, ...]
    """Pieces of matrices this rank owns, in (sender, matrix) order: the receive layout."""
    batches: tuple[Batch, ...]
    """Owned matrices grouped by (group, rows, cols), laid out back to back."""
    me: int
    """This rank's index on the exchange axis (0 for a local bucket)."""
    itemsize: int
    gram_schedules: tuple[tuple[int, NewtonSchulzSchedule], ...] = ()
    """(group, schedule) of the param groups with `ns_algorithm="gram"`: their batches'
    workspace is Gram Newton-Schulz's. Other groups are modelled on the standard
    algorithm, which bounds "auto"'s Gram too: it takes Gram only where the long side
    is at least twice the short one, where Gram's workspace is no larger."""
    ns_per_matrix: bool = False
    """Newton-Schulz launches each matrix alone (the plain path on CPU, `ns_path`), so
    the workspace is one matrix's plus the batch's output."""
    replica_axis: int | None = None
    """A spread bucket's replica axis (`Bucket.spread`); None otherwise."""
    replica: int = 0
    """This rank's index on `replica_axis`."""
    replica_splits: tuple[int, ...] = ()
    """A spread bucket: elements of this rank's pieces of the matrices each replica owns,
    back to back in the send buffer by replica. This replica's region is exchanged over
    the exchange axis (`send_splits`); afterwards every region is shared across the
    replica axis, so each ends holding its pieces of the results."""

    @property
    def send_numel(self) -> int:
        """The send buffer: all this rank's pieces (in a spread bucket, every region)."""
        return sum(self.replica_splits) if self.replica_splits else sum(self.send_splits)

    @property
    def region(self) -> tuple[int, int]:
        """[start, stop) of the send buffer exchanged over the exchange axis."""
        start = sum(self.replica_splits[: self.replica])
        return start, start + sum(self.send_splits)

    @property
    def gather_numel(self) -> int:
        """Elements each replica contributes to the replica-axis gather (the largest region,
        so that every contribution has one size); 0 if nothing crosses replicas."""
        return max(self.replica_splits, default=0) if len(self.replica_splits) > 1 else 0

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_splits)

    @property
    def full_numel(self) -> int:
        return sum(len(b.matrices) * b.rows * b.cols for b in self.batches)

    @property
    def owned(self) -> int:
        return sum(len(b.matrices) for b in self.batches)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank puts on the wire: its pieces out, then owned results back.

        Self-sends are excluded. Each piece makes a round trip, so a rank
        receives exactly as many bytes as it sends.
        """
        pairs = enumerate(zip(self.send_splits, self.recv_splits, strict=True))
        wire = sum(sent + received for peer, (sent, received) in pairs if peer != self.me)
        # a spread bucket's gather: this rank's region to each other replica, theirs back
        wire += (len(self.replica_splits) - 1) * self.gather_numel if self.replica_splits else 0
        return wire * self.itemsize

    @property
    def bytes_received(self) -> int:
        return self.bytes_sent

    @property
    def ns_numel(self) -> int:
        """Peak elements `zeropower` allocates on top of the buffers (see `ns_workspace_numel`)."""
        gram = dict(self.gram_schedules)
        return ns_workspace_numel(
            [(len(b.matrices), b.rows, b.cols) for b in self.batches],
            gram=[gram.get(b.group) for b in self.batches],
            per_matrix=self.ns_per_matrix,
        )

    @property
    def gather_buffers_numel(self) -> int:
        """The replica gather's input and output (one `gather_numel` per replica)."""
        return (len(self.replica_splits) + 1) * self.gather_numel if self.gather_numel else 0

    @property
    def finish_numel(self) -> int:
        """Peak elements on top of the buffers while the bucket finishes: Newton-Schulz's
        workspace, then (a spread bucket) the replica gather's buffers."""
        return max(self.ns_numel, self.gather_buffers_numel)

    @property
    def workspace_bytes(self) -> int:
        """Peak bytes this bucket needs on this rank: its buffers plus `finish_numel`."""
        buffers = self.send_numel + self.recv_numel + self.full_numel
        return (buffers + self.finish_numel) * self.itemsize


def launch_order(plans: Sequence[ExchangePlan], max_inflight: int) -> Iterator[tuple[bool, int]]:
    """The step's schedule over `plans` (bucket order): (True, i) starts plan i, (False, i)
    finishes it.

    An exchanged bucket starts (momentum, pack, exchange) up to `max_inflight - 1`
    buckets before it finishes (Newton-Schulz, return, apply), so its exchange
    overlaps the earlier buckets' Newton-Schulz; a local one has nothing to overlap
    and finishes as soon as it starts. Every rank walks the exchanged buckets in
    the same order, so their collectives match.
    """
    alive: list[int] = []
    for i, plan in enumerate(plans):
        if plan.axis is None:
            yield True, i
            yield False, i
            continue
        if len(alive) == max_inflight:
            yield False, alive.pop(0)
        alive.append(i)
        yield True, i
    for i in alive:
        yield False, i


def buffer_timeline(
    plans: Sequence[ExchangePlan], max_inflight: int
) -> Iterator[tuple[bool, ExchangePlan, int]]:
    """The step's buffers over `launch_order`: (start, plan, elements alive) at each
    start (its own send, receive and full buffers just allocated) and each finish
    (before they go; its `finish_numel` comes on top). The one
    replay of the step's memory: `transient_peak_numel` and the planner's estimate
    both read it."""
    live = 0
    for start, i in launch_order(plans, max_inflight):
        plan = plans[i]
        buffers = plan.send_numel + plan.recv_numel + plan.full_numel
        if start:
            live += buffers
            yield True, plan, live
        else:
            yield False, plan, live
            live -= buffers


def transient_peak_numel(plans: Sequence[ExchangePlan], max_inflight: int) -> int:
    """Peak elements (in ns_dtype) of buffers and Newton-Schulz workspace the step holds
    for `plans` (`buffer_timeline`)."""
    return max(
        (
            live + (0 if start else plan.finish_numel)
            for start, plan, live in buffer_timeline(plans, max_inflight)
        ),
        default=0,
    )


def bucket_matrices(
    layouts: Sequence[ParamLayout], bucket: Bucket, owner: int = -1
) -> list[Matrix]:
    """The logical matrices of a bucket on this rank's exchange group, all given `owner`."""
    matrices = []
    for index in bucket.params:
        layout = layouts[index]
        experts = layout.local_shape()[0] if layout.ndim == 3 else 1
        cols = layout.shape[-1]
        for expert in range(experts):
            row0 = 0
            for rows in layout.blocks:
                matrices.append(Matrix(index, expert, row0, rows, cols, owner))
                row0 += rows
    return matrices


@dataclass(frozen=True, slots=True)
class MuonPlan:
    """Buckets and owners for all Muon params, built once; exchange plans cached per step mask."""

    layouts: tuple[ParamLayout, ...]
    buckets: tuple[Bucket, ...]
    matrices: tuple[tuple[Matrix, ...], ...]
    """Per bucket, its matrices with owners, in bucket order."""
    itemsize: int
    cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    gram_schedules: tuple[tuple[int, NewtonSchulzSchedule], ...] = ()
    """`ExchangePlan.gram_schedules` of every exchange plan."""
    ns_per_matrix: bool = False
    """`ExchangePlan.ns_per_matrix` of every exchange plan."""
    # Per bucket (per local params), its plans by the set of params stepping (`_cached`).
    _exchanges: dict[int, OrderedDict[frozenset[int], ExchangePlan]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    _locals: dict[tuple[int, ...], OrderedDict[frozenset[int], tuple[ExchangePlan, ...]]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @classmethod
    def build(
        cls,
        layouts: Sequence[ParamLayout],
        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        itemsize: int = 2,
        cost_fn: Callable[[int, int], int] = ns_flops,
        gram_schedules: tuple[tuple[int, NewtonSchulzSchedule], ...] = (),
        replica_owners: Mapping[int, str] | None = None,
        spread_model: SpreadModel = DEFAULT_SPREAD_MODEL,
        ns_per_matrix: bool = False,
    ) -> MuonPlan:
        """Plan buckets, then owners bucket by bucket, balancing `cost_fn(rows, cols)`.

        Owners are balanced within each bucket (its latency is its busiest
        owner), ties broken by the load owned in earlier buckets of the same
        domain so that remainders rotate over the ranks.

        Under HSDP (a replica axis), `replica_owners` (group -> `REPLICA_OWNERS`, default
        "per_replica") decides per bucket (a bucket's groups chose alike,
        `plan_buckets`): "spread" spreads, "per_replica" does not, "auto" asks
        `spread_model`. Local buckets (matrices whole on each rank: a shard axis of one,
        experts sharded by expert) run on every replica. A spread bucket's owners
        are balanced over replicas x exchange ranks (flat index owner * replicas + replica,
        so that ties alternate replicas); every rank decides alike from global shapes.
        """
        layouts = tuple(layouts)
        replica_owners = replica_owners or {}
        buckets = list(plan_buckets(layouts, cap_bytes, itemsize, replica_owners))
        prior: dict[tuple[Hashable, int | None, int], list[int]] = {}
        planned = []
        for index, bucket in enumerate(buckets):
            if bucket.axis is None:  # this rank's own matrices; it is their owner
                planned.append(tuple(bucket_matrices(layouts, bucket, owner=0)))
                continue
            matrices = bucket_matrices(layouts, bucket)
            first = layouts[bucket.params[0]]
            world = first.mesh_shape[bucket.axis]
            costs = [cost_fn(m.rows, m.cols) for m in matrices]
            replicas = 1 if first.replica_axis is None else first.mesh_shape[first.replica_axis]
            choices = {replica_owners.get(layouts[i].group, "per_replica") for i in bucket.params}
            spread = replicas > 1 and "per_replica" not in choices
            if spread and choices != {"spread"}:  # "auto": the busiest rank either way
                spread = spread_model.spread_pays(
                    _busiest(costs, world), _busiest(costs, world * replicas),
                    bucket.nbytes, world, replicas,
                )  # fmt: skip
            ranks = world * replicas if spread else world
            load = prior.setdefault((bucket.mesh_key, bucket.axis, ranks), [0] * ranks)
            owners = assign_owners(costs, ranks, load)
            for owner, cost in zip(owners, costs, strict=True):
                load[owner] += cost
            if spread:
                buckets[index] = dataclasses.replace(bucket, spread=True)
            planned.append(
                tuple(
                    Matrix(m.param, m.expert, m.row0, m.rows, m.cols, o // replicas, o % replicas)
                    if spread
                    else Matrix(m.param, m.expert, m.row0, m.rows, m.cols, o)
                    for m, o in zip(matrices, owners, strict=True)
                )
            )
        return cls(
            layouts,
            tuple(buckets),
            tuple(planned),
            itemsize,
            cap_bytes,
            gram_schedules,
            ns_per_matrix,
        )

    def seen_from(self, layouts: Sequence[ParamLayout]) -> MuonPlan:
        """This plan on the rank whose layouts (same params, other coordinates) are `layouts`.

        Equal to `MuonPlan.build(layouts, ...)` with this plan's settings, without
        redoing the owner assignment: buckets, and owners of exchanged matrices
        where the rank holds as many experts of each exchanged stack (checked), do
        not depend on the rank; only local buckets (its own experts) are recomputed.
        """
        layouts = tuple(layouts)
        for mine, theirs in zip(self.layouts, layouts, strict=True):
            if mine.ndim == 3 and mine.exchange_axis is not None:
                if mine.local_shape()[0] != theirs.local_shape()[0]:
                    raise ValueError(
                        f"a rank holding {theirs.local_shape()[0]} experts of {theirs.shape} "
                        f"exchanges other matrices than one holding {mine.local_shape()[0]}"
                    )
        matrices = tuple(
            tuple(bucket_matrices(layouts, bucket, owner=0)) if bucket.axis is None else planned
            for bucket, planned in zip(self.buckets, self.matrices, strict=True)
        )
        return MuonPlan(
            layouts,
            self.buckets,
            matrices,
            self.itemsize,
            self.cap_bytes,
            self.gram_schedules,
            self.ns_per_matrix,
        )

    @staticmethod
    def _cached(
        plans: OrderedDict[frozenset[int], _Plans],
        active: frozenset[int],
        build: Callable[[], _Plans],
    ) -> _Plans:
        """`plans`' entry for `active`, built if missing; the `ACTIVE_SETS_KEPT` latest
        kept. A run whose grad-less params change every step (LayerDrop, experts that got
        no tokens) grew the caches without end, where Muon holds its state and nothing
        else; each bucket keeps its own latest, as each step asks every bucket once."""
        plan = plans.get(active)
        if plan is None:
            plan = plans[active] = build()
            if len(plans) > ACTIVE_SETS_KEPT:
                plans.popitem(last=False)
        else:
            plans.move_to_end(active)
        return plan

    def exchange(self, bucket: int, active: frozenset[int]) -> ExchangePlan:
        """This rank's exchange plan for `bucket` when only params in `active` step."""
        return self._cached(
            self._exchanges.setdefault(bucket, OrderedDict()),
            active,
            lambda: plan_exchange(
                self.layouts,
                self.buckets[bucket],
                self.matrices[bucket],
                active,
                self.itemsize,
                self.gram_schedules,
                self.ns_per_matrix,
            ),
        )

    def local_exchanges(
        self, params: Sequence[int], active: frozenset[int]
    ) -> tuple[ExchangePlan, ...]:
        """Launches for local (unexchanged) `params`, in layer order, when `active` step.

        The params are cut into buckets under the cap as `plan_buckets` cuts them,
        so all local params give this plan's local buckets, and a subset (an
        offload chunk) batches its same-shape matrices whatever buckets they came
        from. Each launch is numbered by the plan bucket of its first param.
        """
        params = tuple(params)
        return self._cached(
            self._locals.setdefault(params, OrderedDict()),
            active,
            lambda: self._plan_locals(params, active),
        )

    def _plan_locals(
        self, params: tuple[int, ...], active: frozenset[int]
    ) -> tuple[ExchangePlan, ...]:
        bucket_of = {i: b.index for b in self.buckets for i in b.params}
        plans = []
        for cut in plan_buckets([self.layouts[i] for i in params], self.cap_bytes, self.itemsize):
            members = tuple(params[j] for j in cut.params)
            if cut.axis is not None:
                raise ValueError(f"params {members} are exchanged, not local")
            bucket = Bucket(bucket_of[members[0]], members, cut.mesh_key, None, cut.nbytes)
            matrices = bucket_matrices(self.layouts, bucket, owner=0)
            plans.append(
                plan_exchange(
                    self.layouts,
                    bucket,
                    matrices,
                    active,
                    self.itemsize,
                    self.gram_schedules,
                    self.ns_per_matrix,
                )
            )
        return tuple(plans)

    def step_units(self, adamw_params: int) -> tuple[tuple[str, int], ...]:
        """A step's units (`MuonStep.units`), identical on every rank, in order:
        ("bucket", b) for each exchanged bucket, ("local", i) for each param of a local
        bucket, ("adamw", k) for each of `adamw_params` AdamW params.

        Local params are listed by matrix shape: an offload chunk of consecutive
        units then holds few shapes and makes few, large Newton-Schulz launches
        (forward overlap orders units by the forward instead).
        """
        local = [i for bucket in self.buckets if bucket.axis is None for i in bucket.params]
        local.sort(key=lambda i: (self.layouts[i].blocks, self.layouts[i].shape[-1]))
        units = [("bucket", b.index) for b in self.buckets if b.axis is not None]
        units += [("local", i) for i in local]
        units += [("adamw", k) for k in range(adamw_params)]
        return tuple(units)

    def step_plans(
        self, buckets: Sequence[int], local: Sequence[int], active: frozenset[int]
    ) -> list[ExchangePlan]:
        """The launches of a step over exchanged `buckets` and `local` params when the
        params in `active` step, in bucket order (every rank finishes bucket k at the
        same point, so the collectives stay in order)."""
        plans = [self.exchange(b, active & frozenset(self.buckets[b].params)) for b in buckets]
        if local:
            plans += self.local_exchanges(sorted(local), active & frozenset(local))
        plans.sort(key=lambda plan: plan.bucket)
        return plans

    def buffer_numels(self, bucket_indices: Sequence[int]) -> tuple[int, int, int]:
        """Largest (send, receive, full) element counts over buckets with every param active."""
        sizes = [(0, 0, 0)]
        for index in bucket_indices:
            plan = self.exchange(index, frozenset(self.buckets[index].params))
            sizes.append((plan.send_numel, plan.recv_numel, plan.full_numel))
        return tuple(max(column) for column in zip(*sizes, strict=True))


def _busiest(costs: Sequence[int], world: int) -> int:
    """The most work one of `world` owners gets from `assign_owners`."""
    load = [0] * world
    for cost, owner in zip(costs, assign_owners(costs, world), strict=True):
        load[owner] += cost
    return max(load, default=0)


def _piece(
    layout: ParamLayout, matrix: Matrix, coord: tuple[int, ...]
) -> tuple[int, int, int, int, int, int] | None:
    """Rows, cols (matrix coordinates) and local row/col origin of `matrix`'s part at `coord`."""
    row_dim, col_dim = layout.ndim - 2, layout.ndim - 1
    held_rows = layout.dim_range(row_dim, coord)
    held_cols = layout.dim_range(col_dim, coord)
    r0 = max(held_rows[0], matrix.row0)
    r1 = min(held_rows[1], matrix.row0 + matrix.rows)
    if r1 <= r0 or held_cols[1] <= held_cols[0]:
        return None
    return r0 - matrix.row0, r1 - matrix.row0, held_cols[0], held_cols[1], r0 - held_rows[0], 0


def held_numel(layout: ParamLayout, matrix: Matrix, coord: tuple[int, ...]) -> int:
    """Elements of `matrix` the rank at `coord` holds (its piece in `plan_exchange`)."""
    geometry = _piece(layout, matrix, coord)
    if geometry is None:
        return 0
    r0, r1, c0, c1, _, _ = geometry
    return (r1 - r0) * (c1 - c0)


def _lay_out(
    layouts: Sequence[ParamLayout],
    matrices: Sequence[Matrix],
    world: int,
    order: Iterable[tuple[int, int, tuple[int, ...]]],
    offset: int = 0,
) -> tuple[tuple[Piece, ...], tuple[int, ...]]:
    """Pieces packed back to back from `offset` for (peer, matrix, coord of the holder) in
    `order`, and the elements each peer's range holds (the all-to-all split sizes)."""
    pieces: list[Piece] = []
    splits = [0] * world
    for peer, i, coord in order:
        m = matrices[i]
        geometry = _piece(layouts[m.param], m, coord)
        if geometry is not None:
            r0, r1, c0, c1, lr0, lc0 = geometry
            piece = Piece(i, peer, (r0, r1), (c0, c1), lr0, lc0, offset)
            pieces.append(piece)
            splits[peer] += piece.numel
            offset += piece.numel
    return tuple(pieces), tuple(splits)


def plan_exchange(
    layouts: Sequence[ParamLayout],
    bucket: Bucket,
    matrices: Sequence[Matrix],
    active: frozenset[int],
    itemsize: int = 2,
    gram_schedules: tuple[tuple[int, NewtonSchulzSchedule], ...] = (),
    ns_per_matrix: bool = False,
) -> ExchangePlan:
    """Split sizes and buffer layouts for one rank and one bucket (see the module example).

    Only params in `active` (those with a gradient this step; every rank must
    agree) take part; owners stay as planned so they do not move between steps.
    """
    matrices = tuple(m for m in matrices if m.param in active)
    first = layouts[bucket.params[0]]
    axis = bucket.axis
    world = 1 if axis is None else first.mesh_shape[axis]
    me = 0 if axis is None else first.coord[axis]
    replica_axis = first.replica_axis if bucket.spread else None
    replica = 0 if replica_axis is None else first.coord[replica_axis]
    replicas = 1 if replica_axis is None else first.mesh_shape[replica_axis]

    by_key: dict[tuple[int, int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        if m.owner == me and m.replica in (None, replica):
            by_key.setdefault((layouts[m.param].group, m.rows, m.cols), []).append(i)
    batches, slot = [], 0
    for (group, rows, cols), members in by_key.items():
        batches.append(Batch(tuple(members), rows, cols, group, slot))
        slot += len(members) * rows * cols

    send_pieces: tuple[Piece, ...] = ()
    recv_pieces: tuple[Piece, ...] = ()
    send_splits = recv_splits = (0,) * world
    replica_splits: tuple[int, ...] = ()
    if axis is not None:
        # my pieces, in (owner replica, owner, matrix) order: one region per replica
        by_owner: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(matrices):
            by_owner.setdefault((m.replica or 0, m.owner), []).append(i)
        regions, sizes, offset = [], [], 0
        for region in range(replicas):
            owners = sorted(owner for r, owner in by_owner if r == region)
            pieces, splits = _lay_out(
                layouts, matrices, world,
                ((owner, i, first.coord) for owner in owners for i in by_owner[region, owner]),
                offset,
            )  # fmt: skip
            regions.append(pieces)
            sizes.append(sum(splits))
            offset += sizes[-1]
            if len(regions) == replica + 1:
                send_splits = splits  # my replica's region is exchanged
        send_pieces = tuple(piece for pieces in regions for piece in pieces)
        replica_splits = tuple(sizes) if replica_axis is not None else ()
        # pieces of matrices I own, in (sender, matrix) order, asked only of the senders
        # that hold a part of them: linear in what this rank receives, not in the world
        senders = []
        for i in by_owner.get((replica, me), ()):
            m = matrices[i]
            layout = layouts[m.param]
            dim = layout.shard_dims[axis]
            extent = (m.row0, m.row0 + m.rows) if dim == layout.ndim - 2 else (0, m.cols)
            senders += ((sender, i) for sender in layout.holders(axis, dim, *extent))
        senders.sort()
        recv_pieces, recv_splits = _lay_out(
            layouts, matrices, world,
            ((sender, i, first.peer_coord(axis, sender)) for sender, i in senders),
        )  # fmt: skip
    return ExchangePlan(
        bucket.index,
        axis,
        tuple(i for i in bucket.params if i in active),
        matrices,
        send_splits,
        recv_splits,
        send_pieces,
        recv_pieces,
        tuple(batches),
        me,
        itemsize,
        gram_schedules,
        ns_per_matrix,
        replica_axis,
        replica,
        replica_splits,
    )
