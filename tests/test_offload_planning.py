"""Pure planning and NUMA discovery: no processes, no devices."""

from __future__ import annotations

import functools

import pytest
import torch

from offload.chunk_plan import (
    ALIGN_BYTES,
    SLICE_ELEMENTS,
    ParamSpec,
    Span,
    StateSpec,
    UnitSize,
    pack_units,
    plan_offload,
    resident_in_both,
)
from offload.cpu_offload import invariant_numel
from offload.numa import bound_to_node, numa_nodes, parse_cpulist, pci_numa_node
from offload.step_schedule import (
    backward_load_count,
    chosen_backward_loads,
    first_wait_load_count,
    loads_within_room,
    plan_step,
    ring_slots_taken,
    staging_slot_order,
    update_runs,
)


def spec(numel: int, *dtypes: torch.dtype, splittable: bool = False) -> ParamSpec:
    return ParamSpec(
        numel,
        tuple(StateSpec(f"s{i}", torch.Size([numel]), d) for i, d in enumerate(dtypes)),
        splittable,
    )


def whole(sizes):
    return [UnitSize(size) for size in sizes]


def test_pack_units_keeps_units_whole_and_under_cap():
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 5
    for cap in (1, 8, 16, 40, 10**9):
        chunks = pack_units(whole(sizes), cap)
        assert [s.unit for c in chunks for s in c] == list(range(len(sizes)))  # whole, in order
        for chunk in chunks:
            assert len(chunk) == 1 or sum(sizes[s.unit] for s in chunk) <= cap
    assert [len(c) for c in pack_units(whole([4, 4, 4, 4]), 1)] == [1, 1, 1, 1]
    assert pack_units(whole([20, 1, 1]), 8)[0] == (Span(0),)  # oversized unit alone
    assert pack_units([], 8) == ()


def test_pack_units_ramps_chunk_size_at_both_ends():
    lengths = [len(c) for c in pack_units(whole([1] * 1000), 64)]
    assert lengths[:4] == [8, 16, 32, 64] and lengths[-4:] == [64, 32, 16, 8]
    assert max(lengths) == 64 and sum(lengths) == 1000
    # first loads overlapped elsewhere (the backward): full from the start
    lengths = [len(c) for c in pack_units(whole([1] * 1000), 64, ramp_first=False)]
    assert lengths[:4] == [64, 64, 64, 64] and lengths[-4:] == [64, 32, 16, 8]


def test_pack_units_slices_splittable_units_to_fit_the_cap():
    # fp32 state, 8 bytes an element: a 10_000-element param is 80_000 bytes
    units = [UnitSize(800, 100, True), UnitSize(80_000, 10_000, True), UnitSize(3000)]
    for cap in (1, 512, 4096, 20_000):
        chunks = pack_units(units, cap)
        for chunk in chunks:
            size = sum(
                (s.stop - s.start) * 8 if units[s.unit].splittable else units[s.unit].bytes
                for s in chunk
            )
            oversized = len(chunk) == 1 and not units[chunk[0].unit].splittable
            assert size <= max(cap, SLICE_ELEMENTS * 8) or oversized, (cap, chunk)
            assert len({s.unit for s in chunk}) == len(chunk)  # one piece of a unit a chunk
        for u, unit in enumerate(units):
            pieces = [(s.start, s.stop) for c in chunks for s in c if s.unit == u]
            if unit.splittable:  # the pieces tile the unit, in order, cut on slice boundaries
                assert pieces[0][0] == 0 and pieces[-1][1] == unit.numel
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
                assert all(a % SLICE_ELEMENTS == 0 for a, _ in pieces)  # from the unit's start
            else:
                assert len(pieces) == 1


def _check_layout(plan, params):
    for chunk in plan.chunks:
        for view in chunk.views:
            assert (view.home_offset * view.spec.dtype.itemsize) % ALIGN_BYTES == 0
            if chunk.resident:
                continue
            # the chunk's copies carry exactly its views' elements to their staging offsets
            runs = chunk.copies.get(view.spec.dtype, ())
            home = view.home_offset + view.start
            n = view.stop - view.start
            assert n == 0 or any(
                r.home_start <= home
                and home + n <= r.home_start + r.numel
                and view.staging_offset - r.staging_start == home - r.home_start
                for r in runs
            )
            assert view.staging_offset + n <= plan.slot_numel[view.spec.dtype]
    # a write-back never touches another chunk's state: copies are disjoint per slab
    for dtype in plan.host_numel:
        runs = sorted(
            (r.home_start, r.home_start + r.numel)
            for c in plan.chunks
            for r in c.copies.get(dtype, ())
        )
        for (_, end), (start, _) in zip(runs, runs[1:], strict=False):
            assert end <= start, runs
    # homes never overlap inside a slab, resident and host slabs apart
    for resident in (False, True):
        spans = sorted(
            {
                (v.spec.dtype.itemsize, v.home_offset, v.spec.numel)
                for c in plan.chunks
                if c.resident == resident
                for v in c.views
                if v.spec.dtype == torch.float32
            }
        )
        for (_, a, n), (_, b, _) in zip(spans, spans[1:], strict=False):
            assert a + n <= b


def test_plan_lays_out_each_chunk_in_few_aligned_copies():
    params = [
        spec(10, torch.float32, torch.float32),
        spec(7, torch.float32, torch.bfloat16),
        spec(300, torch.float32),
        spec(1000, torch.float32, torch.float32, splittable=True),
    ]
    plan = plan_offload([[0], [1], [2], [3]], params, chunk_bytes=1500)
    assert len(plan.chunks) >= 3 and any(c.slices for c in plan.chunks)
    _check_layout(plan, params)
    assert sum(len(runs) for c in plan.chunks for runs in c.copies.values()) <= 3 * len(plan.chunks)
    assert plan.host_bytes >= sum(p.invariant_bytes for p in params)
    assert plan.staging_bytes(1) <= 1500 + 2 * ALIGN_BYTES  # a slot is what chunk_bytes says


def test_plan_keeps_the_resident_budget_of_whole_units_on_the_gpu():
    params = [spec(100, torch.float32, torch.float32, splittable=True) for _ in range(6)]
    units = [[i] for i in range(6)]
    unit_bytes = params[0].invariant_bytes
    for first in (False, True):
        for budget, n_resident in ((0, 0), (unit_bytes, 1), (3 * unit_bytes + 5, 3), (10**9, 6)):
            plan = plan_offload(units, params, 300, resident_bytes=budget, resident_first=first)
            resident = [p for c in plan.chunks if c.resident for p in c.params]
            resident += [s.param for c in plan.chunks if c.resident for s in c.slices]
            expected = range(n_resident) if first else range(6 - n_resident, 6)
            assert sorted(set(resident)) == list(expected)
            # resident chunks come first with forward overlap, last without
            flags = [c.resident for c in plan.chunks]
            assert flags == sorted(flags, reverse=first)
            assert plan.host_bytes + plan.resident_bytes >= 6 * unit_bytes
            assert (plan.resident_bytes == 0) == (n_resident == 0)
            assert (plan.host_bytes == 0) == (n_resident == 6)
            _check_layout(plan, params)
    # a unit larger than what is left of the budget ends residency: the staged units stay
    # one run (residency past it would cut them into runs that pack on their own)
    params = [spec(10, torch.float32), spec(1000, torch.float32)] + [
        spec(10, torch.float32) for _ in range(4)
    ]
    units = [[i] for i in range(6)]
    plan = plan_offload(units, params, 10**9, resident_bytes=200, resident_first=True)
    assert [(c.params, c.resident) for c in plan.chunks] == [((0,), True), ((1, 2, 3, 4, 5), False)]


class _ShardedParam:
    """What `invariant_numel` reads of an FSDP2 DTensor: global numel, placements, mesh."""

    def __init__(self, shape: tuple[int, ...], world: int) -> None:
        from torch.distributed.tensor import Shard

        self.shape = torch.Size(shape)
        self.placements = (Shard(0),)
        self.device_mesh = type("Mesh", (), {"size": lambda _, dim: world})()

    def numel(self) -> int:
        return self.shape.numel()


def _rank_view(shapes, world: int, rank: int) -> list[ParamSpec]:
    """Rank `rank`'s own ParamSpecs: its torch.chunk shard of each param, its own count."""
    specs = []
    for shape in shapes:
        rows = torch.empty(shape[0]).chunk(world)
        local_rows = rows[rank].numel() if rank < len(rows) else 0
        local = torch.Size([local_rows, *shape[1:]])
        state = (StateSpec("m", local, torch.float32), StateSpec("v", local, torch.float32))
        specs.append(ParamSpec(invariant_numel(_ShardedParam(shape, world)), state, True))
    return specs


def test_plan_is_rank_invariant_for_uneven_shards():
    # 255 x 8 over 2 ranks: 128 + 127 rows; over 3: 85 each; 2 x 8 over 3: 1 + 1 + 0 rows;
    # 129 x 64 over 2: 65 + 64 rows, a slice more on rank 0 if it counted its own shard
    shapes = [(255, 8), (2, 8), (64,), (1001, 3), (129, 64), (255,)]
    units = [[i] for i in range(len(shapes))]
    for world in (2, 3):
        for chunk_bytes in (1, 700, 4096, 2**40):
            for resident in (0, 9000):
                plans = [
                    plan_offload(units, _rank_view(shapes, world, r), chunk_bytes, resident, True)
                    for r in range(world)
                ]
                cuts = {
                    tuple(
                        (c.params, tuple(s.param for s in c.slices), c.resident)
                        for c in plan.chunks
                    )
                    for plan in plans
                }
                assert len(cuts) == 1, (world, chunk_bytes)
                for rank, plan in enumerate(plans):  # each rank's slices tile its own shard
                    local = _rank_view(shapes, world, rank)
                    _check_layout(plan, local)
                    for i, spec in enumerate(local):
                        pieces = [
                            (s.start, s.stop) for c in plan.chunks for s in c.slices if s.param == i
                        ]
                        if pieces:
                            assert pieces[0][0] == 0 and pieces[-1][1] == spec.state[0].numel
                            assert all(
                                a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False)
                            )


def test_numa_node_from_fake_sysfs(tmp_path):
    for node, cpus in ((0, "0-3,8"), (1, "4-7,9-10")):
        d = tmp_path / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (tmp_path / "devices/system/node/possible").write_text("0-1\n")
    dev = tmp_path / "bus/pci/devices/0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    unknown = tmp_path / "bus/pci/devices/0000:5e:00.0"
    unknown.mkdir(parents=True)
    (unknown / "numa_node").write_text("-1\n")
    assert numa_nodes(tmp_path) == [0, 1]
    assert pci_numa_node("0000:3B:00.0", tmp_path) == 1
    assert pci_numa_node("0000:5e:00.0", tmp_path) is None
    assert pci_numa_node("0000:99:00.0", tmp_path) is None
    assert parse_cpulist("4-7,9-10\n") == [4, 5, 6, 7, 9, 10]


def test_bind_is_a_logged_noop_without_a_node(caplog):
    import logging
    import os

    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="offload.numa"), bound_to_node(None):
        pass
    assert os.sched_getaffinity(0) == before
    assert "not bound" in caplog.text


def test_bind_sets_affinity_from_fake_sysfs(tmp_path):
    import os

    before = os.sched_getaffinity(0)
    cpu = min(before)
    d = tmp_path / "devices/system/node/node0"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(f"{cpu}\n")
    try:
        with bound_to_node(0, tmp_path):
            assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)


def test_copy_pieces_cover_a_run_in_order_and_cap_each_piece(monkeypatch):
    from offload import executor

    monkeypatch.setattr(executor, "COPY_PIECE_BYTES", 40)  # 10 float32 elements
    home, staging = torch.arange(23.0), torch.zeros(23)
    pieces = executor._copy_pieces(home, staging)
    assert [h.numel() for h, _ in pieces] == [10, 10, 3]
    for h, st in pieces:
        st.copy_(h)
    assert torch.equal(staging, home)


def test_the_backward_loads_the_ring_or_the_leading_chunks_that_fit_its_budget():
    sizes = [100, 100, 80, 100, 60]
    assert backward_load_count(sizes, ring_slots=2, budget=None) == 2
    # a byte count is the most it loads, below the ring's too: each load holds an extra slot
    assert backward_load_count(sizes, ring_slots=2, budget=0) == 0
    assert backward_load_count(sizes, ring_slots=2, budget=199) == 1
    assert backward_load_count(sizes, ring_slots=2, budget=279) == 2
    assert backward_load_count(sizes, ring_slots=2, budget=280) == 3
    assert backward_load_count(sizes, ring_slots=2, budget=380) == 4
    assert backward_load_count(sizes, ring_slots=2, budget=10**9) == 5
    assert backward_load_count(sizes[:1], ring_slots=4, budget=None) == 1


def test_the_backward_loads_the_staged_chunks_the_forward_first_waits_for():
    # Chunks by param index: the root's embedding (0) cut in three, a layer (1, 2), the
    # head (3) cut in two: the forward's first wait (the root: 0 and 3) ends at chunk 6.
    chunks = [(0,), (0,), (0,), (1,), (2,), (3,), (3, 4)]
    staged = [True] * 7
    assert first_wait_load_count(chunks, staged, [0, 3], ring_slots=2) == 7
    assert first_wait_load_count(chunks, staged, [0], ring_slots=2) == 3
    assert first_wait_load_count(chunks, staged, [1], ring_slots=2) == 4
    # Never fewer than the ring, nor more than are staged; a resident prefix loads nothing.
    assert first_wait_load_count(chunks, staged, [], ring_slots=2) == 2
    assert first_wait_load_count(chunks[:1], staged[:1], [0], ring_slots=4) == 1
    resident_root = [False, False, False, True, True, True, True]
    assert first_wait_load_count(chunks, resident_root, [0], ring_slots=2) == 2
    assert first_wait_load_count(chunks, resident_root, [0, 3], ring_slots=2) == 4


def test_the_backward_load_rule_is_the_first_wait_with_it_else_the_budget():
    # A resident chunk, then four staged: its bytes count for neither rule.
    chunks = [(0,), (1,), (2,), (3,), (4,)]
    sizes = [500, 100, 100, 80, 100]
    staged = [False, True, True, True, True]
    pick = functools.partial(chosen_backward_loads, chunks, sizes, staged, 2)
    assert pick(first_wait=[3], budget=10**9) == 3  # the budget does not apply
    assert pick(first_wait=[], budget=None) == 2  # the ring's
    assert pick(first_wait=None, budget=None) == 2
    assert pick(first_wait=None, budget=280) == 3
    assert pick(first_wait=None, budget=10**9) == 4


def test_loads_within_room_tries_every_count_as_the_ring_shrinks():
    """Held bytes per count of chunks loaded in the backward: each adds its extra slot,
    and the ring drops a slot once fewer chunks are left to it, so more loads can hold
    less; the most that fit is found past a count that does not."""
    held = {3: 10, 4: 12, 5: 11, 6: 9, 7: 13}.__getitem__  # 7 staged, a ring of 3
    assert loads_within_room(3, 7, 3, held, room=11) == 6
    assert loads_within_room(3, 7, 3, held, room=13) == 7
    assert loads_within_room(3, 7, 3, held, room=8) == 3  # never fewer than the least
    # where the ring keeps its slots, held grows: the first count that does not fit ends
    # the climb, and only the ring's shrinking counts are tried past it
    asked = []
    growing = {k: 10 + k for k in range(20)}
    loads_within_room(2, 19, 3, lambda k: asked.append(k) or growing[k], room=15)
    assert asked == [3, 4, 5, 6, 19, 18, 17]
    # 5 staged chunks, a ring of 2: the ring's slots taken as the backward loads 2 to 5
    slots = {k: plan_step([True] * 5, 2, k, overlap=True).slots for k in range(2, 6)}
    assert [ring_slots_taken(slots[k], 2) for k in range(2, 6)] == [2, 2, 1, 0]


def test_the_backward_loads_take_extra_slots_and_the_rest_turn_the_ring():
    assert staging_slot_order(7, ring_slots=3, backward_loads=0) == [0, 1, 2, 0, 1, 2, 0]
    # the backward's chunks never take the ring's slots: the ring is free when the step
    # starts, and its loads wait for none of their write-backs
    assert staging_slot_order(7, ring_slots=3, backward_loads=2) == [3, 4, 0, 1, 2, 0, 1]
    assert staging_slot_order(7, ring_slots=3, backward_loads=3) == [3, 4, 5, 0, 1, 2, 0]
    assert staging_slot_order(4, ring_slots=3, backward_loads=4) == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="ring_slots"):
        staging_slot_order(3, ring_slots=0, backward_loads=0)


def test_chunks_fill_up_to_the_largest_staged_unit_that_cannot_be_cut():
    """A staging slot holds the largest uncut unit anyway: chunks fill up to it, so a step
    makes fewer, larger launches for the same ring (not up to a resident unit's size)."""
    params = [spec(8192, torch.float32)] + [spec(512, torch.float32) for _ in range(64)]
    units = [[i] for i in range(len(params))]
    plan = plan_offload(units, params, chunk_bytes=4096)
    staged = [c.invariant_bytes for c in plan.chunks]
    assert max(staged) == 32768 and sum(b > 4096 for b in staged) > 1
    assert plan.staging_bytes(1) == 32768
    kept = plan_offload(units, params, 4096, resident_bytes=32768, resident_first=True)
    assert kept.chunks[0].resident and max(c.invariant_bytes for c in kept.chunks[1:]) <= 4096
    # splittable units are cut to chunk_bytes as before
    sliced = [spec(8192, torch.float32, splittable=True)] + params[1:]
    assert max(c.invariant_bytes for c in plan_offload(units, sliced, 4096).chunks) <= 4096


def _issue_order(schedule) -> list[tuple[str, int]]:
    ops = [("step", c) for c in schedule.ready]  # as one update, first
    ops += schedule.prologue
    for chunk_ops in schedule.per_chunk:
        ops += chunk_ops
    return ops + list(schedule.epilogue)


def test_plan_step_enqueues_loads_ahead_and_holds_back_the_extra_slots_write_backs():
    # 1 resident chunk, then 5 staged, a ring of 3, the backward loading 4 (extra slots)
    schedule = plan_step([False] + [True] * 5, ring_slots=3, backward_loads=4, overlap=True)
    assert schedule.slots == (-1, 3, 4, 5, 6, 0)
    assert schedule.staged == (1, 2, 3, 4, 5) and schedule.extra_slots == 4
    # the resident chunk and the backward's 4 are ready: they update first, together
    assert schedule.ready == (0, 1, 2, 3, 4)
    assert _issue_order(schedule) == [
        ("step", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4),
        # into the ring, waiting for no write-back; at chunk 3's turn, as the forward
        # passes it: enqueued in step(), the trainer's input copy waited behind it (H100)
        ("load", 5),
        ("step", 5), ("write_back", 5),
        # the backward's write-backs are held to the end: a trainer's small copy early in
        # the forward would wait behind them in the copy engine
        ("write_back", 1), ("write_back", 2), ("write_back", 3), ("write_back", 4),
    ]  # fmt: skip
    assert schedule.prologue == () and schedule.per_chunk[3] == (("load", 5),)
    # without the backward's loads: the loads ring_slots - 1 staged chunks ahead
    loading = plan_step([False] + [True] * 5, ring_slots=3, backward_loads=0, overlap=True)
    assert loading.ready == (0,)
    assert _issue_order(loading) == [
        ("step", 0),
        ("load", 1), ("load", 2),
        ("load", 3), ("step", 1), ("write_back", 1),
        ("load", 4), ("step", 2), ("write_back", 2),
        ("load", 5), ("step", 3), ("write_back", 3),
        ("step", 4), ("write_back", 4),
        ("step", 5), ("write_back", 5),
    ]  # fmt: skip
    # without overlap nothing is held back, and there is no look-ahead
    plain = plan_step([False] + [True] * 5, ring_slots=3, backward_loads=4, overlap=False)
    assert plain.per_chunk[5] == (("step", 5), ("write_back", 5))
    assert plain.epilogue == () and plain.ahead_of == ()
    # a ring of one: each chunk loads, then steps
    single = plan_step([True] * 3, ring_slots=1, backward_loads=0, overlap=False)
    assert _issue_order(single) == [
        ("load", 0), ("step", 0), ("write_back", 0),
        ("load", 1), ("step", 1), ("write_back", 1),
        ("load", 2), ("step", 2), ("write_back", 2),
    ]  # fmt: skip


def test_plan_step_keeps_chunks_ahead_of_the_forward():
    schedule = plan_step([False] * 4 + [True] * 6, ring_slots=2, backward_loads=0, overlap=True)
    assert schedule.up_front == 3  # UP_FRONT_RINGS x 2 chunks
    # 10: past the last chunk, the epilogue too (the ring given back within the forward)
    assert schedule.ahead_of == (2, 3, 4, 5, 6, 7, 8, 9, 10, 10)
    resident = plan_step([False] * 3, ring_slots=2, backward_loads=0, overlap=True)
    assert resident.up_front == 3 and resident.slots == (-1, -1, -1)
    assert resident.describe() == "3 chunks: 3 resident, 0 staged"
    loaded = plan_step([True] * 3, ring_slots=2, backward_loads=3, overlap=True)
    assert (
        loaded.describe() == "3 chunks: 0 resident, 3 staged in 3 extra slots; the backward loads 3"
    )


@pytest.mark.parametrize("module", ["step_schedule", "step_plan"])
def test_the_planning_modules_examples_run(module):
    import doctest
    import importlib

    tests = doctest.testmod(importlib.import_module(f"offload.{module}"))
    assert tests.attempted > 0 and tests.failed == 0


def test_the_backward_spreads_its_loads_over_the_modules_before_the_last():
    from offload.step_schedule import backward_load_share

    # 6 chunks over 4 modules: shares after the 1st, 2nd and 3rd module, none left for
    # the last (the embedding, the backward's end)
    assert [backward_load_share(6, passed, 4) for passed in range(5)] == [0, 2, 4, 6, 6]
    assert [backward_load_share(2, passed, 5) for passed in range(5)] == [0, 1, 1, 2, 2]
    assert backward_load_share(3, 1, 1) == 3  # one module: all at once
    assert backward_load_share(0, 3, 4) == 0


def test_a_stack_strided_over_two_axes_counts_both_as_shards():
    # FSDP2's default shard over expert parallelism places an expert stack
    # (_StridedShard(0), Shard(0)): on torch 2.13 _StridedShard is no Shard, its axis was
    # not counted, and the plan sized the stack's state twice its shard (an AdamW stack
    # sliced into chunks of which the last was empty on every rank)
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist = torch.distributed
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (2, 2))
        placements = [_StridedShard(0, split_factor=2), Shard(0)]
        full = (8, 4, 6)
        stack = DTensor.from_local(
            torch.zeros(2, 4, 6), mesh, placements, shape=full, stride=(24, 6, 1)
        )
        assert invariant_numel(stack) == stack.to_local().numel() == 48
    finally:
        dist.destroy_process_group()


def test_resident_in_both_is_the_state_both_plans_keep_resident():
    """What a move between two plans of one host layout may copy device to device."""
    params = [spec(n, torch.float32, torch.bfloat16) for n in (300, 50, 700, 40, 500, 90)]
    units = [[0], [1], [2], [3], [4], [5]]

    def plan(resident: int, first: bool = True):
        return plan_offload(
            units, params, 1000, resident, resident_first=first, host_room_for_all=True
        )

    def resident(p) -> set[tuple[int, str]]:
        return {(v.param, v.spec.key) for c in p.chunks if c.resident for v in c.views}

    large, small = plan(6 * (300 + 50 + 700)), plan(6 * (300 + 50))
    assert resident(small) == {(i, k) for i in (0, 1) for k in ("s0", "s1")}
    assert resident_in_both(large, small) == resident_in_both(small, large) == resident(small)
    assert resident_in_both(large, plan(0)) == frozenset()
    last = plan(6 * 90, first=False)  # the last unit: none in common with the first ones
    assert resident(last) and resident_in_both(small, last) == frozenset()


@pytest.mark.parametrize("seed", range(20))
def test_runs_with_slices_together_are_no_more_and_no_larger(seed):
    """Taking several slices of a param in one call never makes more calls than one slice
    a call, nor a call over more state (found by a review: a cap of the largest chunk,
    with nothing resident, made 17 calls where there had been 13)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (), generator=gen))
    resident_count = int(torch.randint(0, n + 1, (), generator=gen))
    # params 0..9, each chunk a few consecutive ones (a param sliced across chunks repeats)
    starts = torch.randint(0, 10, (n,), generator=gen).sort().values.tolist()
    touched = [set(range(s, s + int(torch.randint(1, 3, (), generator=gen)))) for s in starts]
    creates = (torch.rand(n, generator=gen) < 0.1).tolist()
    sizes = torch.randint(1, 100, (n,), generator=gen).tolist()
    resident = [c < resident_count for c in range(n)]
    alone = update_runs(touched, creates, sizes, resident, False)
    together = update_runs(touched, creates, sizes, resident, True)
    assert sum(together, []) == list(range(n)) == sum(alone, [])
    assert len(together) <= len(alone)
    assert max(sum(sizes[c] for c in r) for r in together) <= max(
        sum(sizes[c] for c in r) for r in alone
    )
    assert all(len(r) == 1 for r in together if any(creates[c] for c in r))
