"""HSDP with spread owners: each matrix orthogonalized once over the whole mesh.

On gloo meshes replicate x shard 2x2, 3x2 and 2x3 (uneven and empty shards, Shard(1),
fused QKV row blocks, a 3-D expert stack exchanged on rows), Muon with
`replica_owners="spread"` is bit-equal, after 3 steps, to a single process on the full
tensors and to `"per_replica"`, with and without `CPUOffloadOptimizer`. The plan's
Newton-Schulz FLOPs per rank fall by the replica count where matrices outnumber ranks.
"""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_on_ranks
from test_muon_distributed import _full, _shard
from test_muon_plan import TINY_MOE as PLAN_TINY_MOE
from torch.distributed.tensor import Replicate, Shard

from muon import Muon
from muon.model_shapes import from_config
from muon.newton_schulz import ns_flops
from muon.planning import MuonPlan, ParamLayout, SpreadModel
from muon_offload.estimate import MeshSpec, StepSettings, compare_replica_owners, estimate
from offload import CPUOffloadOptimizer

STEPS = 3
# (shape, placements on (replicate, shard), row_blocks): 10 and 7 rows do not divide 3;
# 2 rows leave a rank empty at 3 shards.
SPECS = [
    ((10, 12), (Replicate(), Shard(0)), None),
    ((2, 9), (Replicate(), Shard(0)), None),
    ((7, 5), (Replicate(), Shard(1)), None),
    ((12, 8), (Replicate(), Shard(0)), (6, 2, 4)),
    ((3, 7, 6), (Replicate(), Shard(1)), None),
]
CAP = 300  # bytes: several buckets


def _run(mesh, replica_owners: str | None, offload: bool, device: torch.device) -> list:
    """Params (local shards; full tensors without a mesh) after STEPS steps."""
    params = [
        torch.nn.Parameter(
            _full(shape, i).to(device)
            if mesh is None
            else _shard(_full(shape, i).to(device), mesh, pl)
        )
        for i, (shape, pl, _) in enumerate(SPECS)
    ]
    groups = [
        {"params": [p], "row_blocks": blocks}
        for p, (_, _, blocks) in zip(params, SPECS, strict=True)
    ]
    options = {} if replica_owners is None else {"replica_owners": replica_owners}
    opt = Muon(groups, lr=0.02, bucket_cap_bytes=CAP, **options)
    if mesh is not None:
        spread = any(b.spread for b in opt._muon_plan().buckets)
        assert spread == (replica_owners == "spread"), replica_owners
    stepper = CPUOffloadOptimizer(opt, chunk_bytes=CAP, staging_slots=2) if offload else opt
    for step in range(STEPS):
        for i, (p, (_, pl, _)) in enumerate(zip(params, SPECS, strict=True)):
            grad = _full(p.shape, 1000 * step + i).to(device)  # every replica's, as after HSDP
            p.grad = grad if mesh is None else _shard(grad, mesh, pl)
        stepper.step()
    return [p.detach().to_local() if mesh is not None else p.detach() for p in params]


def _worker(rank: int, world: int, shapes: list[tuple[int, int]], backend: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    single = _run(None, None, False, device)
    for shape in shapes:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        expected = [
            _shard(full, mesh, spec[1]).to_local() for full, spec in zip(single, SPECS, strict=True)
        ]
        per_replica = _run(mesh, "per_replica", False, device)
        for offload in (False, True):
            spread = _run(mesh, "spread", offload, device)
            for i, (got, want, other) in enumerate(zip(spread, expected, per_replica, strict=True)):
                where = f"mesh {shape} offload {offload} param {i} {SPECS[i][0]}"
                if backend == "gloo":
                    assert torch.equal(got, want), where
                    assert torch.equal(got, other), where
                else:  # cuBLAS may pick another kernel for another batch count: rounding
                    torch.testing.assert_close(got, want, rtol=0, atol=2e-3, msg=where)
                    torch.testing.assert_close(got, other, rtol=0, atol=2e-3, msg=where)


@pytest.mark.parametrize("world", [4, 6])
def test_spread_owners_match_a_single_process_and_per_replica(world):
    shapes = {4: [(2, 2)], 6: [(3, 2), (2, 3)]}[world]
    run_on_ranks(_worker, world, shapes, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA devices"
)
def test_spread_owners_on_nccl():
    """The same on 4 GPUs (2 x 2), NCCL: the replica gather's all_gather on device."""
    run_on_ranks(_worker, 4, [(2, 2)], "nccl", backend="nccl")


def test_spread_divides_the_flops_per_rank_by_the_replicas():
    """24 equal matrices on 2 x 3 ranks: per replica each shard rank owns 8 of them in each
    replica; spread, each of the 6 ranks owns 4, and each matrix has one owner."""
    replicas, shards = 2, 3

    def plans(replica_owners: str) -> list[MuonPlan]:
        return [
            MuonPlan.build(
                [ParamLayout((24, 16, 8), (), (replicas, shards), (None, 1), (r, s), "m")],
                replica_owners={0: replica_owners},
            )
            for r in range(replicas)
            for s in range(shards)
        ]

    flops = {}
    for choice in ("per_replica", "spread"):
        per_rank = []
        for plan in plans(choice):
            (bucket,) = plan.buckets
            assert bucket.spread == (choice == "spread")
            ex = plan.exchange(0, frozenset(bucket.params))
            per_rank.append(sum(len(b.matrices) * ns_flops(b.rows, b.cols) for b in ex.batches))
        flops[choice] = per_rank
    one = ns_flops(16, 8)
    assert flops["per_replica"] == [8 * one] * 6
    assert flops["spread"] == [4 * one] * 6  # falls by the replica count
    owners = {(m.replica, m.owner) for m in plans("spread")[0].matrices[0]}
    assert len(owners) == replicas * shards


def test_auto_spreads_where_the_model_says_it_pays():
    layouts = [ParamLayout((24, 4096, 4096), (), (4, 2), (None, 1), (0, 0), "m")]
    auto = {0: "auto"}
    assert MuonPlan.build(layouts, replica_owners=auto).buckets[0].spread
    slow = SpreadModel(replica_bytes_per_s=1e3)  # a link so slow that sharing costs more
    assert not MuonPlan.build(layouts, replica_owners=auto, spread_model=slow).buckets[0].spread
    small = [ParamLayout((24, 256, 256), (), (4, 2), (None, 1), (0, 0), "m")]
    assert not MuonPlan.build(small, replica_owners=auto).buckets[0].spread
    flat = [ParamLayout((24, 4096, 4096), (), (8,), (1,), (0,), "m")]  # no replica axis
    assert not MuonPlan.build(flat, replica_owners=auto).buckets[0].spread


def test_each_group_gets_the_owners_it_chose_where_groups_share_a_domain():
    # a "spread" group bucketed with a "per_replica" (or "auto") group's params ran per
    # replica, silently: one bucket spreads for all its params (hostile review)
    def layout(group: int) -> ParamLayout:
        return ParamLayout((16, 8), (), (2, 2), (None, 0), (0, 0), "m", group)

    layouts = [layout(0), layout(1), layout(0), layout(1)]
    for other in ("per_replica", "auto"):
        plan = MuonPlan.build(layouts, replica_owners={0: "spread", 1: other})
        spread = {i: b.spread for b in plan.buckets for i in b.params}
        assert spread[0] and spread[2] and not spread[1] and not spread[3]
    # without a replica axis the choice is moot: the groups share buckets as before
    flat = [ParamLayout((16, 8), (), (4,), (0,), (0,), "m", g) for g in (0, 1, 0, 1)]
    plan = MuonPlan.build(flat, replica_owners={0: "spread", 1: "per_replica"})
    assert [b.params for b in plan.buckets] == [(0, 1, 2, 3)]


# test_muon_plan's tiny DeepSeek-like MoE with 4 routed experts: two expert-parallel ranks.
TINY_MOE = {**PLAN_TINY_MOE, "n_routed_experts": 4}


@pytest.mark.parametrize(
    "mesh",
    [
        MeshSpec(2, replicate=2),
        MeshSpec(3, replicate=2, expert_shard="rows"),
        MeshSpec(2, replicate=3),
        MeshSpec(4, replicate=2, ep=2, expert_shard="rows"),
    ],
    ids=str,
)
def test_spread_estimate_screens_every_rank_of_the_mesh(mesh):
    """With spread owners the replicas differ: the screen covers every rank of the mesh and
    equals each rank's own exchange plans (replica gather included); the busiest rank's
    FLOPs fall against per-replica owners."""
    shapes = from_config(TINY_MOE)
    settings = StepSettings(bucket_cap_bytes=1500, replica_owners="spread")
    model = estimate(shapes, mesh, settings, ranks=range(mesh.world))
    assert model.screen.flops.numel() == mesh.world
    for estimated in model.ranks:
        for b, load in enumerate(estimated.loads):
            got = (
                model.screen.ns_flops[b, estimated.rank],
                model.screen.bytes_sent[b, estimated.rank],
                model.screen.buffer_bytes[b, estimated.rank],
            )
            assert got == (load.ns_flops, load.bytes_sent, load.buffer_bytes), (estimated.rank, b)
        transient = model.muon_step_transient(estimated.rank).total_bytes
        assert model.screen.muon_transient_bytes[estimated.rank] == transient, estimated.rank
    spread, per_replica = compare_replica_owners(shapes, mesh, settings)
    assert spread.spread_buckets > 0 and per_replica.spread_buckets == 0
    assert spread.ns_flops_max < per_replica.ns_flops_max
