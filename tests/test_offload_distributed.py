"""CPUOffloadOptimizer under FSDP2 on gloo: same chunk plan on every rank, bitwise exact."""

from __future__ import annotations

import copy
import os
import statistics
import warnings

import pytest
import torch
import torch.distributed as dist
from fake_step_timer import FakeStepTimer
from spawn_ranks import one_rank_group, run_on_ranks

from offload import CPUOffloadOptimizer


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 255),  # rows do not divide 2 or 3; rows of 16 can be sliced
        torch.nn.Tanh(),
        torch.nn.Linear(255, 2),  # fewer rows than ranks at world size 3: an empty shard
        torch.nn.Linear(2, 7),
    )


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, optimizer, rank: int, steps: int = 5) -> None:
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        optimizer.zero_grad()
        inputs = torch.randn(3, model[0].in_features, generator=gen)
        model(inputs).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failures = []
    optimizers = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }
    # (optimizer, chunk_bytes, resident budget, forward overlap); chunk_bytes=1 slices params
    cases = [
        ("adamw", 2**40, "none", False),
        ("adamw", 2048, "one_unit", True),
        ("adamw", 1, "part", True),
        ("adamw", 2048, "all", False),
        ("sgd", 1, "part", False),
    ]
    for name, chunk_bytes, budget, overlap in cases:
        case = f"{name}/{chunk_bytes}/{budget}/{'overlap' if overlap else 'plain'}"
        plain_model, offload_model = _shard(_model(0), mesh), _shard(_model(0), mesh)
        keys = 2 if name == "adamw" else 1
        # rank-invariant state bytes: global numel / shards, per fp32 state tensor
        sizes = [keys * 4 * (p.numel() // world) for p in offload_model.parameters()]
        resident = {
            "none": 0,
            "one_unit": sizes[0] if overlap else sizes[-1],
            # two whole units and half the next, from the end residency takes them
            "part": sum(sizes[:2]) + sizes[2] // 2 if overlap else sum(sizes[-2:]) + sizes[-3] // 2,
            "all": sum(sizes),
        }[budget]
        plain = optimizers[name](plain_model.parameters())
        offloaded = CPUOffloadOptimizer(
            optimizers[name](offload_model.parameters()),
            chunk_bytes=chunk_bytes,
            staging_slots=2,
            overlap_forward=offload_model if overlap else None,
            gpu_resident_bytes=resident,
        )
        _train(plain_model, plain, rank)
        _train(offload_model, offloaded, rank)
        offloaded.wait_for_optimizer_step()
        chunks = [
            (c.params, tuple(s.param for s in c.slices), c.resident) for c in offloaded.plan.chunks
        ]
        gathered = [None] * world
        dist.all_gather_object(gathered, chunks)
        if any(g != chunks for g in gathered):
            failures.append(f"{case}: chunk plans differ: {gathered}")
        if (offloaded.plan.resident_bytes > 0) != (budget != "none"):
            failures.append(f"{case}: resident bytes {offloaded.plan.resident_bytes}")
        if chunk_bytes == 1 and not any(c.slices for c in offloaded.plan.chunks):
            failures.append(f"{case}: no param was sliced")
        for a, b in zip(plain_model.parameters(), offload_model.parameters(), strict=True):
            if not torch.equal(a.to_local(), b.to_local()):
                failures.append(f"{case}: params differ")
        ref, got = plain.state_dict()["state"], offloaded.state_dict()["state"]
        for index, entries in ref.items():
            for key, value in entries.items():
                other = got[index][key]
                if hasattr(value, "to_local"):
                    if type(other) is not type(value) or not torch.equal(
                        value.to_local(), other.to_local()
                    ):
                        failures.append(f"{case}: state {index}.{key}")
                elif not torch.equal(value, other):
                    failures.append(f"{case}: state {index}.{key}")
        offloaded.close()
    assert not failures, failures


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_offload_matches_plain_bitwise(world):
    run_on_ranks(_worker, world)


def _short_shard_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(3, 4), (5, 64), (3,), (90, 8)]  # (5, 64): rows 2, 2, 1 over 3 ranks

    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [
            torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)]))
            for s in shapes
        ]

    plain_params, params_ = params(), params()
    plain = torch.optim.AdamW(plain_params, lr=1e-2)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(params_, lr=1e-2), chunk_bytes=704, gpu_resident_bytes=2**30
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)]) for s in shapes]
        for optimizer, ps in ((plain, plain_params), (opt, params_)):
            for index, (p, grad) in enumerate(zip(ps, grads, strict=True)):
                p.grad = None if (step, index) == (0, 2) else grad.clone()
            optimizer.step()
    sliced = [(s.start, s.stop) for c in opt._executor.chunks for s in c.slices]
    assert (64, 64) in sliced or rank != 2  # the short shard's trailing slice is empty
    for a, b in zip(plain_params, params_, strict=True):
        assert torch.equal(a.to_local(), b.to_local())


def test_resident_slices_of_a_shorter_shard_step_once_each_bitwise():
    """A resident param cut over chunks, on the rank whose shard is shorter (its trailing
    slice empty), with a chunk that creates state (a param without a grad on the first
    step) cutting the run: the slices in the first run cover that rank's shard, but the
    param is not whole there; stepped whole, its empty slice raised on that rank alone."""
    run_on_ranks(_short_shard_worker, 3)


def _deep_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(12, 12) for _ in range(8)))


def _assert_overlap_matches_plain(
    plain_model, model, rank: int, chunk_bytes: int = 1
) -> CPUOffloadOptimizer:
    """AdamW offloaded with forward overlap (by default one slice a chunk) equals plain
    AdamW bitwise; returns the wrapper."""
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    overlapped = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=chunk_bytes,
        staging_slots=2,
        overlap_forward=model,
    )
    _train(plain_model, plain, rank)
    _train(model, overlapped, rank)
    overlapped.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    return overlapped


def _prefetch_worker(rank: int, world: int, ahead: int) -> None:
    # FSDP2 all-gathers a prefetched module in an earlier module's pre-forward: with
    # forward overlap, that module's chunk must have stepped by then.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    layers = list(model)
    for i, layer in enumerate(layers[:-ahead]):
        layer.set_modules_to_forward_prefetch([layers[i + ahead]])
    _assert_overlap_matches_plain(plain_model, model, rank)


@pytest.mark.parametrize("ahead", [1, 4])
def test_fsdp2_forward_prefetch_waits_for_the_prefetched_chunk(ahead):
    run_on_ranks(_prefetch_worker, 2, ahead)


def _first_wait_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _shard(_deep_model(0), init_device_mesh("cpu", (world,)))
    layers = list(model)
    layers[0].set_modules_to_forward_prefetch([layers[2]])
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=1, overlap_forward=model
    )
    first = opt._overlap.first_wait(set(model.parameters()))
    expected = [*layers[0].parameters(), *layers[2].parameters()]
    assert len(first) == len(expected)
    assert all(a is b for a, b in zip(first, expected, strict=True))


def test_what_the_forward_first_waits_for_includes_what_fsdp2_prefetches_there():
    """The default backward loads cover the first module's unit and the units its
    pre-forward all-gathers ahead of them."""
    run_on_ranks(_first_wait_worker, 2)


def _room_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from offload import cpu_offload

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    # rank 0's device has room for every chunk, rank 1's for none beyond the first wait
    room = 2**40 if rank == 0 else 0
    cpu_offload.room_under_peak_bytes = lambda device: room
    opt = _assert_overlap_matches_plain(plain_model, model, rank, chunk_bytes=256)
    loads = torch.tensor([opt.schedule.backward_loads])
    everyone = [torch.zeros_like(loads) for _ in range(world)]
    dist.all_gather(everyone, loads)
    assert len({int(t) for t in everyone}) == 1  # the least room: one schedule
    assert int(loads) < len(opt.plan.chunks)


def test_fsdp2_default_backward_loads_take_the_least_room_over_the_ranks():
    run_on_ranks(_room_worker, 2)


def _shared_unit_worker(rank: int, world: int) -> None:
    # fully_shard([a, b]) makes one unit (torchtitan shards norm + lm_head together):
    # whichever module runs first all-gathers both, so it must wait for both's chunks.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        layers = list(model)
        fully_shard([layers[1], layers[6]], mesh=mesh)
        for i, layer in enumerate(layers):
            if i not in (1, 6):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    plain_model, model = shard(_deep_model(0)), shard(_deep_model(0))
    _assert_overlap_matches_plain(plain_model, model, rank)


def test_fsdp2_modules_sharded_together_wait_for_each_others_chunks():
    run_on_ranks(_shared_unit_worker, 2)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    from muon import Muon, muon_param_groups

    return Muon(muon_param_groups(model), lr=1e-2, bucket_cap_bytes=64)  # several buckets


def _sharded_auto(world: int, timer, make=_adamw, **options):
    """A plain optimizer (`make(model)`, AdamW by default) on a deep model sharded over
    `world` CPU ranks, and an overlapped "auto" one on its twin, timed by `timer(opt)`:
    (plain model, plain, model, opt)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    plain = make(plain_model)
    opt = CPUOffloadOptimizer(
        make(model),
        chunk_bytes=1,
        staging_slots=2,
        overlap_forward=model,
        gpu_resident_bytes="auto",
        **options,
    )
    opt._auto.timer = timer(opt)
    return plain_model, plain, model, opt


def _backward_loads_and_auto_worker(rank: int, world: int) -> None:
    # Loads in the backward, and "auto" from stalls the ranks measured differently (rank 1
    # also stalled at the forward's end): one agreed choice, the same chunks everywhere.
    from offload.residency import AUTO_MEASURED_STEPS, AUTO_WARMUP_STEPS

    plain_model, plain, model, opt = _sharded_auto(
        world,
        lambda opt: FakeStepTimer(stall_first=True, stall_last=rank == 1),
        # the ring's 1 kB, the backward's 2 slots and part of the ~2.5 kB of state
        gpu_budget_bytes=3500,
        load_in_backward=True,
    )
    steps = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS + 3
    _train(plain_model, plain, rank, steps)
    _train(model, opt, rank, steps)
    opt.wait_for_optimizer_step()
    assert opt.chunks_loaded_in_backward == 2  # auto decided, then the backward loaded
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    ref, got = plain.state_dict()["state"], opt.state_dict()["state"]
    for index, entries in ref.items():
        for key, value in entries.items():
            if key != "step":
                assert torch.equal(value.to_local(), got[index][key].to_local()), (index, key)
    mine = (opt.residency, [(c.params, c.slices, c.resident) for c in opt.plan.chunks])
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    (choice0, chunks0), (choice1, chunks1) = gathered
    assert chunks0 == chunks1  # one plan
    assert choice0.resident_bytes == choice1.resident_bytes > 0
    assert choice0.resident_bytes < choice0.state_bytes
    assert opt.plan.held_bytes(opt.schedule.slots, opt.staging_slots) <= 3500
    # the ranks measured different stalls (rank 1's needed more than rank 0's)
    assert choice0.measured_stall_ms < choice1.measured_stall_ms


def test_fsdp2_loads_in_the_backward_and_auto_agree_across_ranks_bitwise():
    run_on_ranks(_backward_loads_and_auto_worker, 2)


def _train_failing_at(fails: int, plain, offloaded, rank: int, error: type, match: str) -> None:
    """`fails + 3` steps of the plain (model, optimizer) and the offloaded one, alike but
    that the offloaded step `fails` raises `error` (matching `match`) and the plain one
    skips it."""
    for m, o in (plain, offloaded):
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(fails + 3):
            o.zero_grad()
            m(torch.randn(3, m[0].in_features, generator=gen)).square().mean().backward()
            if step != fails:
                o.step()
            elif o is offloaded[1]:
                with pytest.raises(error, match=match):
                    o.step()


def _failed_replan_worker(rank: int, world: int) -> None:
    # The last rank runs out of memory in "auto"'s re-plan: every rank raises at that step
    # and steps what ran before from the next, bit-equal to AdamW skipping that step.
    from offload.residency import AUTO_MEASURED_STEPS, AUTO_WARMUP_STEPS

    plain_model, plain, model, opt = _sharded_auto(
        world, lambda opt: FakeStepTimer(stall_first=True), gpu_budget_bytes=2500
    )
    builds = []
    real_build = opt._build

    def build(*args, **kwargs):
        builds.append(len(builds))
        if len(builds) == 2 and rank == world - 1:  # the re-plan, on one rank
            raise torch.OutOfMemoryError("no room for the new plan")
        real_build(*args, **kwargs)

    opt._build = build
    failing = rank == world - 1
    _train_failing_at(
        AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS,
        (plain_model, plain),
        (model, opt),
        rank,
        torch.OutOfMemoryError if failing else RuntimeError,
        "no room" if failing else "rank",
    )
    opt.wait_for_optimizer_step()
    assert (opt.residency.resident_bytes, opt.plan.resident_bytes) == (0, 0)
    assert len(builds) == 3  # planned anew at the next step, once
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    ref, got = plain.state_dict()["state"], opt.state_dict()["state"]
    for index, entries in ref.items():
        for key, value in entries.items():
            assert (
                torch.equal(value, got[index][key])
                if key == "step"
                else torch.equal(value.to_local(), got[index][key].to_local())
            ), (index, key)
    gathered = [None] * world
    dist.all_gather_object(gathered, [(c.params, c.slices, c.resident) for c in opt.plan.chunks])
    assert all(chunks == gathered[0] for chunks in gathered)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_auto_replan_failing_on_one_rank_fails_the_step_on_every_rank(world):
    run_on_ranks(_failed_replan_worker, world)


def _auto_search_worker(rank: int, world: int, make) -> None:
    # Each rank times its steps, its backward and its loads differently and has its own
    # budget and default backward loads (its room under its peak): they try the same
    # splits at the same steps and settle on one plan (for distributed Muon too, whose
    # resident state moves between its buckets' exchanges).
    from fake_step_timer import FakeSearchTimer

    from offload.residency import AUTO_STEPS_AT_MOST

    def iteration_ms(opt) -> float:
        state = 2 * 4 * sum(p.numel() for p in opt._params)  # rank-invariant
        kept = opt._resident_budget + (opt.backward_load_bytes or 0)
        return (1 + rank) * max(50.0, 100.0 - 100.0 * kept / state) + rank

    plain_model, plain, model, opt = _sharded_auto(
        world,
        lambda opt: FakeSearchTimer(lambda: iteration_ms(opt), 5.0 + rank, 100.0),
        make,
        gpu_budget_bytes=[10**6, 4000, 6000][rank],
    )
    opt._default_backward_bytes = lambda: [300, 100, 40][rank]  # under the backward's cap (325)
    auto = opt._auto
    steps = AUTO_STEPS_AT_MOST + 1
    _train(plain_model, plain, rank, steps)
    _train(model, opt, rank, steps)
    opt.wait_for_optimizer_step()
    assert opt.residency is not None and len(opt.residency.probes) >= 2
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    mine = (
        opt.residency,
        [(c.params, c.slices, c.resident) for c in opt.plan.chunks],
        auto._splits,  # what the search could try: the same everywhere
    )
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    (choice0, chunks0, splits0), *others = gathered
    for choice, chunks, splits in others:
        assert chunks == chunks0  # one plan
        assert splits == splits0
        # the same tries, each timed as the slowest rank's (iterations_ms: each rank's own)
        tries = [(p.split, p.iteration_ms) for p in choice.probes]
        assert tries == [(p.split, p.iteration_ms) for p in choice0.probes]
        assert all(
            p.iteration_ms >= statistics.median(p.iterations_ms)
            for p in choice.probes
            if p.iterations_ms
        )
        assert choice.budget_bytes == choice0.budget_bytes == 4000  # the least budget
        assert choice.backward_load_bytes == choice0.backward_load_bytes


@pytest.mark.parametrize(
    "world, make", [(2, _adamw), (3, _adamw), (3, _muon)], ids=["adamw-2", "adamw-3", "muon-3"]
)
def test_fsdp2_auto_search_agrees_across_ranks_bitwise(world, make):
    run_on_ranks(_auto_search_worker, world, make)


def _slower_rank_worker(rank: int, world: int) -> None:
    # Rank r's steps take (1 + r) times rank 0's: each rank's own steps of a split are as
    # much slower than its own fastest, so a split clearly slower than the fastest (past
    # NOISE_CAP) ends its probe early on every rank alike.
    from fake_step_timer import FakeSearchTimer

    from offload.residency import AUTO_STEPS_AT_MOST, NOISE_CAP, SLOW_PROBE_STEPS

    def iteration_ms(opt) -> float:
        state = 2 * 4 * sum(p.numel() for p in opt._params)  # rank-invariant
        kept = opt._resident_budget + (opt.backward_load_bytes or 0)
        return (1 + rank) * max(50.0, 100.0 - 100.0 * kept / state)

    plain_model, plain, model, opt = _sharded_auto(
        world, lambda opt: FakeSearchTimer(lambda: iteration_ms(opt), 5.0, 100.0), _adamw
    )
    steps = AUTO_STEPS_AT_MOST + 1
    _train(plain_model, plain, rank, steps)
    _train(model, opt, rank, steps)
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    probes = opt.residency.probes
    fastest = min(p.iteration_ms for p in probes)
    slow = [p for p in probes[1:] if p.iteration_ms > (1 + NOISE_CAP) * fastest]
    assert slow, probes
    assert all(len(p.iterations_ms) == SLOW_PROBE_STEPS - 2 for p in slow), probes


def test_fsdp2_auto_ends_a_clearly_slower_probe_early_on_ranks_of_different_speeds():
    run_on_ranks(_slower_rank_worker, 2)


def _whole_checkpoint_worker(rank: int, world: int) -> None:
    """A single-process Muon checkpoint (whole plain tensors, or Replicate DTensors) loaded
    on every rank into offloaded Muon over FSDP2 params: each rank's homes take its shard,
    as plain Muon's load cuts it. Before, the wrapper checked the whole tensor against the
    shard's shape and refused it ("load a state_dict saved for these params")."""
    from torch.distributed.device_mesh import init_device_mesh

    from muon import Muon

    mesh = init_device_mesh("cpu", (world,))
    single = _model(0)
    single_opt = Muon(_muon_groups(single), lr=1e-2)
    _train(single, single_opt, rank=0, steps=2)
    saved = single_opt.state_dict()
    # the same state as Replicate DTensors: a checkpoint of a model placed otherwise
    replicated = copy.deepcopy(saved)
    for entries in replicated["state"].values():
        for key, value in entries.items():
            if value.ndim:
                entries[key] = torch.distributed.tensor.distribute_tensor(
                    value, mesh, [torch.distributed.tensor.Replicate()]
                )
    results = []
    for wrap, checkpoint in ((False, saved), (True, saved), (True, replicated)):
        model = _shard(_model(0), mesh)
        with torch.no_grad():
            for p, q in zip(model.parameters(), single.parameters(), strict=True):
                p.copy_(torch.distributed.tensor.distribute_tensor(q, mesh, p.placements))
        opt = Muon(_muon_groups(model), lr=1e-2)
        if wrap:
            opt = CPUOffloadOptimizer(opt, chunk_bytes=2048, overlap_forward=model)
        opt.load_state_dict(copy.deepcopy(checkpoint))
        _train(model, opt, rank, steps=2)
        if wrap:
            opt.wait_for_optimizer_step()
        results.append([p.to_local().clone() for p in model.parameters()])
    for resumed in results[1:]:
        for a, b in zip(results[0], resumed, strict=True):
            assert torch.equal(a, b)


def _muon_groups(model: torch.nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [{"params": matrices}, {"params": others, "algorithm": "adamw"}]


def test_fsdp2_offloaded_muon_loads_a_single_process_checkpoint_as_plain_muon():
    run_on_ranks(_whole_checkpoint_worker, 2)


def _reads_after_step_worker(rank: int, world: int, read: str) -> None:
    """A read of a weight between step() and the next forward runs the pending Muon
    chunks, whose exchanges are collectives: made on every rank it is exact, and it warns
    (once) that a read on one rank alone would hang every rank: a read of an early
    layer's weight (its chunk enqueued, the ones it looks ahead to not yet), or of the
    wrapper's `state`. AdamW's chunks do not communicate: no warning."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from muon import Muon

    mesh = init_device_mesh("cpu", (world,))
    for algorithm in ("muon", "adamw"):
        results = []
        for wrap in (False, True):
            model = _shard(_deep_model(0), mesh)
            opt = (
                Muon(_muon_groups(model), lr=1e-2, bucket_cap_bytes=300)  # a matrix a unit
                if algorithm == "muon"
                else torch.optim.AdamW(model.parameters(), lr=1e-2)
            )
            if wrap:
                opt = CPUOffloadOptimizer(
                    opt, chunk_bytes=300, staging_slots=2, overlap_forward=model
                )
            gen = torch.Generator().manual_seed(100 + rank)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(3):
                    model(torch.randn(3, 12, generator=gen)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if read == "weight":
                        model[1].weight.to_local().norm()  # a log of a weight
                    elif wrap:
                        opt.state[model[1].weight]  # a log of its state
            if wrap:
                opt.wait_for_optimizer_step()
            said = [w for w in caught if "hangs every rank" in str(w.message)]
            assert len(said) == (wrap and algorithm == "muon"), (algorithm, wrap, said)
            results.append([p.to_local().clone() for p in model.parameters()])
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), algorithm


@pytest.mark.parametrize("read", ["weight", "state"])
def test_fsdp2_reads_between_step_and_forward_that_run_muon_exchanges_warn_and_stay_exact(read):
    run_on_ranks(_reads_after_step_worker, 2, read)


def _group_destroyed_worker(rank: int, world: int, regroup: str, tail: str) -> None:
    """A pending Muon step whose exchanges need the process group the trainer destroyed:
    close() says so (torch's error named a group "registered under the name 0"); where
    only AdamW chunks are left pending (`tail`), they need no group and land. A new group
    (`regroup`) then lets the ranks end as usual."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from muon import Muon

    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 12) for _ in range(2 if tail == "adamw" else 8)]
    if tail == "adamw":  # Muon's matrices step inside step(), the norms' AdamW after it
        layers += [torch.nn.LayerNorm(12) for _ in range(6)]
    model = _shard(torch.nn.Sequential(*layers), init_device_mesh("cpu", (world,)))
    opt = CPUOffloadOptimizer(
        Muon(_muon_groups(model), lr=1e-2, bucket_cap_bytes=300),  # a matrix a unit
        chunk_bytes=300,
        staging_slots=2,
        overlap_forward=model,
    )
    model(torch.randn(3, 12)).square().mean().backward()
    opt.step()  # its later chunks pending
    dist.destroy_process_group()
    try:
        if tail == "muon":
            with pytest.raises(RuntimeError, match=r"group is gone .* before destroy_process"):
                opt.close()
        opt.close()  # closed: the step landed or stopped at that chunk, nothing pending
        assert torch._C._len_torch_function_stack() == 0  # its waiting mode went too
    finally:
        dist.init_process_group(
            "gloo", init_method=f"file://{regroup}", rank=rank, world_size=world
        )


@pytest.mark.parametrize("tail", ["muon", "adamw"])
def test_closing_a_pending_muon_step_after_the_group_is_destroyed_says_so(tmp_path, tail):
    run_on_ranks(_group_destroyed_worker, 2, str(tmp_path / "regroup"), tail)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_chunked_step_reads_shards_without_to_local(monkeypatch, overlap):
    # DTensor.to_local() builds a view through an autograd function at every call; the
    # chunked step made a few per param on the trainer's thread, every step. It reads the
    # shard itself: an offloaded iteration calls to_local() as often as a plain one does.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        calls = []
        to_local = DTensor.to_local
        monkeypatch.setattr(
            DTensor, "to_local", lambda *a, **k: calls.append(1) or to_local(*a, **k)
        )
        counts = {}
        for offloaded in (False, True):
            model = _shard(_model(0), mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
            if offloaded:
                optimizer = CPUOffloadOptimizer(
                    optimizer, chunk_bytes=1, overlap_forward=model if overlap else None
                )
            _train(model, optimizer, rank=0, steps=2)
            calls.clear()
            _train(model, optimizer, rank=0, steps=2)
            getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
            counts[offloaded] = len(calls)
        assert counts[True] == counts[False]


def _muon_wrapped_apart(rank: int, world: int, option: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from muon import Muon

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(12, 12, bias=False) for _ in range(4)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = [p.full_tensor() for p in model.parameters()]
    options, message = {
        "chunk_bytes": ({"chunk_bytes": 300 if rank == 0 else 2000}, "chunk_bytes: 300 vs 2000"),
        "auto": ({"gpu_resident_bytes": "auto" if rank == 0 else 0}, "bytes: 'auto' vs 0"),
        "overlap": ({"overlap_forward": model if rank == 0 else None}, "forward: True vs False"),
        "auto_backward": (  # "auto" planned the same first chunks, then decided apart
            {
                "overlap_forward": model,
                "gpu_resident_bytes": "auto",
                "load_in_backward": None if rank == 0 else False,
            },
            "load_in_backward: None vs False",
        ),
    }[option]
    opt = CPUOffloadOptimizer(Muon(model.parameters(), lr=1e-2, bucket_cap_bytes=300), **options)
    model(torch.randn(3, 12)).square().mean().backward()
    for _ in range(2):  # and again: a refused plan was kept, and the retry stepped it
        with pytest.raises(ValueError, match=rf"offload [a-z_]*{message}"):
            opt.step()
    assert all(
        torch.equal(a, b.full_tensor()) for a, b in zip(before, model.parameters(), strict=True)
    )


@pytest.mark.parametrize("option", ["chunk_bytes", "auto", "overlap", "auto_backward"])
def test_ranks_that_wrap_distributed_muon_with_other_chunks_are_refused_on_every_rank(option):
    # their chunks ordered Muon's exchanges apart: buckets of one size paired up wrongly,
    # and every rank trained on silently with wrong params ("auto" on one rank hung later)
    run_on_ranks(_muon_wrapped_apart, 2, option)


def _sharded_linears_and_muon(world: int):
    """Four Linear(12, 12) layers fully_shard'ed over `world` ranks, and Muon over them
    (the weights Muon's, the biases AdamW's): (model, weights, biases, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from muon import Muon

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(12, 12) for _ in range(4)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weights = [layer.weight for layer in model]
    biases = [layer.bias for layer in model]
    groups = [{"params": weights}, {"params": biases, "algorithm": "adamw"}]
    return model, weights, biases, Muon(groups, lr=1e-2, bucket_cap_bytes=300)


def _muon_refused_on_one_rank(rank: int, world: int, offloaded: bool, key: str) -> None:
    model, weights, biases, opt = _sharded_linears_and_muon(world)
    before = [p.full_tensor() for p in model.parameters()]
    if offloaded:
        opt = CPUOffloadOptimizer(opt)
    inner = getattr(opt, "optimizer", opt)
    param = {"momentum_buffer": weights[2], "exp_avg": biases[2]}[key]
    if rank == 1:  # state assigned by hand, shaped wrong on this rank alone
        inner.state[param][key] = torch.zeros(5)
    model(torch.randn(3, 12)).square().mean().backward()
    # the refusing rank names its state; its peer, the rank that refused
    peer = r"ranks 0 and 1 .*'yes' vs 'no, see the error on that rank'"
    expected = rf"{key}.*\(5,\)" if rank == 1 else peer
    with pytest.raises(ValueError, match=expected):
        opt.step()
    assert all(
        torch.equal(a, b.full_tensor()) for a, b in zip(before, model.parameters(), strict=True)
    )
    if rank == 1:  # fixed, every rank steps on
        del inner.state[param][key]
    opt.step()
    assert not torch.equal(before[0], model[0].weight.full_tensor())


@pytest.mark.parametrize(
    "offloaded, key", [(False, "momentum_buffer"), (True, "momentum_buffer"), (True, "exp_avg")]
)
def test_a_first_step_refused_on_one_rank_of_distributed_muon_is_refused_on_every_rank(
    offloaded, key
):
    # the refusing rank raised before the ranks' agreement on the plan (Muon's, the offload
    # wrapper's chunks), and its peers waited there for it (gloo: until its connection closed)
    run_on_ranks(_muon_refused_on_one_rank, 2, offloaded, key)


def _adamw_refused_on_one_rank(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    plain, inner = _adamw(plain_model), _adamw(model)
    opt = CPUOffloadOptimizer(inner, chunk_bytes=1, overlap_forward=model)
    param = next(iter(model.parameters()))
    if rank == 1:  # state assigned by hand, shaped wrong on this rank alone
        inner.state[param]["exp_avg"] = torch.zeros(5)
    inputs = torch.randn(3, 12, generator=torch.Generator().manual_seed(100 + rank))
    for m in (plain_model, model):
        m(inputs).square().mean().backward()
    plain.step()
    before = [p.full_tensor() for p in model.parameters()]
    expected = "exp_avg" if rank == 1 else "another rank refused"
    with pytest.raises(ValueError, match=expected):
        opt.step()
    assert all(
        torch.equal(a, b.full_tensor()) for a, b in zip(before, model.parameters(), strict=True)
    )
    if rank == 1:  # fixed, every rank steps on
        del inner.state[param]["exp_avg"]
    opt.step()
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())  # one step on every rank


def test_a_first_overlapped_adamw_step_refused_on_one_rank_is_refused_on_every_rank():
    # Before, the peer went on into the first plan's collective and waited there; the
    # refusing rank's next step paired with it, and the peer ran a step it did not.
    run_on_ranks(_adamw_refused_on_one_rank, 2)


def _muon_planned_then_refused_on_one_rank(rank: int, world: int, before: str) -> None:
    model, weights, biases, inner = _sharded_linears_and_muon(world)
    model(torch.randn(3, 12)).square().mean().backward()
    if before == "stepped":  # Muon's plan is built: it agrees with no peer when it refuses
        inner.step()
        opt = CPUOffloadOptimizer(inner)
    else:  # the wrapper refused a first step on every rank, after Muon's plan was built
        opt = CPUOffloadOptimizer(inner)
        if rank == 1:
            inner.state[biases[2]]["exp_avg"] = torch.zeros(5)
        with pytest.raises(ValueError):
            opt.step()
        if rank == 1:
            del inner.state[biases[2]]["exp_avg"]
    if rank == 1:
        inner.state[weights[2]]["momentum_buffer"] = torch.zeros(5)
    peer = r"ranks 0 and 1 .*'yes' vs 'no, see the error on that rank'"
    with pytest.raises(ValueError, match=r"momentum_buffer Tensor \(5,\)" if rank == 1 else peer):
        opt.step()


@pytest.mark.parametrize("before", ["stepped", "refused"])
def test_a_first_offloaded_step_one_rank_of_a_planned_muon_refuses_is_refused_on_every_rank(
    before,
):
    # Muon refused from its built plan on one rank, and its peers waited in the wrapper's
    # first agreement (found by a review)
    run_on_ranks(_muon_planned_then_refused_on_one_rank, 2, before)


def _resident_on_a_rank_without_experts(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon import Muon

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    stack = torch.nn.Parameter(distribute_tensor(torch.randn(1, 9, 6), mesh, [Shard(0)]))
    opt = CPUOffloadOptimizer(Muon([stack]), chunk_bytes=256, gpu_resident_bytes=300)
    stack.grad = distribute_tensor(torch.ones(1, 9, 6), mesh, [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert [c.resident for c in opt.plan.chunks] == [True]


def test_a_rank_holding_no_expert_does_not_warn_that_its_resident_budget_keeps_nothing():
    # rank 1 holds none of the one expert: its resident bytes are 0, and it warned
    # "keeps no state on the GPU ... give at least 108 bytes" of a unit that is resident
    # (found by an EP audit)
    run_on_ranks(_resident_on_a_rank_without_experts, 2)


def _sees_the_environment(rank: int, world: int, name: str, value: str) -> None:
    assert os.environ.get(name) == value, (name, os.environ.get(name))


def test_ranks_see_an_environment_variable_the_test_set(monkeypatch):
    # the ranks fork from a server started before the test (`spawn_ranks`): a variable the
    # test sets (a backend for its workers) must still reach them
    monkeypatch.setenv("MUON_ELEMENTWISE_BACKEND", "torch")
    run_on_ranks(_sees_the_environment, 2, "MUON_ELEMENTWISE_BACKEND", "torch")


def _tuning_worker(rank: int, world: int, make) -> None:
    # The default's backward loads grow from what each rank timed (rank r stalls (1 + r)
    # times rank 0's, loads a little slower, has a longer backward and its own headroom):
    # every rank takes the slowest rank's stall and the least rate and backward, and
    # grows to the same chunks at the same steps.
    from fake_step_timer import FakeTuningTimer
    from torch.distributed.device_mesh import init_device_mesh

    import offload.cpu_offload
    from offload.backward_tuning import TUNING_STEPS_AT_MOST, BackwardTuning

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    plain = make(plain_model)
    opt = CPUOffloadOptimizer(make(model), chunk_bytes=1, staging_slots=2, overlap_forward=model)
    first: list[int] = []

    def loaded() -> int:
        return sum(opt.plan.chunks[c].invariant_bytes for c in opt.schedule.loaded_in_backward)

    def stall() -> float:
        if not first:
            first.extend(
                (loaded(), opt.plan.held_bytes(opt.schedule.slots, opt.schedule.ring_slots))
            )

        return max(0.0, 20.0 * (1 + rank) - (loaded() - first[0]) / 10.0)

    opt.backward_tuning = None
    opt._tuning = BackwardTuning(lambda: FakeTuningTimer(stall, 200.0 + rank, 10.0 + rank))
    headroom = [10**9, 600, 300][rank]  # at world 3, rank 2's holds part of the growth

    def free_at_peak(device) -> int:  # what a round grew is held at the next one's
        held = opt.plan.held_bytes(opt.schedule.slots, opt.schedule.ring_slots)
        if world == 3 and rank == 1 and opt._gpu_budget_bytes is None:
            # a budget above what rank 2's headroom holds, which binds first
            opt._gpu_budget_bytes = held + 500
        return headroom - (held - first[1]) if first else headroom

    offload.cpu_offload.device_headroom_bytes = free_at_peak
    _train(plain_model, plain, rank, TUNING_STEPS_AT_MOST + 1)
    _train(model, opt, rank, TUNING_STEPS_AT_MOST + 1)
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    mine = (opt.backward_tuning, opt.schedule.loaded_in_backward)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    assert all(g == gathered[0] for g in gathered)
    grown = opt.backward_tuning[0]
    assert grown.stall_ms == 20.0 * world  # the slowest rank's
    assert (grown.load_bytes_per_ms, grown.backward_ms) == (10.0, 200.0)  # the least
    assert grown.chosen_bytes > grown.loaded_bytes == first[0]
    assert loaded() > first[0]
    held = opt.plan.held_bytes(opt.schedule.slots, opt.schedule.ring_slots)
    assert held - first[1] <= headroom
    # at world 3 rank 2's headroom held the growth back, which every rank's record says
    # (not rank 1's budget, which would have held it back further up)
    assert grown.held_back_by == ("the device's headroom" if world == 3 else None)


@pytest.mark.parametrize("world, make", [(2, _adamw), (3, _muon)], ids=["adamw-2", "muon-3"])
def test_fsdp2_default_backward_loads_grow_alike_on_every_rank_bitwise(world, make):
    run_on_ranks(_tuning_worker, world, make)


def _budget_per_rank_worker(rank: int, world: int, make, budgets: str) -> None:
    # Each rank gives its own gpu_budget_bytes (its own free memory, say; rank 0 maybe
    # none), the lower ones under what the default's first loads hold: every rank loads the
    # fewest any rank's budget holds (distributed Muon's exchanges need the same chunks),
    # within its budget, and so again where a Muon group switched to AdamW and back
    # re-plans. With no budget anywhere, those re-plans load the first-wait chunks of
    # their own plan (the first plan's bytes loaded none of a regrouped plan's chunks).
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    models = [_shard(_deep_model(0), mesh) for _ in range(3)]
    plain_model, probe_model, model = models

    def offloaded(m, **options) -> CPUOffloadOptimizer:
        return CPUOffloadOptimizer(
            make(m), chunk_bytes=1, staging_slots=2, overlap_forward=m, **options
        )

    probe = offloaded(probe_model)
    _train(probe_model, probe, rank, steps=1)
    held = probe.plan.held_bytes(probe.schedule.slots, probe.schedule.ring_slots)
    default_loads = probe.schedule.backward_loads
    probe.close()
    budget = held - rank  # under the default's on every rank but rank 0
    if budgets == "none" or (budgets == "rank-0-none" and rank == 0):
        budget = None
    opt = offloaded(model, gpu_budget_bytes=budget)
    plain = make(plain_model)
    schedules = []
    build = opt._build
    opt._build = lambda step, **kw: (schedules.append(step.schedule), build(step, **kw))[1]
    regroups = make is _muon
    for m, o in ((plain_model, plain), (model, opt)):
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(6):
            if regroups and step in (2, 4):
                o.param_groups[0]["algorithm"] = "adamw" if step == 2 else "muon"
            o.zero_grad()
            m(torch.randn(3, 12, generator=gen)).square().mean().backward()
            o.step()
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    gathered = [None] * world
    dist.all_gather_object(gathered, schedules)
    assert all(g == gathered[0] for g in gathered)
    assert len(schedules) == (3 if regroups else 1)
    if budgets == "none":
        assert schedules[0].backward_loads == default_loads
        assert all(s.backward_loads >= min(2, len(s.staged)) for s in schedules)  # the ring's
    else:
        assert schedules[0].backward_loads < default_loads
    if budget is not None:
        assert opt.plan.held_bytes(opt.schedule.slots, opt.schedule.ring_slots) <= budget


@pytest.mark.parametrize("budgets", ["every-rank", "rank-0-none", "none"])
@pytest.mark.parametrize("world, make", [(2, _adamw), (3, _muon)], ids=["adamw-2", "muon-3"])
def test_fsdp2_a_gpu_budget_per_rank_loads_the_fewest_on_every_rank_bitwise(world, make, budgets):
    run_on_ranks(_budget_per_rank_worker, world, make, budgets)


def _loads_option_per_rank_worker(rank: int, world: int, room: int | None) -> None:
    # Rank 0 leaves load_in_backward to the default, rank 1 turns it off: neither waits for
    # the other in the default's agreement (rank 0 hung there), nor, where the device's
    # room under its peak is measured (CUDA's, made up here), in agreeing on the room.
    from torch.distributed.device_mesh import init_device_mesh

    import offload.cpu_offload

    offload.cpu_offload.room_under_peak_bytes = lambda device: room

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    opt = CPUOffloadOptimizer(
        _adamw(model),
        chunk_bytes=1,
        overlap_forward=model,
        load_in_backward=None if rank == 0 else False,
    )
    plain = _adamw(plain_model)
    _train(plain_model, plain, rank, steps=3)
    _train(model, opt, rank, steps=3)
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    assert (opt.schedule.backward_loads > 0) == (rank == 0)


@pytest.mark.parametrize("room", [None, 10**6], ids=["no-room", "room"])
def test_fsdp2_ranks_with_other_backward_load_options_do_not_wait_for_each_other(room):
    run_on_ranks(_loads_option_per_rank_worker, 2, room)


def _tuning_fails_on_one_rank_worker(rank: int, world: int, make) -> None:
    # The timer raises on rank 0 alone as the tuning decides: every rank's step raises
    # there (rank 0 its error, the others that it failed elsewhere), none hangs in the
    # tuning's collectives or steps alone, and the next steps go on with the loads they had.
    from fake_step_timer import FakeTuningTimer
    from torch.distributed.device_mesh import init_device_mesh

    from offload.backward_tuning import TIMED_STEPS, BackwardTuning

    mesh = init_device_mesh("cpu", (world,))
    plain_model, model = _shard(_deep_model(0), mesh), _shard(_deep_model(0), mesh)
    plain = make(plain_model)
    opt = CPUOffloadOptimizer(make(model), chunk_bytes=1, staging_slots=2, overlap_forward=model)

    def stall() -> float:
        if rank == 0:
            raise ValueError("the timer broke on rank 0")
        return 50.0

    opt._tuning = BackwardTuning(lambda: FakeTuningTimer(stall, 200.0, 10.0))
    _train_failing_at(
        1 + TIMED_STEPS,  # the first plan's step, the timed ones, then it decides
        (plain_model, plain),
        (model, opt),
        rank,
        ValueError if rank == 0 else RuntimeError,
        "rank 0" if rank == 0 else "another rank",
    )
    opt.wait_for_optimizer_step()
    assert opt._tuning is None and opt.backward_tuning == ()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())


@pytest.mark.parametrize("world, make", [(2, _adamw), (3, _muon)], ids=["adamw-2", "muon-3"])
def test_fsdp2_a_tuning_that_fails_on_one_rank_fails_that_step_on_every_rank(world, make):
    run_on_ranks(_tuning_fails_on_one_rank_worker, world, make)


def _uneven_16_bit_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16385), torch.nn.Linear(16385, 4))
        model = model.to(torch.bfloat16)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    plain_model, model = make(), make()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), chunk_bytes=8192)
    for m, o in ((plain_model, plain), (model, opt)):
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            o.zero_grad()
            m(torch.randn(3, 4, generator=gen).bfloat16()).float().square().mean().backward()
            o.step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    slices = [len(c.slices) for c in opt.plan.chunks]
    every = [None] * world
    dist.all_gather_object(every, slices)
    assert all(s == every[0] for s in every), every
    opt.close()


def test_uneven_shards_of_a_large_16_bit_param_cut_the_same_chunks_on_every_rank():
    # Whether a 16-bit param on the CPU may be sliced was asked of the rank's own shard:
    # 32772 elements on rank 0 (sliced: 4 chunks) and 32768 on rank 1 (6), where every rank
    # must cut the same chunks (review)
    run_on_ranks(_uneven_16_bit_worker, 2)
