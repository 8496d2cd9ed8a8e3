"""Pure planning and NUMA discovery: no processes, no devices."""

from __future__ import annotations

import torch

from offload.chunk_plan import ALIGN_BYTES, ParamSpec, StateSpec, pack_units, plan_offload
from offload.numa import bound_to_node, numa_nodes, parse_cpulist, pci_numa_node


def spec(numel: int, *dtypes: torch.dtype) -> ParamSpec:
    return ParamSpec(
        numel, tuple(StateSpec(f"s{i}", torch.Size([numel]), d) for i, d in enumerate(dtypes))
    )


def test_pack_units_keeps_units_whole_and_under_cap():
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 5
    for cap in (1, 8, 16, 40, 10**9):
        chunks = pack_units(sizes, cap)
        assert [u for c in chunks for u in c] == list(range(len(sizes)))  # whole, in order
        for chunk in chunks:
            assert len(chunk) == 1 or sum(sizes[u] for u in chunk) <= cap
    assert pack_units([4, 4, 4, 4], 1) == tuple(range(i, i + 1) for i in range(4))
    assert pack_units([20, 1, 1], 8)[0] == range(0, 1)  # oversized unit alone
    assert pack_units([], 8) == ()


def test_pack_units_ramps_chunk_size_at_both_ends():
    lengths = [len(c) for c in pack_units([1] * 1000, 64)]
    assert lengths[:4] == [8, 16, 32, 64] and lengths[-4:] == [64, 32, 16, 8]
    assert max(lengths) == 64 and sum(lengths) == 1000


def test_plan_lays_out_each_chunk_contiguously_and_aligned():
    params = [
        spec(10, torch.float32, torch.float32),
        spec(7, torch.float32, torch.bfloat16),
        spec(300, torch.float32),
    ]
    plan = plan_offload([[0], [1], [2]], params, chunk_bytes=150)
    assert [u for c in plan.chunks for u in c.units] == [0, 1, 2] and len(plan.chunks) >= 2
    for chunk in plan.chunks:
        for view in chunk.views:
            start, stop = chunk.host_ranges[view.spec.dtype]
            assert start <= view.host_offset and view.host_offset + view.spec.numel <= stop
            assert view.staging_offset == view.host_offset - start
            assert (view.host_offset * view.spec.dtype.itemsize) % ALIGN_BYTES == 0
    # views never overlap inside a slab
    spans = sorted(
        (v.spec.dtype.itemsize, v.host_offset, v.spec.numel)
        for c in plan.chunks
        for v in c.views
        if v.spec.dtype == torch.float32
    )
    for (_, a, n), (_, b, _) in zip(spans, spans[1:], strict=False):
        assert a + n <= b
    assert plan.slot_numel[torch.float32] == max(
        stop - start
        for c in plan.chunks
        for d, (start, stop) in c.host_ranges.items()
        if d == torch.float32
    )
    assert plan.host_bytes >= sum(p.invariant_bytes for p in params)


def test_plan_is_rank_invariant_for_uneven_shards():
    # 255 x 8 over two ranks: local shards of 128 and 127 rows, the same invariant size
    def rank_params(rows: int) -> list[ParamSpec]:
        return [
            ParamSpec(255 * 8 // 2, (StateSpec("m", torch.Size([rows, 8]), torch.float32),)),
            ParamSpec(64, (StateSpec("m", torch.Size([64]), torch.float32),)),
        ]

    plans = [
        plan_offload([[0], [1]], rank_params(rows), chunk_bytes=4096) for rows in (128, 127, 0)
    ]
    assert len({tuple(c.units for c in p.chunks) for p in plans}) == 1


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
