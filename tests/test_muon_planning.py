"""Pure planning: owners, buckets and exchange splits, with ranks simulated in a loop."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from muon.newton_schulz import ns_flops, ns_flops_symmetric
from muon.planning import (
    MuonPlan,
    ParamLayout,
    assign_owners,
    chunk_range,
    launch_order,
    plan_buckets,
    transient_peak_numel,
)


def _layouts(specs, world: int, rank: int) -> list[ParamLayout]:
    """(shape, shard dim or None, row_blocks) on a 1-D mesh of `world`, seen from `rank`."""
    return [
        ParamLayout(shape, blocks or (), (world,), (dim,), (rank,), mesh_key="mesh")
        for shape, dim, blocks in specs
    ]


SPECS = [
    ((10, 12), 0, None),
    ((2, 9), 0, None),  # fewer rows than ranks
    ((13, 6), 1, None),
    ((16, 12), 0, (8, 4, 4)),
    ((3, 7, 10), 0, None),  # experts sharded on the expert dim: local
    ((2, 9, 6), 1, None),
    ((64, 64), 0, None),
]


def test_chunk_range_is_torch_chunk():
    for size in range(0, 12):
        for chunks in range(1, 6):
            pieces = torch.arange(size).chunk(chunks)
            for index in range(chunks):
                start, stop = chunk_range(size, chunks, index)
                expected = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(start, stop)) == expected


def test_owners_balance_flops_not_counts_and_ignore_input_order():
    assert assign_owners([100, 1, 1, 1], 2) == (0, 1, 1, 1)  # round-robin would give (0, 1, 0, 1)
    shapes = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (512, 512), (300, 700)]
    costs = [ns_flops(*s) + i for i, s in enumerate(shapes * 3)]  # distinct costs
    owners = assign_owners(costs, 4)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(4)]
    assert max(loads) <= 4 / 3 * max(sum(costs) / 4, max(costs))  # LPT bound
    for seed in range(5):
        order = list(range(len(costs)))
        random.Random(seed).shuffle(order)
        shuffled = assign_owners([costs[i] for i in order], 4)
        assert {costs[i]: o for i, o in zip(order, shuffled, strict=True)} == dict(
            zip(costs, owners, strict=True)
        )
    # equal loads: the rank that owned less in earlier buckets goes first
    assert assign_owners([5], 3, prior_load=[7, 2, 9]) == (1,)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_is_rank_invariant_and_buckets_respect_the_cap(world):
    cap = 400
    plans = [MuonPlan.build(_layouts(SPECS, world, r), cap) for r in range(world)]
    for plan in plans[1:]:
        assert plan.buckets == plans[0].buckets
        for bucket, mine, first in zip(plan.buckets, plan.matrices, plans[0].matrices, strict=True):
            if bucket.axis is not None:  # local buckets hold this rank's own experts
                assert mine == first
    buckets = plans[0].buckets
    assert [p for b in buckets for p in sorted(b.params)] == sorted(range(len(SPECS)))
    for bucket in buckets:
        assert bucket.nbytes <= cap or len(bucket.params) == 1
        assert list(bucket.params) == sorted(bucket.params)
    # the 3-D stack sharded on the expert dim is alone in a local bucket
    local = [b for b in buckets if b.axis is None]
    assert [b.params for b in local] == [(4,)]
    assert plan_buckets(_layouts(SPECS, world, 0), 10**9)[0].params == (0, 1, 2, 3, 5, 6)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulated_exchange_reassembles_every_matrix(world):
    """Pack on every rank, move bytes by split sizes, assemble at owners: the full matrices."""
    fulls = [
        torch.randn(shape, generator=torch.Generator().manual_seed(i))
        for i, (shape, _, _) in enumerate(SPECS)
    ]
    plans = [MuonPlan.build(_layouts(SPECS, world, r), 300) for r in range(world)]
    for b, bucket in enumerate(plans[0].buckets):
        if bucket.axis is None:
            continue
        active = frozenset(bucket.params)
        ex = [plan.exchange(b, active) for plan in plans]
        sends = []
        for r, plan in enumerate(ex):
            layouts = plans[r].layouts
            buf = torch.zeros(plan.send_numel)
            for piece in plan.send_pieces:
                m = plan.matrices[piece.matrix]
                layout = layouts[m.param]
                local = fulls[m.param][
                    tuple(slice(*layout.dim_range(d)) for d in range(layout.ndim))
                ]
                block = local if local.ndim == 2 else local[m.expert]
                rows, cols = piece.shape
                r0, c0 = piece.local_row0, piece.local_col0
                buf[piece.offset : piece.offset + piece.numel] = block[
                    r0 : r0 + rows, c0 : c0 + cols
                ].flatten()
            sends.append(buf)
        for r, plan in enumerate(ex):
            for d in range(world):  # split sizes agree pairwise
                assert plan.send_splits[d] == ex[d].recv_splits[r]
            chunks = []
            for s in range(world):
                start = sum(ex[s].send_splits[:r])
                chunks.append(sends[s][start : start + ex[s].send_splits[r]])
            recv = torch.cat(chunks)
            assert recv.numel() == plan.recv_numel
            assembled = {
                i: torch.full((m.rows, m.cols), float("nan"))
                for i, m in enumerate(plan.matrices)
                if m.owner == r
            }
            for piece in plan.recv_pieces:
                view = assembled[piece.matrix][
                    piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]
                ]
                view.copy_(recv[piece.offset : piece.offset + piece.numel].view(piece.shape))
            for i, got in assembled.items():
                m = plan.matrices[i]
                full = fulls[m.param] if fulls[m.param].ndim == 2 else fulls[m.param][m.expert]
                assert torch.equal(got, full[m.row0 : m.row0 + m.rows]), (b, r, m)
            assert plan.owned == len(assembled) and plan.full_numel == sum(
                g.numel() for g in assembled.values()
            )


def test_remainder_batch_leaves_idle_ranks_without_bytes_or_matrices():
    world, remainder = 4, 2
    specs = [((24, 16), 0, None)] * remainder
    plans = [
        MuonPlan.build(_layouts(specs, world, r)).exchange(0, frozenset({0, 1}))
        for r in range(world)
    ]
    busy = [p for p in plans if p.owned]
    idle = [p for p in plans if not p.owned]
    assert len(busy) == remainder and len(idle) == world - remainder
    for plan in idle:
        assert plan.recv_numel == 0 and plan.full_numel == 0
        assert plan.send_numel == remainder * 6 * 16  # its own rows, nothing padded
        assert plan.workspace_bytes == plan.send_numel * 2
    for plan in busy:
        assert plan.recv_numel == plan.full_numel == 24 * 16
    # bytes on the wire: each piece out and back, self-sends excluded
    assert sum(p.bytes_sent for p in plans) == 2 * remainder * 24 * 16 * 3 // 4 * 2


def test_empty_shards_and_inactive_params():
    plans = [
        MuonPlan.build(_layouts([((2, 9), 0, None), ((5, 4), 0, None)], 4, r)) for r in range(4)
    ]
    for r in (2, 3):  # rows 0..1 live on ranks 0 and 1 only
        ex = plans[r].exchange(0, frozenset({0}))
        assert ex.send_numel == 0 and ex.send_pieces == ()
    ex = plans[0].exchange(0, frozenset({1}))
    assert [m.param for m in ex.matrices] == [1]
    assert plans[0].exchange(0, frozenset()).matrices == ()


def test_ep_fsdp_layouts():
    # mesh (ep=2, fsdp=2); experts sharded on the expert dim by ep and on rows by fsdp
    def layout(coord, dims):
        return ParamLayout((4, 9, 6), (), (2, 2), dims, coord, mesh_key="m")

    exchanged = [layout((e, f), (0, 1)) for e in range(2) for f in range(2)]
    assert exchanged[0].exchange_axis == 1 and exchanged[0].local_shape() == (2, 5, 6)
    assert exchanged[3].local_shape() == (2, 4, 6)
    plan = MuonPlan.build([exchanged[0]])
    assert len(plan.matrices[0]) == 2 and plan.buckets[0].nbytes == 2 * 9 * 6 * 2
    local = layout((1, 1), (0, 0))
    assert local.exchange_axis is None and local.local_shape() == (1, 9, 6)
    with pytest.raises(ValueError, match="more than one mesh axis"):
        layout((0, 0), (1, 2))


def test_a_size_one_axis_sharding_a_matrix_dim_shards_nothing():
    # (Shard(1), Shard(1)) on a (1, 2) mesh was refused as a matrix dim sharded by two axes;
    # the size-1 axis holds whole dims, so the layout is Shard(1) over the other axis alone
    cases = [
        ((1, 2), (1, 1), 1),
        ((2, 1), (1, 1), 0),
        ((1, 2), (0, 1), 1),
        ((2, 1), (0, 1), 0),
    ]
    for mesh_shape, dims, axis in cases:
        plans = []
        for rank in range(2):
            coord = (0, rank) if axis == 1 else (rank, 0)
            layout = ParamLayout((10, 12), (), mesh_shape, dims, coord, mesh_key="m")
            alone = ParamLayout((10, 12), (), (2,), (dims[axis],), (rank,), mesh_key="m")
            assert layout.exchange_axis == axis and layout.replica_axis is None
            assert layout.local_shape() == alone.local_shape()
            plan = MuonPlan.build([layout]).exchange(0, frozenset({0}))
            plans.append(plan)
            expected = MuonPlan.build([alone]).exchange(0, frozenset({0}))
            assert dataclasses.replace(plan, axis=0) == expected, (mesh_shape, dims, rank)
        assert sum(p.owned for p in plans) == 1
    with pytest.raises(ValueError, match="more than one mesh axis of size > 1"):
        ParamLayout((10, 12), (), (2, 2), (1, 1), (0, 0), mesh_key="m")


def test_an_hsdp_matrix_and_an_expert_stack_on_one_mesh_get_buckets_of_their_own():
    # Both exchange over axis 1 of a (2, 2) mesh; axis 0 replicates the matrix (HSDP) but
    # holds other experts of the stack. In one bucket, "spread" shared the matrix's
    # replicas' results over axis 0 for the stack too: another expert's update, silently.
    dense = ParamLayout((8, 8), (), (2, 2), (None, 0), (0, 0), mesh_key="m")
    stack = ParamLayout((2, 8, 8), (), (2, 2), (0, 1), (0, 0), mesh_key="m")
    assert dense.exchange_axis == stack.exchange_axis == 1
    assert (dense.replica_axis, stack.replica_axis) == (0, None)
    buckets = plan_buckets([dense, stack], cap_bytes=2**20)
    assert [b.params for b in buckets] == [(0,), (1,)]
    plan = MuonPlan.build([dense, stack], replica_owners={0: "spread"})
    assert [b.spread for b in plan.buckets] == [True, False]


def test_ns_flop_counts():
    # REFERENCE.md: 4 m^2 n + 2 m^3 dense per iteration (m <= n); the symmetric kernels
    # compute half of X X^T and of A A: 3 m^2 n + m^3
    assert ns_flops(4096, 12288, 5) == 5 * (4 * 4096**2 * 12288 + 2 * 4096**3)
    assert ns_flops(12288, 4096) == ns_flops(4096, 12288)
    assert ns_flops_symmetric(12288, 4096, 5) == 5 * (3 * 4096**2 * 12288 + 4096**3)
    assert ns_flops_symmetric(4096, 4096) / ns_flops(4096, 4096) == 4 / 6


def test_launch_order_and_transient_peak():
    # world 2: three exchanged buckets and the local expert stack's bucket
    plan = MuonPlan.build(_layouts(SPECS, 2, 0), 400)
    plans = [plan.exchange(b.index, frozenset(b.params)) for b in plan.buckets]
    local = [i for i, p in enumerate(plans) if p.axis is None]
    assert local and len(plans) - len(local) >= 3
    for inflight in (1, 2, 3):
        order = list(launch_order(plans, inflight))
        assert sorted(order) == sorted((s, i) for i in range(len(plans)) for s in (True, False))
        live, peak = [], 0
        for start, i in order:
            p = plans[i]
            if start:
                live.append(i)
                if p.axis is None:  # a local bucket finishes as soon as it starts
                    assert order[order.index((True, i)) + 1] == (False, i)
                assert sum(plans[j].axis is not None for j in live) <= inflight
            else:
                peak = max(
                    peak,
                    sum(
                        plans[j].send_numel + plans[j].recv_numel + plans[j].full_numel
                        for j in live
                    )
                    + p.ns_numel,
                )
                live.remove(i)
        assert transient_peak_numel(plans, inflight) == peak
    assert transient_peak_numel(plans, 1) <= transient_peak_numel(plans, 3)


def test_size_one_axes_shard_nothing_and_local_launches_batch_across_buckets():
    layouts = _layouts(SPECS, 1, 0)
    assert all(layout.exchange_axis is None for layout in layouts)
    plan = MuonPlan.build(layouts, 400)
    assert all(b.axis is None for b in plan.buckets) and len(plan.buckets) > 1
    everything = frozenset(range(len(SPECS)))
    for b in plan.buckets:  # all local params: the plan's own buckets
        (cut,) = plan.local_exchanges(b.params, everything)
        assert cut == plan.exchange(b.index, everything)
        assert cut.send_numel == cut.recv_numel == 0
    # a subset (an offload chunk) spanning buckets batches its same-shape matrices together
    same = [((8, 8), 0, None)] * 4
    plan = MuonPlan.build(_layouts(same, 1, 0), 2 * 8 * 8 * 2)
    assert [b.params for b in plan.buckets] == [(0, 1), (2, 3)]
    (cut,) = plan.local_exchanges((1, 2), frozenset({1, 2}))
    assert [len(batch.matrices) for batch in cut.batches] == [2] and cut.bucket == 0


def test_plans_are_kept_for_a_few_sets_of_stepping_params_only():
    # a different set of params with grads each step (LayerDrop) cached a plan per set,
    # growing host memory without end
    from muon.planning import ACTIVE_SETS_KEPT

    plan = MuonPlan.build(_layouts(SPECS, 2, 0), 300)
    exchanged = [b.index for b in plan.buckets if b.axis is not None]
    local = [i for b in plan.buckets if b.axis is None for i in b.params]
    assert len(exchanged) > ACTIVE_SETS_KEPT  # each step asks every bucket once
    params = range(len(SPECS))
    sets = [frozenset(p for p in params if p != skipped) for skipped in params]

    def step(active):
        plans = [plan.exchange(b, active) for b in exchanged]
        return plans, plan.local_exchanges(local, active)

    for active in sets:
        kept = step(active)
        assert step(active)[0] == kept[0]  # the next step with these grads: no new plan
        assert all(a is b for a, b in zip(step(active)[0], kept[0], strict=True))
    cached = [len(plans) for plans in (*plan._exchanges.values(), *plan._locals.values())]
    assert cached == [ACTIVE_SETS_KEPT] * (len(exchanged) + 1) and len(sets) > ACTIVE_SETS_KEPT
    # a plan evicted and built again is the same plan
    fresh = MuonPlan.build(_layouts(SPECS, 2, 0), 300)
    assert plan.exchange(exchanged[0], sets[0]) == fresh.exchange(exchanged[0], sets[0])
